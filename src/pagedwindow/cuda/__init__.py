"""The CUDA backend: our kernels (``kernels/``), JIT-built with nvcc and called as torch custom ops.

The API module validates every input; this module only routes checked inputs to the ops. It never imports the
reference backend.
"""

from __future__ import annotations

import logging

import torch

from .. import settings
from ..errors import PagedWindowError
from ..layout import PagedGeometry
from ..plan import PrefillPagedPlan
from ..tiles import SPLIT_KV_MAX_SPLITS, SPLIT_MIN_STEPS, SPLIT_STEP_KEYS, SUPPORTED_CTA_TILE_Q
from . import launch_gate, ops
from .build import BuildError, target_for_capability

PREFILL_HEAD_DIM = 256
PREFILL_DTYPES = (torch.bfloat16,)
APPEND_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PREPARE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PREPARE_HEAD_DIMS = (64, 128, 256, 512)
ALIGNMENT = 16
"""The kernels need every tensor address to be a multiple of this many bytes (16-byte vector loads and
cp.async copies)."""
_log = logging.getLogger(__name__)


def unsupported(what: str, plan: PrefillPagedPlan, dtype: torch.dtype, addresses, address_bits: int) -> str | None:
    """Why the kernels cannot run this call (``auto`` then falls back to the reference), or None.

    ``dtype``: the call's tensors' (the pool's); ``addresses``: the call's tensors' addresses (any iterable), None
    under torch.compile. The kernels need ``ALIGNMENT``-byte aligned addresses (a contiguous view starting
    mid-row can break that). ``address_bits``: the bitwise OR of ``addresses`` (every address is aligned iff
    their OR is); ``addresses`` is walked only to name a misaligned one.
    """
    if what == "append_paged_kv":
        if dtype not in APPEND_DTYPES:
            return f"dtype {dtype} (supported: {APPEND_DTYPES})"
    elif what == "prepare_paged_qkv":
        if dtype not in PREPARE_DTYPES:
            return f"dtype {dtype} (supported: {PREPARE_DTYPES})"
        if plan.head_dim not in PREPARE_HEAD_DIMS:
            return f"head_dim {plan.head_dim} (the prep kernel is built for {PREPARE_HEAD_DIMS})"
    elif dtype not in PREFILL_DTYPES:
        return f"dtype {dtype} (supported: {PREFILL_DTYPES})"
    elif plan.head_dim != PREFILL_HEAD_DIM:
        return f"head_dim {plan.head_dim} (the kernel is built for {PREFILL_HEAD_DIM})"
    elif plan.cta_tile_q not in SUPPORTED_CTA_TILE_Q:
        return f"the plan's tile cta_tile_q={plan.cta_tile_q} (the kernel runs {SUPPORTED_CTA_TILE_Q})"
    if addresses is None or not address_bits % ALIGNMENT:
        return None
    for address in addresses:
        if address % ALIGNMENT:
            return f"a tensor at address {address:#x}, which is not {ALIGNMENT}-byte aligned"
    return None


_load_state: dict[str, str | None] = {}  # "error" -> None when the kernels loaded; filled on first use


def _load_error() -> str | None:
    if "error" not in _load_state:
        if not torch.cuda.is_available():
            _load_state["error"] = "no CUDA device is available"
        else:
            device = torch.device("cuda", torch.cuda.current_device())
            try:
                ops.library(device)
                _load_state["error"] = None
            except (BuildError, OSError) as exc:
                _load_state["error"] = f"the CUDA kernels could not be built or loaded: {exc}"
                _log.warning(
                    "backend 'cuda' is unavailable (backend 'auto' runs the PyTorch reference): %s",
                    _load_state["error"],
                )
            else:
                _log.info("CUDA kernels loaded for %s; prefill kernel: %s", device, _kernel_choice(device))
    return _load_state["error"]


def _kernel_choice(device: torch.device) -> str:
    """The prefill kernel ``device`` runs and why: the architecture's default or ``$PAGEDWINDOW_PREFILL_KERNEL``."""
    kernel = "sm_90a wgmma" if prefill_kernel(device) == "wgmma" else "mma.sync"
    choice = settings.prefill_kernel()
    why = "the default for this architecture" if choice == "auto" else f"{settings.PREFILL_KERNEL.name}={choice}"
    return f"{kernel} ({why})"


def unavailable_reason() -> str | None:
    """Why the kernels cannot be used in this process (no GPU, build or load failure), or None."""
    return _load_error()


def available() -> bool:
    """True when a GPU is present and the kernels build and load (decided once per process)."""
    return _load_error() is None


