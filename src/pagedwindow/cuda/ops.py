"""Our kernels, loaded from the JIT-built library with ctypes: the launch parameter blocks, the direct launchers
the eager path calls, and the same launches as torch custom ops (``torch.ops.pagedwindow.*``) for
``torch.compile`` / ``torch.export``.

Each launcher takes one parameter block (``PrefillLaunch`` / ``AppendLaunch`` / ``PrepareLaunch``, C structs in
``kernels/`` mirrored here field by field; their sizes are checked against the library at load). A launch mutates
only its outputs, runs on the current stream, synchronises nothing and allocates nothing. The plan's device buffer is
passed whole (segments at fixed offsets), so CUDA-graph replay after ``plan.update()`` reads the new plan in place.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from .. import settings
from ..gemma_prep import MAX_HEAD_DIM, rope_inv_freq
from . import host_pass
from .build import load_verified, target_for_capability

_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL] = {}  # by target
_by_device: dict[int, ctypes.CDLL] = {}  # by CUDA device index: the launch path's lookup

PREFILL_KERNELS = ("auto", "mma_sync", "wgmma")
"""``$PAGEDWINDOW_PREFILL_KERNEL``: ``auto`` (wgmma on sm_90, mma.sync elsewhere), or force one (benchmarks)."""

_p, _i, _ll, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
PREPARE_MAX_HALF = MAX_HEAD_DIM // 2  # inverse frequencies the prep's launch block carries


class PrefillLaunch(ctypes.Structure):
    """Mirror of ``PwPrefillLaunch`` (kernels/launch_blocks.cuh)."""

    scalars: tuple | None = None
    """The per-call scalars last written into the block (``write_prefill_scalars``), not a C field."""
    address: int = 0
    """The block's own address (``prefill_block`` sets it), what the compiled call gate writes into; not a C
    field."""

    _fields_ = [
        ("q", _p),
        ("out", _p),
        ("lse", _p),
        ("pool", _p),
        ("k_offset", _ll),
        ("v_offset", _ll),
        ("page_stride", _ll),
        ("page_indices", _p),
        ("page_indptr", _p),
        ("last_page_len", _p),
        ("qo_indptr", _p),
        ("request_indices", _p),
        ("qo_tile_indices", _p),
        ("plan_scalars", _p),
        ("page_size", _i),
        ("num_qo_heads", _i),
        ("num_kv_heads", _i),
        ("grid_tiles", _i),
        ("cta_tile_q", _i),
        ("window_left", _i),
        ("sm_scale", _f),
        ("workspace", _p),
        ("split_counters", _p),
        ("workspace_units", _i),
        ("max_tile_splits", _i),
    ]


class AppendLaunch(ctypes.Structure):
    """Mirror of ``PwAppendLaunch`` (kernels/launch_blocks.cuh)."""

    scalars: tuple | None = None
    """The per-call scalars last written into the block (``write_append_scalars``), not a C field."""
    address: int = 0
    """The block's own address (``append_block`` sets it); not a C field."""

    _fields_ = [
        ("k", _p),
        ("v", _p),
        ("pool", _p),
        ("k_offset", _ll),
        ("v_offset", _ll),
        ("page_stride", _ll),
        ("page_indices", _p),
        ("page_indptr", _p),
        ("last_page_len", _p),
        ("qo_indptr", _p),
        ("plan_scalars", _p),
        ("page_size", _i),
        ("num_kv_heads", _i),
        ("head_dim", _i),
        ("elem_bytes", _i),
        ("batch_capacity", _i),
        ("token_capacity", _i),
    ]


class PrepareLaunch(ctypes.Structure):
    """Mirror of ``PwPrepareLaunch`` (kernels/launch_blocks.cuh)."""

    scalars: tuple | None = None
    """The per-call scalars last written into the block (``write_prepare_scalars``), not a C field."""
    address: int = 0
    """The block's own address (``prepare_block`` sets it), what the compiled call gate writes into; not a C
    field."""

    _fields_ = [
        ("q", _p),
        ("k", _p),
        ("v", _p),
        ("q_out", _p),
        ("pool", _p),
        ("q_weight", _p),
        ("k_weight", _p),
        ("k_offset", _ll),
        ("v_offset", _ll),
        ("page_stride", _ll),
        ("page_indices", _p),
        ("page_indptr", _p),
        ("last_page_len", _p),
        ("qo_indptr", _p),
        ("plan_scalars", _p),
        ("page_size", _i),
        ("num_qo_heads", _i),
        ("num_kv_heads", _i),
        ("head_dim", _i),
        ("dtype", _i),
        ("weight_fp32", _i),
        ("norm_style", _i),
        ("batch_capacity", _i),
        ("token_capacity", _i),
        ("eps", _f),
        ("inv_freq", _f * PREPARE_MAX_HALF),
    ]


