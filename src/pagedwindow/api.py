"""The validating wrappers: every contract is checked before anything is written or launched.

``batch_prefill_paged_window`` reads attention through a plan; ``append_paged_kv`` writes the new rows' K/V into
their slots ("append then attend"); ``prepare_paged_qkv`` is Gemma's prep (q/k/v norms, RoPE) fused with that
write. Each routes to a backend: ``"reference"`` (PyTorch), ``"cuda"`` (our kernels)
or ``"auto"`` (cuda when the tensors are on a GPU and the kernels can run them, else the reference; a fallback
on GPU tensors warns once, with the reason).

Autograd: no op is differentiable. Inputs that require grad (q, k, v, norm weights) are read as detached values; a
tensor that would be written (``out``, ``lse``, ``out_q``, the pool) must not require grad, and one made under
``torch.inference_mode()`` may only be written inside inference mode. Both are refused before
any write, under torch.compile too.

Host cost: a call re-checks everything, but what depends only on the pool is cached (the checked geometry, keyed
by the layout, layer and the pool's dtype, shape and contiguity) and what depends only on the plan is computed once
per plan update (the kernels' parameter block). Within a call each tensor's address is read once (one pass feeds the
overlap check and, folded into one OR, the backend's alignment check), each expected shape is built once and
``torch.compiler.is_compiling()`` is asked once. An eager call on a GPU pool hands its tensors to the CUDA
backend's compiled call gate once the scalars, the plan and the pool are checked; the gate checks the tensors and
launches in one C call. When it refuses (nothing written), the checks here run and raise.
"""

from __future__ import annotations

import logging
import operator
import warnings
from collections.abc import Iterable
from types import ModuleType

import torch

from . import reference
from .errors import PagedWindowError, check_dense_tensor
from .gemma_prep import (
    MAX_HEAD_DIM,
    check_norm_style,
    check_prep_scalars,
    check_rope,
    rope_inv_freq,
)
from .layout import PagedGeometry, PagedKvLayout, checked_paged_geometry
from .plan import PrefillPagedPlan
from .semantics import check_sm_scale, check_window_left

BACKENDS = ("auto", "reference", "cuda")

prefill_observers: list = []
"""Callables run as ``observer(backend, q, pool, geometry, plan)`` before each prefill launch, with the backend
that runs it (``"reference"`` | ``"cuda"``). Empty unless someone records what ran
(``pagedwindow.measure.runtime.observe_backends``); nothing here depends on them."""


_cuda_module: list[ModuleType] = []  # the CUDA backend once imported


def _cuda_backend():
    if not _cuda_module:
        from . import cuda  # imported only when asked for: building kernels needs nvcc

        _cuda_module.append(cuda)
    return _cuda_module[0]


_fallbacks_warned: set[str] = set()
_log = logging.getLogger(__name__)


