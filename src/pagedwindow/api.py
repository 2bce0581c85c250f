"""The validating wrappers: every contract is checked before anything is written or launched.

``batch_prefill_paged_window`` reads attention through a plan; ``append_paged_kv`` writes the new rows' K/V into
their slots ("append then attend"). Both route to a backend: ``"reference"`` (PyTorch), ``"cuda"`` (our kernels)
or ``"auto"`` (cuda when the tensors are on a GPU and the kernels build, else the reference).
"""

from __future__ import annotations

import torch

from . import reference
from .errors import PagedWindowError
from .layout import PagedGeometry, PagedKvLayout, checked_paged_geometry
from .plan import PrefillPagedPlan
from .semantics import check_sm_scale, check_window_left

BACKENDS = ("auto", "reference", "cuda")


def _cuda_backend():
    from . import cuda  # imported only when asked for: building kernels needs nvcc

    return cuda


def _resolve_backend(what: str, backend: str, plan: PrefillPagedPlan, *tensors: torch.Tensor) -> str:
    """The backend that runs this call; ``tensors[0]`` decides device and dtype."""
    device = tensors[0].device
    if backend not in BACKENDS:
        raise PagedWindowError(f"{what}: backend {backend!r} is not one of {BACKENDS}")
    if backend == "reference":
        return backend
    if backend == "auto":
        if device.type != "cuda" or _cuda_backend().unsupported(what, plan, *tensors) is not None:
            return "reference"
        return "cuda" if _cuda_backend().available() else "reference"
    if device.type != "cuda":
        raise PagedWindowError(f"{what}: backend 'cuda' needs tensors on a CUDA device, got {device}")
    reason = _cuda_backend().unsupported(what, plan, *tensors)
    if reason is not None:
        raise PagedWindowError(f"{what}: backend 'cuda' does not support {reason}")
    _cuda_backend().require()  # raises PagedWindowError naming why the kernels cannot be built or loaded
    return "cuda"


def _check_plan(what: str, plan) -> None:
    """A plan that can drive a launch: a PrefillPagedPlan that has been filled."""
    if not isinstance(plan, PrefillPagedPlan):
        raise PagedWindowError(f"{what}: plan must be a PrefillPagedPlan, got {type(plan).__name__}")
    if not plan.filled:
        raise PagedWindowError(f"{what}: the plan was preallocated but never filled: call plan.update(...) first")


def _check_plan_against_pool(what: str, plan: PrefillPagedPlan, geometry: PagedGeometry) -> None:
    """The plan's recorded bounds fit the pool (the kernels have no device-side bounds check)."""
    if plan.max_page_index >= geometry.num_pages:
        raise PagedWindowError(
            f"{what}: plan page id {plan.max_page_index} is past the pool's {geometry.num_pages} pages "
            f"(bound {geometry.num_pages - 1})"
        )
    if plan.max_last_page_len > geometry.page_size:
        raise PagedWindowError(
            f"{what}: plan last_page_len {plan.max_last_page_len} exceeds page_size {geometry.page_size}"
        )
    if plan.page_size != geometry.page_size:
        raise PagedWindowError(
            f"{what}: plan.page_size {plan.page_size} disagrees with the pool's {geometry.page_size}"
        )


def _check_rows(what: str, name: str, t: torch.Tensor, *, rows: int, tail: tuple[int, ...], pool: torch.Tensor,
                dtype: torch.dtype | None = None) -> None:
    """``t`` is a contiguous tensor ``[>= rows, *tail]`` on the pool's device with the pool's dtype."""
    if not isinstance(t, torch.Tensor):
        raise PagedWindowError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    want_dtype = pool.dtype if dtype is None else dtype
    if t.dim() != 1 + len(tail) or tuple(t.shape[1:]) != tail:
        raise PagedWindowError(f"{what}: {name} shape {tuple(t.shape)} must be [rows, {', '.join(map(str, tail))}]")
    if t.shape[0] < rows:
        raise PagedWindowError(f"{what}: {name} has {t.shape[0]} rows; the plan needs {rows} (total_tokens)")
    if t.dtype != want_dtype:
        raise PagedWindowError(f"{what}: {name} dtype {t.dtype} must be {want_dtype}")
    if t.device != pool.device:
        raise PagedWindowError(f"{what}: {name} is on {t.device} but the pool is on {pool.device}")
    if not t.is_contiguous():
        raise PagedWindowError(f"{what}: {name} must be contiguous (strides {t.stride()})")


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _check_disjoint(what: str, written: str, w: torch.Tensor, others: dict) -> None:
    """The tensor written to must not share a byte with any input (it would be read while being written)."""
    if torch.compiler.is_compiling():
        return  # fake tensors have no addresses; the custom op's mutation annotation covers aliasing under compile
    w0, w1 = _byte_range(w)
    for name, t in others.items():
        if t is None or t.device != w.device:
            continue
        t0, t1 = _byte_range(t)
        if w0 < t1 and t0 < w1:
            raise PagedWindowError(f"{what}: {written} overlaps {name} in memory")