PREPARE_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
"""The prep kernel's ``dtype`` field."""

PREPARE_NORM_STYLE_CODES = {"gemma4": 0, "gemma3": 1}


def prefill_entry(target: str) -> str:
    """The launcher the prefill op calls on ``target``: the sm_90a wgmma kernel on Hopper, else mma.sync."""
    choice = settings.prefill_kernel()
    if choice not in PREFILL_KERNELS:
        raise RuntimeError(f"PAGEDWINDOW_PREFILL_KERNEL={choice!r} is not one of {PREFILL_KERNELS}")
    if choice == "wgmma" or (choice == "auto" and target == "sm_90a"):
        return "pw_prefill_hd256_bf16_sm90"
    return "pw_prefill_hd256_bf16"


def load(path) -> ctypes.CDLL:
    """Load a built kernels library, declare its launchers' C signatures and check the parameter blocks' sizes."""
    lib = ctypes.CDLL(str(path))
    for name, block in (
        ("pw_prefill_hd256_bf16", PrefillLaunch),
        ("pw_prefill_hd256_bf16_sm90", PrefillLaunch),
        ("pw_append_paged_kv", AppendLaunch),
        ("pw_prepare_qkv", PrepareLaunch),
    ):
        getattr(lib, name).argtypes = [ctypes.POINTER(block), _p]
        getattr(lib, name).restype = _i
    for name, block in (
        ("pw_prefill_launch_size", PrefillLaunch),
        ("pw_append_launch_size", AppendLaunch),
        ("pw_prepare_launch_size", PrepareLaunch),
    ):
        getattr(lib, name).restype = _i
        if getattr(lib, name)() != ctypes.sizeof(block):
            raise OSError(
                f"{path}: {name}() = {getattr(lib, name)()} but the host's {block.__name__} has "
                f"{ctypes.sizeof(block)} bytes (a stale or foreign library)"
            )
    lib.append_launcher_address = ctypes.cast(lib.pw_append_paged_kv, _p).value  # what the call gate calls
    lib.prepare_launcher_address = ctypes.cast(lib.pw_prepare_qkv, _p).value
    lib.pw_prefill_hd256_sm90_kv_copy_mode.argtypes = [_p, _ll, _ll, _ll, _i, _i]
    lib.pw_prefill_hd256_sm90_kv_copy_mode.restype = _i
    for name in (
        "pw_prefill_hd256_error_string",
        "pw_prefill_hd256_sm90_error_string",
        "pw_append_paged_kv_error_string",
        "pw_prepare_qkv_error_string",
    ):
        getattr(lib, name).argtypes = [_i]
        getattr(lib, name).restype = ctypes.c_char_p
    return host_pass.declare(lib)


def library(device: torch.device) -> ctypes.CDLL:
    """The kernels' library for ``device``'s architecture (built on first use; later calls are a dict lookup)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    lib = _by_device.get(index)
    if lib is not None:
        return lib
    target = target_for_capability(*torch.cuda.get_device_capability(index))
    with _lock:
        lib = _libraries.get(target)
        if lib is None:
            lib = load_verified(target, load)  # a cached library that fails to load is rebuilt once
            lib.prefill = getattr(lib, prefill_entry(target))
            lib.prefill_launcher_address = ctypes.cast(lib.prefill, _p).value
            _libraries[target] = lib
        _by_device[index] = lib
    return lib


def _raw_stream(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _raw_stream)
current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def _launch_on(device: torch.device, launcher, block) -> int:
    """Call ``launcher(&block, stream)`` with ``device`` current (launchers launch on the current device) and
    its current stream; returns the launcher's status."""
    index = device.index
    if index == current_device():
        return launcher(ctypes.byref(block), current_raw_stream(index))
    with torch.cuda.device(index):
        return launcher(ctypes.byref(block), current_raw_stream(index))


def launch_error(code: int, name: str, error_string) -> RuntimeError:
    """The error of a launcher that returned ``code`` (not 0), with its status table's text."""
    return RuntimeError(f"{name} failed with code {code}: {error_string(code).decode()}")