def require() -> None:
    error = _load_error()
    if error is not None:
        raise PagedWindowError(f"backend 'cuda' is unavailable: {error}")


def prefill_kernel(device: torch.device) -> str:
    """The prefill launcher this process runs on ``device`` (``$PAGEDWINDOW_PREFILL_KERNEL`` honoured):
    ``"wgmma"`` (the sm_90a kernel) or ``"mma_sync"``. Needs no build."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    target = target_for_capability(*torch.cuda.get_device_capability(index))
    return "wgmma" if ops.prefill_entry(target) == "pw_prefill_hd256_bf16_sm90" else "mma_sync"


def kv_copy_path(pool: torch.Tensor, geometry: PagedGeometry, num_kv_heads: int) -> str:
    """How the prefill kernel copies K/V tiles out of ``pool`` (a checked geometry): ``"tma"`` (bulk tensor
    copies: the wgmma kernel on a pool whose page size and alignment allow them) or ``"cp.async"``. The same
    decision the launcher makes at each call; it depends on the pool, not the plan. Builds the kernels."""
    if prefill_kernel(pool.device) != "wgmma":
        return "cp.async"
    lib = ops.library(pool.device)
    mode = lib.pw_prefill_hd256_sm90_kv_copy_mode(
        pool.data_ptr(), geometry.k_offset, geometry.v_offset, geometry.page_stride, geometry.page_size, num_kv_heads
    )
    return "tma" if mode == 1 else "cp.async"


def _prefill_block(plan: PrefillPagedPlan, device: torch.device) -> ops.PrefillLaunch:
    """The plan's prefill parameter block on ``device``, built once per plan update (``plan.launch_cache``)."""
    key = ("prefill", device.index)
    block = plan.launch_cache.get(key)
    if block is None:
        workspace, counters = plan.split_kv_workspace(device) or (None, None)
        units = 0 if counters is None else len(counters)
        block = plan.launch_cache[key] = ops.prefill_block(
            plan.device_buffer(device),
            plan.capacity.segment_offsets(),
            page_size=plan.page_size,
            num_qo_heads=plan.num_qo_heads,
            num_kv_heads=plan.num_kv_heads,
            grid_tiles=plan.capacity.max_tiles,
            cta_tile_q=plan.cta_tile_q,
            workspace=workspace,
            split_counters=counters,
            max_tile_splits=max_tile_splits(plan.state, units) if units else 0,
        )
    return block