def batch_prefill_paged_window(q: torch.Tensor, pool: torch.Tensor, layout: PagedKvLayout, layer: int,
                               plan: PrefillPagedPlan, *, sm_scale: float, window_left: int,
                               out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                               backend: str = "auto") -> torch.Tensor:
    """Windowed paged attention for every request of ``plan``; returns ``out[:total_tokens]``.

    q: ``[rows >= total_tokens, num_qo_heads, head_dim]`` (query row j of request i is at KV position
    ``start_i + j``); pool: ``layout.allocate(...)``; ``sm_scale`` explicit, finite, > 0; ``window_left`` inclusive,
    ``-1`` = none. out (optional): like q; rows past ``total_tokens`` are untouched. lse (optional): fp32
    ``[rows >= total_tokens, num_qo_heads]``, natural-log logsumexp of the scaled logits.
    """
    what = "batch_prefill_paged_window"
    sm_scale = check_sm_scale(sm_scale)
    window_left = check_window_left(window_left)
    _check_plan(what, plan)
    geometry = checked_paged_geometry(what, layout, pool, layer, plan.head_dim, plan.num_kv_heads)
    _check_plan_against_pool(what, plan, geometry)
    tail = (plan.num_qo_heads, plan.head_dim)
    _check_rows(what, "q", q, rows=plan.total_tokens, tail=tail, pool=pool)
    if out is None:
        out = torch.empty((plan.total_tokens, *tail), dtype=q.dtype, device=q.device)
    else:
        _check_rows(what, "out", out, rows=plan.total_tokens, tail=tail, pool=pool)
        _check_disjoint(what, "out", out, {"q": q, "pool": pool, "lse": lse})
    if lse is not None:
        _check_rows(what, "lse", lse, rows=plan.total_tokens, tail=(plan.num_qo_heads,), pool=pool,
                    dtype=torch.float32)
        _check_disjoint(what, "lse", lse, {"q": q, "pool": pool})
    chosen = _resolve_backend(what, backend, plan, q, pool, out, lse)
    if chosen == "cuda":
        _cuda_backend().batch_prefill_paged_window(q, pool, geometry, plan, sm_scale=sm_scale,
                                                   window_left=window_left, out=out, lse=lse)
    else:
        reference.batch_prefill_paged_window(q, pool, geometry, plan, sm_scale=sm_scale, window_left=window_left,
                                             out=out, lse=lse)
    return out[: plan.total_tokens]


def append_paged_kv(k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor, layout: PagedKvLayout, layer: int,
                    plan: PrefillPagedPlan, *, backend: str = "auto") -> None:
    """Write each request's new K/V rows (positions ``start_i .. start_i + seq_i - 1``) into their slots.

    k, v: ``[rows >= total_tokens, num_kv_heads, head_dim]`` in request order. Refuses a plan whose new rows
    collide (two writes to one slot) and one whose page ids or last-page length do not fit the pool.
    """
    what = "append_paged_kv"
    _check_plan(what, plan)
    geometry = checked_paged_geometry(what, layout, pool, layer, plan.head_dim, plan.num_kv_heads)
    _check_plan_against_pool(what, plan, geometry)
    if plan.new_slot_collision is not None:
        raise PagedWindowError(f"{what}: the plan's new rows collide: {plan.new_slot_collision}")
    tail = (plan.num_kv_heads, plan.head_dim)
    _check_rows(what, "k", k, rows=plan.total_tokens, tail=tail, pool=pool)
    _check_rows(what, "v", v, rows=plan.total_tokens, tail=tail, pool=pool)
    _check_disjoint(what, "pool", pool, {"k": k, "v": v})
    chosen = _resolve_backend(what, backend, plan, pool, k, v)
    if chosen == "cuda":
        _cuda_backend().append_paged_kv(k, v, pool, geometry, plan)
    else:
        reference.append_paged_kv(k, v, pool, geometry, plan)