def check_status(code: int, name: str, error_string) -> None:
    if code != 0:
        raise launch_error(code, name, error_string)


# -- parameter blocks from a plan buffer --------------------------------------------------------------------------


def prefill_block(
    plan_buffer: torch.Tensor,
    segment_offsets,
    *,
    page_size: int,
    num_qo_heads: int,
    num_kv_heads: int,
    grid_tiles: int,
    cta_tile_q: int,
    workspace: torch.Tensor | None = None,
    split_counters: torch.Tensor | None = None,
    max_tile_splits: int = 0,
) -> PrefillLaunch:
    """A prefill parameter block with the plan's pointers and sizes filled (tensors and scalars come per call).
    ``workspace [units * 16 * 257]`` fp32 and ``split_counters [units]`` int32 (zero): the plan's
    ``split_kv_workspace``, with which the decode kernel (tile 16) splits a tile's keys into up to ``units`` runs;
    without them it never splits. ``max_tile_splits``: a bound on any live tile's splits (0: none), with which an
    eager decode launch skips the merge grid when no tile can need it."""
    base = plan_buffer.data_ptr()
    scalars, page_indptr, last, qo_indptr, requests, qo_tiles, pages = (base + 4 * o for o in segment_offsets)
    units = 0 if workspace is None or split_counters is None else len(split_counters)
    block = PrefillLaunch(
        workspace=workspace.data_ptr() if units else None,
        split_counters=split_counters.data_ptr() if units else None,
        workspace_units=units,
        max_tile_splits=max_tile_splits,
        page_indices=pages,
        page_indptr=page_indptr,
        last_page_len=last,
        qo_indptr=qo_indptr,
        request_indices=requests,
        qo_tile_indices=qo_tiles,
        plan_scalars=scalars,
        page_size=page_size,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        grid_tiles=grid_tiles,
        cta_tile_q=cta_tile_q,
    )
    block.address = ctypes.addressof(block)
    return block


def append_block(
    plan_buffer: torch.Tensor,
    segment_offsets,
    *,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    batch_capacity: int,
    token_capacity: int,
) -> AppendLaunch:
    """A pool-write parameter block with the plan's pointers and sizes filled."""
    base = plan_buffer.data_ptr()
    scalars, page_indptr, last, qo_indptr, _, _, pages = (base + 4 * o for o in segment_offsets)
    block = AppendLaunch(
        page_indices=pages,
        page_indptr=page_indptr,
        last_page_len=last,
        qo_indptr=qo_indptr,
        plan_scalars=scalars,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        batch_capacity=batch_capacity,
        token_capacity=token_capacity,
    )
    block.address = ctypes.addressof(block)
    return block


def prepare_block(
    plan_buffer: torch.Tensor,
    segment_offsets,
    *,
    page_size: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    batch_capacity: int,
    token_capacity: int,
) -> PrepareLaunch:
    """A prep parameter block with the plan's pointers and sizes filled (tensors, weights and the prep's scalars
    come per call)."""
    base = plan_buffer.data_ptr()
    scalars, page_indptr, last, qo_indptr, _, _, pages = (base + 4 * o for o in segment_offsets)
    block = PrepareLaunch(
        page_indices=pages,
        page_indptr=page_indptr,
        last_page_len=last,
        qo_indptr=qo_indptr,
        plan_scalars=scalars,
        page_size=page_size,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        batch_capacity=batch_capacity,
        token_capacity=token_capacity,
    )
    block.address = ctypes.addressof(block)
    return block


_inv_freq_arrays: dict[tuple, ctypes.Array] = {}  # (head_dim, theta, factor) -> the block's inv_freq field


def _inv_freq_field(head_dim: int, rope_theta: float, rope_position_factor: float) -> ctypes.Array:
    key = (head_dim, rope_theta, rope_position_factor)
    field = _inv_freq_arrays.get(key)
    if field is None:
        if len(_inv_freq_arrays) >= 64:
            _inv_freq_arrays.clear()
        values = rope_inv_freq(head_dim, rope_theta, rope_position_factor)
        field = _inv_freq_arrays[key] = (_f * PREPARE_MAX_HALF)(*values)
    return field


# -- direct launches (the eager path) -----------------------------------------------------------------------------