def max_tile_splits(state, workspace_units: int) -> int:
    """A bound on the splits the decode kernel gives any live tile of ``state`` with ``workspace_units`` units: the
    kernel's ``min(SPLIT_KV_MAX_SPLITS, units // (tiles × KV heads))``, and at most one split per
    ``SPLIT_MIN_STEPS`` steps of ``SPLIT_STEP_KEYS`` keys of the most keys a tile can see (no request holds more
    keys than the plan's pages). At most 16 lets an eager launch skip the merge grid (``kernels/decode_hd256.cu``)."""
    items = max(1, state.num_tiles * state.num_kv_heads)
    keys = state.total_pages * state.page_size
    by_keys = -(-keys // SPLIT_STEP_KEYS) // SPLIT_MIN_STEPS
    return max(1, min(SPLIT_KV_MAX_SPLITS, workspace_units // items, by_keys))


def batch_prefill_paged_window(
    q,
    pool,
    geometry: PagedGeometry,
    plan: PrefillPagedPlan,
    *,
    sm_scale: float,
    window_left: int,
    out,
    lse=None,
    compiling: bool,
) -> None:
    """Launch the prefill kernel. Eager calls (CUDA-graph capture included) go straight to the launcher;
    under ``torch.compile`` (``compiling``: ``torch.compiler.is_compiling()``, as the caller read it) the custom
    op is what gets traced."""
    device = q.device
    if compiling:
        workspace, counters = plan.split_kv_workspace(device) or (None, None)
        ops.prefill_hd256(
            q,
            pool,
            plan.device_buffer(device),  # uploaded at each plan update; stable address
            out,
            lse,
            workspace,
            counters,
            geometry.k_offset,
            geometry.v_offset,
            geometry.page_stride,
            geometry.page_size,
            plan.num_qo_heads,
            plan.num_kv_heads,
            list(plan.capacity.segment_offsets()),
            plan.capacity.max_tiles,
            plan.cta_tile_q,
            sm_scale,
            window_left,
        )
        return
    ops.launch_prefill(
        _prefill_block(plan, device),
        q,
        pool,
        out,
        lse,
        geometry.k_offset,
        geometry.v_offset,
        geometry.page_stride,
        sm_scale,
        window_left,
    )


def append_paged_kv(k, v, pool, geometry: PagedGeometry, plan: PrefillPagedPlan, *, compiling: bool) -> None:
    """Launch the pool write (eager: the launcher directly; ``compiling``: the custom op)."""
    if compiling:
        buffer = plan.device_buffer(k.device)
        cap = plan.capacity
        ops.append_paged_kv(
            k,
            v,
            pool,
            buffer,
            geometry.k_offset,
            geometry.v_offset,
            geometry.page_stride,
            geometry.page_size,
            plan.num_kv_heads,
            plan.head_dim,
            list(cap.segment_offsets()),
            cap.max_batch,
            cap.max_total_tokens,
        )
        return
    block = _append_block(plan, k.device)
    ops.launch_append(block, k, v, pool, geometry.k_offset, geometry.v_offset, geometry.page_stride)


def _append_block(plan: PrefillPagedPlan, device: torch.device) -> ops.AppendLaunch:
    """The plan's pool-write parameter block on ``device``, built once per plan update (``plan.launch_cache``)."""
    key = ("append", device.index)
    block = plan.launch_cache.get(key)
    if block is None:
        cap = plan.capacity
        block = plan.launch_cache[key] = ops.append_block(
            plan.device_buffer(device),
            cap.segment_offsets(),
            page_size=plan.page_size,
            num_kv_heads=plan.num_kv_heads,
            head_dim=plan.head_dim,
            batch_capacity=cap.max_batch,
            token_capacity=cap.max_total_tokens,
        )
    return block


def prepare_paged_qkv(
    q,
    k,
    v,
    pool,
    geometry: PagedGeometry,
    plan: PrefillPagedPlan,
    *,
    q_norm_weight,
    k_norm_weight,
    eps: float,
    rope_theta: float,
    rope_position_factor: float,
    norm_style: str,
    out_q,
    compiling: bool,
) -> None:
    """Launch the fused prep (eager: the launcher directly; ``compiling``: the custom op)."""
    device = q.device
    if compiling:
        cap = plan.capacity
        ops.prepare_qkv(
            q,
            k,
            v,
            pool,
            out_q,
            q_norm_weight,
            k_norm_weight,
            plan.device_buffer(device),
            geometry.k_offset,
            geometry.v_offset,
            geometry.page_stride,
            geometry.page_size,
            plan.num_qo_heads,
            plan.num_kv_heads,
            plan.head_dim,
            list(cap.segment_offsets()),
            cap.max_batch,
            cap.max_total_tokens,
            eps,
            rope_theta,
            rope_position_factor,
            norm_style,
        )
        return
    ops.launch_prepare(
        _prepare_block(plan, device),
        device,
        q,
        k,
        v,
        pool,
        out_q,
        q_norm_weight,
        k_norm_weight,
        geometry.k_offset,
        geometry.v_offset,
        geometry.page_stride,
        eps,
        rope_theta,
        rope_position_factor,
        norm_style,
    )


def _prepare_block(plan: PrefillPagedPlan, device: torch.device) -> ops.PrepareLaunch:
    """The plan's prep parameter block on ``device``, built once per plan update (``plan.launch_cache``): it
    holds the plan buffer's address, uploaded at each update."""
    key = ("prepare", device.index)
    block = plan.launch_cache.get(key)
    if block is None:
        cap = plan.capacity
        block = plan.launch_cache[key] = ops.prepare_block(
            plan.device_buffer(device),
            cap.segment_offsets(),
            page_size=plan.page_size,
            num_qo_heads=plan.num_qo_heads,
            num_kv_heads=plan.num_kv_heads,
            head_dim=plan.head_dim,
            batch_capacity=cap.max_batch,
            token_capacity=cap.max_total_tokens,
        )
    return block


def _gate_on(device: torch.device):
    """``(the call gate, the kernels' library)`` for an eager launch on ``device`` now; None when the gate is not
    built here, the kernels are not loaded, or ``device`` is not the current device (the checked path then runs)."""
    gate = launch_gate.module()
    if gate is None or _load_error() is not None or device.index != ops.current_device():
        return None
    return gate, ops.library(device)  # loaded (checked above): a dict lookup


def _gated(gate, lib, code: int, name: str, error_string: str) -> bool:
    """True when the gate launched (status 0), False when it refused; raises the launcher's error (``name``,
    with ``lib``'s status text from its function ``error_string``)."""
    if code == 0:
        return True
    if code == gate.REFUSED:
        return False
    raise ops.launch_error(code, name, getattr(lib, error_string))


def batch_prefill_paged_window_gated(
    q, pool, geometry: PagedGeometry, plan: PrefillPagedPlan, state, *, sm_scale: float, window_left: int, out, lse
) -> bool:
    """Launch the attention through the compiled call gate (``launch_gate``), eagerly; True once launched.

    For a call whose plan (``state``: its ``plan.state``), pool and scalars the API has checked, with
    ``state.total_tokens`` > 0 and the pool on a CUDA device, and ``out`` given (the API allocates it). The gate
    checks q, out and lse (every contract ``api.batch_prefill_paged_window`` checks per tensor, and the kernels'
    alignment) and launches on the current stream. False, with nothing written or launched, when the gate is not
    built here, the kernels cannot run this call (not loaded, another dtype, head_dim or tile, the pool's device
    not the current one) or a tensor check fails: the caller then runs the checked path."""
    device = pool.device
    gate_lib = _gate_on(device)
    if gate_lib is None or pool.dtype not in PREFILL_DTYPES or state.head_dim != PREFILL_HEAD_DIM:
        return False
    if plan.cta_tile_q not in SUPPORTED_CTA_TILE_Q:
        return False
    gate, lib = gate_lib
    block = _prefill_block(plan, device)
    ops.write_prefill_scalars(block, geometry.k_offset, geometry.v_offset, geometry.page_stride, sm_scale, window_left)
    code = gate.prefill(
        q,
        pool,
        out,
        lse,
        state.total_tokens,
        state.num_qo_heads,
        state.head_dim,
        block.address,
        lib.prefill_launcher_address,
        ops.current_raw_stream(device.index),
    )
    return _gated(gate, lib, code, lib.prefill.__name__, "pw_prefill_hd256_error_string")  # one status table


def append_paged_kv_gated(k, v, pool, geometry: PagedGeometry, plan: PrefillPagedPlan, state) -> bool:
    """Launch the pool write through the compiled call gate, eagerly; True once launched. The same contract as
    :func:`batch_prefill_paged_window_gated`, for ``api.append_paged_kv``'s tensors (k, v, the pool)."""
    device = pool.device
    gate_lib = _gate_on(device)
    if gate_lib is None or pool.dtype not in APPEND_DTYPES:
        return False
    gate, lib = gate_lib
    block = _append_block(plan, device)
    ops.write_append_scalars(block, geometry.k_offset, geometry.v_offset, geometry.page_stride)
    code = gate.append(
        k,
        v,
        pool,
        state.total_tokens,
        state.num_kv_heads,
        state.head_dim,
        block.address,
        lib.append_launcher_address,
        ops.current_raw_stream(device.index),
    )
    return _gated(gate, lib, code, "pw_append_paged_kv", "pw_append_paged_kv_error_string")


def prepare_paged_qkv_gated(
    q,
    k,
    v,
    pool,
    geometry: PagedGeometry,
    plan: PrefillPagedPlan,
    state,
    *,
    q_norm_weight,
    k_norm_weight,
    eps: float,
    rope_theta: float,
    rope_position_factor: float,
    norm_style: str,
    out_q,
) -> bool:
    """Launch the fused prep through the compiled call gate, eagerly; True once launched. The same contract as
    :func:`batch_prefill_paged_window_gated`, for ``api.prepare_paged_qkv``'s tensors (q, k, v, the pool, out_q
    and the norm weights; the kernels run bf16, fp16 and fp32 at head_dim 64 to 512)."""
    device = pool.device
    gate_lib = _gate_on(device)
    if gate_lib is None or pool.dtype not in PREPARE_DTYPES or state.head_dim not in PREPARE_HEAD_DIMS:
        return False
    gate, lib = gate_lib
    block = _prepare_block(plan, device)
    ops.write_prepare_scalars(
        block,
        geometry.k_offset,
        geometry.v_offset,
        geometry.page_stride,
        eps,
        rope_theta,
        rope_position_factor,
        norm_style,
    )
    code = gate.prepare(
        q,
        k,
        v,
        pool,
        out_q,
        q_norm_weight,
        k_norm_weight,
        state.total_tokens,
        state.num_qo_heads,
        state.num_kv_heads,
        state.head_dim,
        block.address,
        lib.prepare_launcher_address,
        ops.current_raw_stream(device.index),
    )
    return _gated(gate, lib, code, "pw_prepare_qkv", "pw_prepare_qkv_error_string")