def _resolve_backend(
    what: str,
    backend: str,
    plan: PrefillPagedPlan,
    device: torch.device,
    dtype: torch.dtype,
    addresses,
    address_bits: int,
) -> str:
    """The backend that runs this call on ``device`` with tensors of ``dtype``; ``addresses``: the call's
    tensors' addresses (``_memory_spans``'s starts, any iterable; None under torch.compile, where tensors have
    none); ``address_bits``: their bitwise OR (``_memory_spans``), so that the backend walks ``addresses`` only to
    name a misaligned one."""
    if backend == "reference":
        return backend
    if backend not in BACKENDS:
        raise PagedWindowError(f"{what}: backend {backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        if device.type != "cuda":
            return "reference"
        cuda = _cuda_backend()
        reason = cuda.unavailable_reason() or cuda.unsupported(what, plan, dtype, addresses, address_bits)
        if reason is None:
            return "cuda"
        if reason not in _fallbacks_warned:
            _fallbacks_warned.add(reason)
            warnings.warn(
                f"{what}: backend 'auto' runs the PyTorch reference on {device}: {reason}", RuntimeWarning, stacklevel=3
            )
            _log.warning("%s: backend 'auto' runs the PyTorch reference on %s: %s", what, device, reason)
        else:
            _log.debug("%s: backend 'auto' runs the PyTorch reference on %s: %s", what, device, reason)
        return "reference"
    if device.type != "cuda":
        raise PagedWindowError(f"{what}: backend 'cuda' needs tensors on a CUDA device, got {device}")
    cuda = _cuda_backend()
    reason = cuda.unsupported(what, plan, dtype, addresses, address_bits)
    if reason is not None:
        raise PagedWindowError(f"{what}: backend 'cuda' does not support {reason}")
    cuda.require()  # raises PagedWindowError naming why the kernels cannot be built or loaded
    return "cuda"


def _check_plan(what: str, plan) -> None:
    """A plan that can drive a launch: a PrefillPagedPlan that has been filled."""
    if not isinstance(plan, PrefillPagedPlan):
        raise PagedWindowError(f"{what}: plan must be a PrefillPagedPlan, got {type(plan).__name__}")
    if not plan.filled:
        raise PagedWindowError(f"{what}: the plan was preallocated but never filled: call plan.update(...) first")


_geometries: dict[tuple, PagedGeometry] = {}
_GEOMETRY_CACHE_SIZE = 64


def _pool_geometry(what: str, layout, pool, layer, head_dim: int, num_kv_heads: int) -> PagedGeometry:
    """``checked_paged_geometry``, cached for plain tensors by everything the geometry is a function of
    (the layout, layer, heads, and the pool's dtype, shape and contiguity; not its device or address, which
    the geometry never reads)."""
    if type(pool) is not torch.Tensor or type(layer) is not int or type(layout) is not PagedKvLayout:
        return checked_paged_geometry(what, layout, pool, layer, head_dim, num_kv_heads)
    try:
        key = (layout, layer, head_dim, num_kv_heads, pool.dtype, pool.shape, pool.is_contiguous())
    except RuntimeError:  # a tensor without sizes or strides (nested, sparse): the full check names it
        return checked_paged_geometry(what, layout, pool, layer, head_dim, num_kv_heads)
    geometry = _geometries.get(key)
    if geometry is None:
        geometry = checked_paged_geometry(what, layout, pool, layer, head_dim, num_kv_heads)
        if len(_geometries) >= _GEOMETRY_CACHE_SIZE:
            _geometries.clear()
        _geometries[key] = geometry
    return geometry


def _check_plan_against_pool(what: str, plan, geometry: PagedGeometry) -> None:
    """The plan's page size is the pool's, and its recorded bounds fit the pool (the kernels have no device-side
    bounds check)."""
    if plan.page_size != geometry.page_size:  # first: the bounds below are in the pool's pages
        raise PagedWindowError(
            f"{what}: plan.page_size {plan.page_size} disagrees with the pool's {geometry.page_size}"
        )
    if plan.max_page_index >= geometry.num_pages:
        raise PagedWindowError(
            f"{what}: plan page id {plan.max_page_index} is past the pool's {geometry.num_pages} pages "
            f"(bound {geometry.num_pages - 1})"
        )
    if plan.max_last_page_len > geometry.page_size:  # the plan keeps it within its page size: a guard
        raise PagedWindowError(
            f"{what}: plan last_page_len {plan.max_last_page_len} exceeds page_size {geometry.page_size}"
        )


def _plan_on_pool(what: str, plan, layout, pool, layer):
    """A filled plan whose recorded bounds fit the checked pool; returns (the plan's state, the geometry)."""
    _check_plan(what, plan)
    state = plan.state
    geometry = _pool_geometry(what, layout, pool, layer, state.head_dim, state.num_kv_heads)
    if pool.is_meta:
        raise PagedWindowError(f"{what}: pool is on the meta device (it holds no data to read or write)")
    _check_plan_against_pool(what, state, geometry)
    return state, geometry


def _check_rows(what: str, name: str, t, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """``t`` is a contiguous tensor ``[>= rows, *tail]`` of ``dtype`` on ``device`` (the pool's), where
    ``shape = (rows, *tail)``: the plan's ``total_tokens``, then a row's shape (built once per call, shared by the
    tensors of one shape)."""
    if type(t) is torch.Tensor:  # the every-call case, in one expression; any failure gets its message below
        try:
            got = t.shape
            if (
                (got == shape or (len(got) == len(shape) and got[1:] == shape[1:] and got[0] >= shape[0]))
                and t.dtype == dtype
                and t.is_contiguous()
                and t.device == device
            ):
                return
        except RuntimeError:  # a nested or sparse tensor: no sizes or strides to read
            pass
    check_dense_tensor(what, name, t)
    rows, tail = shape[0], tuple(shape[1:])
    got = t.shape
    if len(got) != 1 + len(tail) or tuple(got[1:]) != tail:
        raise PagedWindowError(f"{what}: {name} shape {tuple(got)} must be [rows, {', '.join(map(str, tail))}]")
    if got[0] < rows:
        raise PagedWindowError(f"{what}: {name} has {got[0]} rows; the plan needs {rows} (total_tokens)")
    if t.dtype != dtype:
        raise PagedWindowError(f"{what}: {name} dtype {t.dtype} must be {dtype}")
    if t.device != device:
        raise PagedWindowError(f"{what}: {name} is on {t.device} but the pool is on {device}")
    if not t.is_contiguous():
        raise PagedWindowError(f"{what}: {name} must be contiguous (strides {t.stride()})")


def _check_writable(what: str, name: str, t: torch.Tensor, compiling: bool) -> None:
    """A tensor this call writes is not tracked by autograd and may be written in the current mode
    (``compiling``: ``torch.compiler.is_compiling()``, read once per call)."""
    if t.requires_grad:
        raise PagedWindowError(
            f"{what}: {name} requires grad; the op writes it in place and is not "
            f"differentiable (pass a tensor that does not require grad)"
        )
    if not compiling and t.is_inference() and not torch.is_inference_mode_enabled():
        raise PagedWindowError(
            f"{what}: {name} was made under torch.inference_mode() and may only be written inside inference mode"
        )


def _memory_spans(
    compiling: bool, *named: tuple[str, torch.Tensor | None]
) -> tuple[list[tuple[str, int, int]] | None, int]:
    """``(spans, address_bits)``: ``(name, first byte, past the last byte)`` of each tensor given (None entries
    skipped), each address read once per call, and the bitwise OR of those first bytes (every address is a
    multiple of a power of two iff their OR is: the backend's alignment check, in one test). ``(None, 0)`` under
    torch.compile (fake tensors have no addresses)."""
    if compiling:
        return None, 0
    spans = []
    address_bits = 0
    for name, t in named:
        if t is not None:
            start = t.data_ptr()
            address_bits |= start
            spans.append((name, start, start + t.nbytes))
    return spans, address_bits


def _check_disjoint(what: str, spans: list[tuple[str, int, int]] | None, written: int) -> None:
    """The first ``written`` spans are tensors the call writes: none shares a byte with any other span (it would
    be read while being written, or written twice). Under torch.compile (``spans`` None) nothing is checked here:
    the CUDA backend's custom ops declare what they mutate, and the reference backend runs on the real tensors,
    checked first by :func:`_check_real_tensors`."""
    if spans is None:
        return
    for i in range(written):
        name, w0, w1 = spans[i]
        for other, t0, t1 in spans[i + 1 :]:
            if w0 < t1 and t0 < w1:
                raise PagedWindowError(f"{what}: {name} overlaps {other} in memory")


@torch.compiler.disable
def _check_real_tensors(what: str, named: tuple[tuple[str, torch.Tensor | None], ...], written: int) -> None:
    """Under torch.compile, before the reference backend runs: the checks the traced call could not make on fake
    tensors, made here on the real ones (this function, like the reference's entry points, runs eagerly). The
    first ``written`` of ``named`` are the tensors the call writes (None ones skipped): each may be written in the
    current inference mode, and none overlaps another tensor of the call."""
    writes = [(name, t) for name, t in named[:written] if t is not None]
    for name, t in writes:
        _check_writable(what, name, t, compiling=False)
    spans, _ = _memory_spans(False, *named)
    _check_disjoint(what, spans, len(writes))


_first_byte = operator.itemgetter(1)


def _addresses(spans: list[tuple[str, int, int]] | None) -> Iterable[int] | None:
    """The spans' first bytes, what the backends check for alignment: a lazy iterable (read once, and only when
    the addresses' OR shows a misaligned one, to name it); None under torch.compile (``spans`` None)."""
    return None if spans is None else map(_first_byte, spans)


def _check_prefill_call(pool, layout, layer, plan, sm_scale, window_left) -> tuple:
    """``batch_prefill_paged_window``'s checks before its tensors': the scale, the window, the plan on the pool.
    Returns ``(sm_scale rounded to fp32, window_left, the plan's state, the geometry)``."""
    what = "batch_prefill_paged_window"
    sm_scale = check_sm_scale(sm_scale, what)
    window_left = check_window_left(window_left, what)
    state, geometry = _plan_on_pool(what, plan, layout, pool, layer)
    return sm_scale, window_left, state, geometry


def _check_prefill_tensors(q, pool, plan, state, *, out, lse, backend, compiling: bool) -> str:
    """The rest of its checks, in order: q, out and lse, their overlap, the backend; returns the backend chosen.
    Nothing is launched or written."""
    what = "batch_prefill_paged_window"
    rows = state.total_tokens
    q_shape = (rows, state.num_qo_heads, state.head_dim)
    dtype, device = pool.dtype, pool.device
    _check_rows(what, "q", q, q_shape, dtype, device)
    if out is not None:
        _check_rows(what, "out", out, q_shape, dtype, device)
        _check_writable(what, "out", out, compiling)
    if lse is not None:
        _check_rows(what, "lse", lse, (rows, state.num_qo_heads), torch.float32, device)
        _check_writable(what, "lse", lse, compiling)
    written = (out is not None) + (lse is not None)  # the spans of out and lse come first (None ones are skipped)
    named = (("out", out), ("lse", lse), ("q", q), ("pool", pool))
    spans, address_bits = _memory_spans(compiling, *named)
    _check_disjoint(what, spans, written)
    chosen = _resolve_backend(what, backend, plan, device, dtype, _addresses(spans), address_bits)
    if compiling and chosen == "reference":
        _check_real_tensors(what, named, 2)
    return chosen


def check_batch_prefill_paged_window(
    q: torch.Tensor,
    pool: torch.Tensor,
    layout: PagedKvLayout,
    layer: int,
    plan: PrefillPagedPlan,
    *,
    sm_scale: float,
    window_left: int,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """Raise what :func:`batch_prefill_paged_window` would raise for these arguments; launch and write nothing.

    For a step that writes the pool before it attends (``append_paged_kv`` or ``prepare_paged_qkv``, then the
    attention): check the attention first, so that a step refused anywhere leaves the pool as it was. Its
    verdict does not depend on the pool's contents, only on its geometry."""
    _, _, state, _ = _check_prefill_call(pool, layout, layer, plan, sm_scale, window_left)
    compiling = torch.compiler.is_compiling()
    _check_prefill_tensors(q, pool, plan, state, out=out, lse=lse, backend=backend, compiling=compiling)


def batch_prefill_paged_window(
    q: torch.Tensor,
    pool: torch.Tensor,
    layout: PagedKvLayout,
    layer: int,
    plan: PrefillPagedPlan,
    *,
    sm_scale: float,
    window_left: int,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Windowed paged attention for every request of ``plan``; returns ``out[:total_tokens]``.

    q: ``[rows >= total_tokens, num_qo_heads, head_dim]`` (query row j of request i is at KV position
    ``start_i + j``); pool: ``layout.allocate(...)``; ``sm_scale`` explicit, finite, > 0; ``window_left`` inclusive,
    ``-1`` = none. out (optional): like q; rows past ``total_tokens`` are untouched. lse (optional): fp32
    ``[rows >= total_tokens, num_qo_heads]``, natural-log logsumexp of the scaled logits. A plan with no new rows
    returns at once (after the checks).
    """
    sm_scale, window_left, state, geometry = _check_prefill_call(pool, layout, layer, plan, sm_scale, window_left)
    rows = state.total_tokens
    q_shape = (rows, state.num_qo_heads, state.head_dim)
    compiling = torch.compiler.is_compiling()
    gated = rows > 0 and not compiling and not prefill_observers and (backend == "auto" or backend == "cuda")
    if gated and pool.is_cuda:
        # The compiled gate checks the tensors and launches in one C call; when it refuses (nothing written), the
        # checks below run and name the error, or launch the checked way.
        gate_out = out if out is not None else torch.empty(q_shape, dtype=pool.dtype, device=pool.device)
        if _cuda_backend().batch_prefill_paged_window_gated(
            q, pool, geometry, plan, state, sm_scale=sm_scale, window_left=window_left, out=gate_out, lse=lse
        ):
            return gate_out if gate_out.shape[0] == rows else gate_out[:rows]
    chosen = _check_prefill_tensors(q, pool, plan, state, out=out, lse=lse, backend=backend, compiling=compiling)
    if out is None:
        out = torch.empty(q_shape, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out[:0]
    for observe in prefill_observers:
        observe(chosen, q, pool, geometry, plan)
    if chosen == "cuda":
        _cuda_backend().batch_prefill_paged_window(
            q, pool, geometry, plan, sm_scale=sm_scale, window_left=window_left, out=out, lse=lse, compiling=compiling
        )
    else:
        reference.batch_prefill_paged_window(
            q.detach(), pool.detach(), geometry, plan, sm_scale=sm_scale, window_left=window_left, out=out, lse=lse
        )
    return out if out.shape[0] == rows else out[:rows]


def append_paged_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    pool: torch.Tensor,
    layout: PagedKvLayout,
    layer: int,
    plan: PrefillPagedPlan,
    *,
    backend: str = "auto",
) -> None:
    """Write each request's new K/V rows (positions ``start_i .. start_i + seq_i - 1``) into their slots.

    k, v: ``[rows >= total_tokens, num_kv_heads, head_dim]`` in request order, read as detached values. The plan
    guarantees no two new rows share a slot and none lands in another request's cached prefix; its page ids and
    last-page length must fit the pool. A plan with no new rows returns at once (after the checks).
    """
    what = "append_paged_kv"
    state, geometry = _plan_on_pool(what, plan, layout, pool, layer)
    rows = state.total_tokens
    compiling = torch.compiler.is_compiling()
    if rows and not compiling and (backend == "auto" or backend == "cuda") and pool.is_cuda:
        # The compiled gate checks the tensors and launches in one C call; when it refuses (nothing written), the
        # checks below run and name the error, or launch the checked way.
        if _cuda_backend().append_paged_kv_gated(k, v, pool, geometry, plan, state):
            return
    kv_shape = (rows, state.num_kv_heads, state.head_dim)
    dtype, device = pool.dtype, pool.device
    _check_rows(what, "k", k, kv_shape, dtype, device)
    _check_rows(what, "v", v, kv_shape, dtype, device)
    _check_writable(what, "pool", pool, compiling)
    named = (("pool", pool), ("k", k), ("v", v))
    spans, address_bits = _memory_spans(compiling, *named)
    _check_disjoint(what, spans, 1)
    chosen = _resolve_backend(what, backend, plan, device, dtype, _addresses(spans), address_bits)
    if compiling and chosen == "reference":
        _check_real_tensors(what, named, 1)
    if rows == 0:
        return
    if chosen == "cuda":
        _cuda_backend().append_paged_kv(k, v, pool, geometry, plan, compiling=compiling)
    else:
        reference.append_paged_kv(k.detach(), v.detach(), pool, geometry, plan)


def _check_norm_weight(what: str, name: str, w, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
    """A norm weight: a contiguous ``[head_dim]`` tensor on ``device`` (the pool's), in ``dtype`` (the pool's) or
    fp32."""
    try:
        if (
            type(w) is torch.Tensor  # the every-call case, in one expression; any failure gets its message below
            and w.shape == (head_dim,)
            and (w.dtype == dtype or w.dtype == torch.float32)
            and w.is_contiguous()
            and w.device == device
        ):
            return
    except RuntimeError:  # a nested or sparse tensor: no sizes or strides to read
        pass
    check_dense_tensor(what, name, w)
    if tuple(w.shape) != (head_dim,):
        raise PagedWindowError(f"{what}: {name} shape {tuple(w.shape)} must be [{head_dim}] (head_dim)")
    if w.dtype not in (dtype, torch.float32):
        allowed = f"the pool's {dtype}" + ("" if dtype == torch.float32 else " or torch.float32")
        raise PagedWindowError(f"{what}: {name} dtype {w.dtype} must be {allowed}")
    if w.device != device:
        raise PagedWindowError(f"{what}: {name} is on {w.device} but the pool is on {device}")
    if not w.is_contiguous():
        raise PagedWindowError(f"{what}: {name} must be contiguous (strides {w.stride()})")


def prepare_paged_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: torch.Tensor,
    layout: PagedKvLayout,
    layer: int,
    plan: PrefillPagedPlan,
    *,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    rope_theta: float,
    norm_style: str,
    rope_position_factor: float = 1.0,
    out_q: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Gemma's prep before attention, in one op: q/k/v norms, RoPE, and the paged K/V write; returns
    ``out_q[:total_tokens]``, the normed, rotated q.

    q: ``[rows >= total_tokens, num_qo_heads, head_dim]``, k/v: ``[rows >= total_tokens, num_kv_heads, head_dim]``
    — the projections before the norms, in request order, the pool's dtype, read as detached values. The normed,
    rotated K and the normed V land where ``append_paged_kv`` writes (KV positions ``start_i + j``); RoPE uses
    those positions. ``norm_style``: ``"gemma4"`` (``x̂·w`` on q and k, ``x̂`` on v) or ``"gemma3"``
    (``x̂·(1 + w)`` on q and k, v as given); ``q_norm_weight`` / ``k_norm_weight``: ``[head_dim]``, one dtype for
    both, the pool's or fp32. ``eps``: finite, > 0 (used in fp32). ``rope_theta``: RoPE's base, finite, > 0;
    ``rope_position_factor``: Hugging Face's linear RoPE scaling (positions divided by it), 1.0 = none. Norm
    statistics and the rotation run in fp32 (``pagedwindow.gemma_prep`` states the math). out_q (optional):
    like q; rows past ``total_tokens`` are untouched. Nothing is written unless every check passes.
    """
    what = "prepare_paged_qkv"
    norm_style = check_norm_style(what, norm_style)
    eps, rope_theta, rope_position_factor = check_prep_scalars(what, eps, rope_theta, rope_position_factor)
    state, geometry = _plan_on_pool(what, plan, layout, pool, layer)
    rows, hq, hkv, d = state.total_tokens, state.num_qo_heads, state.num_kv_heads, state.head_dim
    if d % 2 or d > MAX_HEAD_DIM:
        raise PagedWindowError(f"{what}: head_dim {d} must be even and at most {MAX_HEAD_DIM} (rotate-half RoPE)")
    compiling = torch.compiler.is_compiling()
    max_position = state.total_pages * state.page_size  # bounds every position
    check_rope(what, d, rope_theta, rope_position_factor, max_position, compiling=compiling)
    dtype, device = pool.dtype, pool.device
    q_shape, kv_shape = (rows, hq, d), (rows, hkv, d)
    if rows and not compiling and (backend == "auto" or backend == "cuda") and pool.is_cuda:
        # The compiled gate checks the tensors and launches in one C call; when it refuses (nothing written),
        # the checks below run and name the error, or launch the checked way.
        out = out_q if out_q is not None else torch.empty(q_shape, dtype=dtype, device=device)
        if _cuda_backend().prepare_paged_qkv_gated(
            q,
            k,
            v,
            pool,
            geometry,
            plan,
            state,
            q_norm_weight=q_norm_weight,
            k_norm_weight=k_norm_weight,
            eps=eps,
            rope_theta=rope_theta,
            rope_position_factor=rope_position_factor,
            norm_style=norm_style,
            out_q=out,
        ):
            return out if out.shape[0] == rows else out[:rows]
    _check_rows(what, "q", q, q_shape, dtype, device)
    _check_rows(what, "k", k, kv_shape, dtype, device)
    _check_rows(what, "v", v, kv_shape, dtype, device)
    _check_norm_weight(what, "q_norm_weight", q_norm_weight, d, dtype, device)
    _check_norm_weight(what, "k_norm_weight", k_norm_weight, d, dtype, device)
    if q_norm_weight.dtype != k_norm_weight.dtype:
        raise PagedWindowError(
            f"{what}: q_norm_weight ({q_norm_weight.dtype}) and k_norm_weight ({k_norm_weight.dtype}) "
            "must share a dtype"
        )
    if out_q is not None:
        _check_rows(what, "out_q", out_q, q_shape, dtype, device)
        _check_writable(what, "out_q", out_q, compiling)
    _check_writable(what, "pool", pool, compiling)
    named = (  # the written tensors first (out_q skipped when None)
        ("out_q", out_q),
        ("pool", pool),
        ("q", q),
        ("k", k),
        ("v", v),
        ("q_norm_weight", q_norm_weight),
        ("k_norm_weight", k_norm_weight),
    )
    spans, address_bits = _memory_spans(compiling, *named)
    _check_disjoint(what, spans, 1 + (out_q is not None))  # pool, and out_q when given
    chosen = _resolve_backend(what, backend, plan, device, dtype, _addresses(spans), address_bits)
    if compiling and chosen == "reference":
        _check_real_tensors(what, named, 2)
    if out_q is None:
        out_q = torch.empty(q_shape, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out_q[:0]
    if chosen == "cuda":
        _cuda_backend().prepare_paged_qkv(
            q,
            k,
            v,
            pool,
            geometry,
            plan,
            q_norm_weight=q_norm_weight,
            k_norm_weight=k_norm_weight,
            eps=eps,
            rope_theta=rope_theta,
            rope_position_factor=rope_position_factor,
            norm_style=norm_style,
            out_q=out_q,
            compiling=compiling,
        )
    else:
        reference.prepare_paged_qkv(
            q.detach(),
            k.detach(),
            v.detach(),
            pool,
            geometry,
            plan,
            q_norm_weight=q_norm_weight.detach(),
            k_norm_weight=k_norm_weight.detach(),
            eps=eps,
            inv_freq=rope_inv_freq(d, rope_theta, rope_position_factor),
            norm_style=norm_style,
            out_q=out_q,
        )
    return out_q if out_q.shape[0] == rows else out_q[:rows]