def write_prefill_scalars(
    block: PrefillLaunch, k_offset: int, v_offset: int, page_stride: int, sm_scale: float, window_left: int
) -> None:
    """Write the attention's checked per-call scalars into ``block`` (the pool's offsets and page stride in
    elements, the scale, the window), only when they change."""
    scalars = (k_offset, v_offset, page_stride, sm_scale, window_left)
    if block.scalars != scalars:
        block.k_offset, block.v_offset, block.page_stride = k_offset, v_offset, page_stride
        block.sm_scale, block.window_left = sm_scale, window_left
        block.scalars = scalars


def write_append_scalars(block: AppendLaunch, k_offset: int, v_offset: int, page_stride: int) -> None:
    """Write the pool write's checked per-call scalars into ``block``, only when they change."""
    scalars = (k_offset, v_offset, page_stride)
    if block.scalars != scalars:
        block.k_offset, block.v_offset, block.page_stride = k_offset, v_offset, page_stride
        block.scalars = scalars


def launch_prefill(
    block: PrefillLaunch,
    q: torch.Tensor,
    pool: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    k_offset: int,
    v_offset: int,
    page_stride: int,
    sm_scale: float,
    window_left: int,
) -> None:
    """Fill the per-call fields of ``block`` and launch on ``q``'s device's current stream."""
    block.q, block.out, block.pool = q.data_ptr(), out.data_ptr(), pool.data_ptr()
    block.lse = lse.data_ptr() if lse is not None else None
    write_prefill_scalars(block, k_offset, v_offset, page_stride, sm_scale, window_left)
    lib = _by_device.get(q.device.index) or library(q.device)
    code = _launch_on(q.device, lib.prefill, block)
    if code != 0:
        check_status(code, lib.prefill.__name__, lib.pw_prefill_hd256_error_string)  # one status table for both


def launch_append(
    block: AppendLaunch,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: torch.Tensor,
    k_offset: int,
    v_offset: int,
    page_stride: int,
) -> None:
    """Fill the per-call fields of ``block`` and launch the pool write on ``k``'s device's current stream."""
    block.k, block.v, block.pool = k.data_ptr(), v.data_ptr(), pool.data_ptr()
    write_append_scalars(block, k_offset, v_offset, page_stride)
    block.elem_bytes = k.element_size()
    lib = _by_device.get(k.device.index) or library(k.device)
    code = _launch_on(k.device, lib.pw_append_paged_kv, block)
    if code != 0:
        check_status(code, "pw_append_paged_kv", lib.pw_append_paged_kv_error_string)


def write_prepare_scalars(
    block: PrepareLaunch,
    k_offset: int,
    v_offset: int,
    page_stride: int,
    eps: float,
    rope_theta: float,
    rope_position_factor: float,
    norm_style: str,
) -> None:
    """Write the prep's checked per-call scalars into ``block``: the pool's offsets and page stride (elements),
    the norm's style and eps, RoPE's inverse frequencies. Each field is written only when it changes (the 1 KiB
    ``inv_freq`` above all)."""
    rope = (rope_theta, rope_position_factor)
    scalars = (k_offset, v_offset, page_stride, norm_style, eps, *rope)
    if block.scalars != scalars:
        block.k_offset, block.v_offset, block.page_stride = k_offset, v_offset, page_stride
        block.norm_style = PREPARE_NORM_STYLE_CODES[norm_style]
        block.eps = eps
        if block.scalars is None or block.scalars[-2:] != rope:
            block.inv_freq = _inv_freq_field(block.head_dim, rope_theta, rope_position_factor)
        block.scalars = scalars


def launch_prepare(
    block: PrepareLaunch,
    device: torch.device,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: torch.Tensor,
    out_q: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    k_offset: int,
    v_offset: int,
    page_stride: int,
    eps: float,
    rope_theta: float,
    rope_position_factor: float,
    norm_style: str,
) -> None:
    """Fill the per-call fields of ``block`` and launch the prep on ``device`` (the tensors') current stream."""
    block.q, block.k, block.v, block.pool, block.q_out = (
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        pool.data_ptr(),
        out_q.data_ptr(),
    )
    block.q_weight, block.k_weight = q_weight.data_ptr(), k_weight.data_ptr()
    block.dtype = PREPARE_DTYPE_CODES[q.dtype]
    block.weight_fp32 = int(q_weight.dtype == torch.float32)
    write_prepare_scalars(block, k_offset, v_offset, page_stride, eps, rope_theta, rope_position_factor, norm_style)
    lib = _by_device.get(device.index) or library(device)
    code = _launch_on(device, lib.pw_prepare_qkv, block)
    if code != 0:
        check_status(code, "pw_prepare_qkv", lib.pw_prepare_qkv_error_string)


# -- the same launches as custom ops (what torch.compile and torch.export see) -----------------------------------


@torch.library.custom_op("pagedwindow::prefill_hd256", mutates_args=("out", "lse", "workspace", "split_counters"))
def prefill_hd256(
    q: torch.Tensor,
    pool: torch.Tensor,
    plan_buffer: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    workspace: torch.Tensor | None,
    split_counters: torch.Tensor | None,
    k_offset: int,
    v_offset: int,
    page_stride: int,
    page_size: int,
    num_qo_heads: int,
    num_kv_heads: int,
    segment_offsets: list[int],
    grid_tiles: int,
    cta_tile_q: int,
    sm_scale: float,
    window_left: int,
) -> None:
    """Windowed paged prefill, bf16, head_dim 256. Inputs are validated by ``pagedwindow.api``. ``workspace`` and
    ``split_counters`` are the decode kernel's (tile 16; None elsewhere)."""
    block = prefill_block(
        plan_buffer,
        segment_offsets,
        page_size=page_size,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        grid_tiles=grid_tiles,
        cta_tile_q=cta_tile_q,
        workspace=workspace,
        split_counters=split_counters,
    )
    launch_prefill(block, q, pool, out, lse, k_offset, v_offset, page_stride, sm_scale, window_left)


@prefill_hd256.register_fake
def _(
    q,
    pool,
    plan_buffer,
    out,
    lse,
    workspace,
    split_counters,
    k_offset,
    v_offset,
    page_stride,
    page_size,
    num_qo_heads,
    num_kv_heads,
    segment_offsets,
    grid_tiles,
    cta_tile_q,
    sm_scale,
    window_left,
) -> None:
    return None


@torch.library.custom_op("pagedwindow::append_paged_kv", mutates_args=("pool",))
def append_paged_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    pool: torch.Tensor,
    plan_buffer: torch.Tensor,
    k_offset: int,
    v_offset: int,
    page_stride: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    segment_offsets: list[int],
    batch_capacity: int,
    token_capacity: int,
) -> None:
    """Scatter the plan's new K/V rows into their pool slots (a bit-exact copy)."""
    block = append_block(
        plan_buffer,
        segment_offsets,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        batch_capacity=batch_capacity,
        token_capacity=token_capacity,
    )
    launch_append(block, k, v, pool, k_offset, v_offset, page_stride)


@append_paged_kv.register_fake
def _(
    k,
    v,
    pool,
    plan_buffer,
    k_offset,
    v_offset,
    page_stride,
    page_size,
    num_kv_heads,
    head_dim,
    segment_offsets,
    batch_capacity,
    token_capacity,
) -> None:
    return None


@torch.library.custom_op("pagedwindow::prepare_qkv", mutates_args=("pool", "out_q"))
def prepare_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: torch.Tensor,
    out_q: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    plan_buffer: torch.Tensor,
    k_offset: int,
    v_offset: int,
    page_stride: int,
    page_size: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    segment_offsets: list[int],
    batch_capacity: int,
    token_capacity: int,
    eps: float,
    rope_theta: float,
    rope_position_factor: float,
    norm_style: str,
) -> None:
    """Gemma's prep: q/k/v norms and RoPE, q into ``out_q``, K/V into their pool slots."""
    block = prepare_block(
        plan_buffer,
        segment_offsets,
        page_size=page_size,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        batch_capacity=batch_capacity,
        token_capacity=token_capacity,
    )
    launch_prepare(
        block,
        q.device,
        q,
        k,
        v,
        pool,
        out_q,
        q_weight,
        k_weight,
        k_offset,
        v_offset,
        page_stride,
        eps,
        rope_theta,
        rope_position_factor,
        norm_style,
    )


@prepare_qkv.register_fake
def _(
    q,
    k,
    v,
    pool,
    out_q,
    q_weight,
    k_weight,
    plan_buffer,
    k_offset,
    v_offset,
    page_stride,
    page_size,
    num_qo_heads,
    num_kv_heads,
    head_dim,
    segment_offsets,
    batch_capacity,
    token_capacity,
    eps,
    rope_theta,
    rope_position_factor,
    norm_style,
) -> None:
    return None
