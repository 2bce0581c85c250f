"""Our kernels as torch custom ops (``torch.ops.pagedwindow.*``), loaded from the JIT-built library with ctypes.

The ops take the plan's device buffer whole (one tensor, segments at fixed offsets) so CUDA-graph replay after
``plan.update()`` reads the new plan in place. Each op mutates only its output argument and launches on the
current stream with no synchronisation and no allocation. ``register_fake`` makes them traceable by
``torch.compile`` (they return nothing; the mutation is declared).
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from .build import build_shared_library, target_for_capability

_lock = threading.Lock()
_libraries: dict[str, ctypes.CDLL] = {}  # by target
_by_device: dict[int, ctypes.CDLL] = {}  # by CUDA device index: the launch path's lookup

PREFILL_KERNELS = ("auto", "mma_sync", "wgmma")
"""``$PAGEDWINDOW_PREFILL_KERNEL``: ``auto`` (wgmma on sm_90, mma.sync elsewhere), or force one (benchmarks)."""


def prefill_entry(target: str) -> str:
    """The launcher the prefill op calls on ``target``: the sm_90a wgmma kernel on Hopper, else mma.sync."""
    choice = os.environ.get("PAGEDWINDOW_PREFILL_KERNEL", "auto")
    if choice not in PREFILL_KERNELS:
        raise RuntimeError(f"PAGEDWINDOW_PREFILL_KERNEL={choice!r} is not one of {PREFILL_KERNELS}")
    if choice == "wgmma" or (choice == "auto" and target == "sm_90a"):
        return "pw_prefill_hd256_bf16_sm90"
    return "pw_prefill_hd256_bf16"

_c_int, _c_ll, _c_float, _p = ctypes.c_int, ctypes.c_longlong, ctypes.c_float, ctypes.c_void_p
_PREFILL_ARGS = [_p, _p, _p, _p, _c_ll, _c_ll, _c_ll, _c_int, _c_int, _c_int, _p, _p, _p, _p, _p, _p, _p, _c_int,
                 _c_int, _c_float, _c_int, _p]
_APPEND_ARGS = [_p, _p, _p, _c_ll, _c_ll, _c_ll, _c_int, _c_int, _c_int, _c_int, _p, _p, _p, _p, _p, _c_int, _c_int,
                _p]


def load(path) -> ctypes.CDLL:
    """Load a built kernels library and declare its launchers' C signatures."""
    lib = ctypes.CDLL(str(path))
    for name in ("pw_prefill_hd256_bf16", "pw_prefill_hd256_bf16_sm90"):
        getattr(lib, name).argtypes = _PREFILL_ARGS
        getattr(lib, name).restype = _c_int
    lib.pw_prefill_hd256_sm90_kv_copy_mode.argtypes = [_p, _c_ll, _c_ll, _c_ll, _c_int, _c_int]
    lib.pw_prefill_hd256_sm90_kv_copy_mode.restype = _c_int
    lib.pw_append_paged_kv.argtypes = _APPEND_ARGS
    lib.pw_append_paged_kv.restype = _c_int
    for name in ("pw_prefill_hd256_error_string", "pw_prefill_hd256_sm90_error_string",
                 "pw_append_paged_kv_error_string"):
        getattr(lib, name).argtypes = [_c_int]
        getattr(lib, name).restype = ctypes.c_char_p
    return lib


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
            lib = load(build_shared_library(target))
            lib.prefill = getattr(lib, prefill_entry(target))
            _libraries[target] = lib
        _by_device[index] = lib
    return lib


def _segment_pointers(plan_buffer: torch.Tensor, segment_sizes: list[int]) -> list[int]:
    base, at, pointers = plan_buffer.data_ptr(), 0, []
    for size in segment_sizes:
        pointers.append(base + 4 * at)
        at += size
    return pointers


def _check(code: int, name: str, error_string) -> None:
    if code != 0:
        raise RuntimeError(f"{name} failed with code {code}: {error_string(code).decode()}")


@torch.library.custom_op("pagedwindow::prefill_hd256", mutates_args=("out", "lse"))
def prefill_hd256(q: torch.Tensor, pool: torch.Tensor, plan_buffer: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor | None, k_offset: int, v_offset: int, page_stride: int, page_size: int,
                  num_qo_heads: int, num_kv_heads: int, segment_sizes: list[int], grid_tiles: int,
                  cta_tile_q: int, sm_scale: float, window_left: int) -> None:
    """Windowed paged prefill, bf16, head_dim 256. Inputs are validated by ``pagedwindow.api``."""
    pages, page_indptr, last, qo_indptr, requests, qo_tiles, scalars = _segment_pointers(plan_buffer, segment_sizes)
    lib = library(q.device)
    with torch.cuda.device(q.device):  # the launcher launches on the current device
        stream = torch.cuda.current_stream(q.device).cuda_stream
        code = lib.prefill(
            q.data_ptr(), out.data_ptr(), lse.data_ptr() if lse is not None else None, pool.data_ptr(), k_offset,
            v_offset, page_stride, page_size, num_qo_heads, num_kv_heads, pages, page_indptr, last, qo_indptr,
            requests, qo_tiles, scalars, grid_tiles, cta_tile_q, sm_scale, window_left, stream)
    _check(code, lib.prefill.__name__, lib.pw_prefill_hd256_error_string)  # one status table for both


@prefill_hd256.register_fake
def _(q, pool, plan_buffer, out, lse, k_offset, v_offset, page_stride, page_size, num_qo_heads, num_kv_heads,
      segment_sizes, grid_tiles, cta_tile_q, sm_scale, window_left) -> None:
    return None


@torch.library.custom_op("pagedwindow::append_paged_kv", mutates_args=("pool",))
def append_paged_kv(k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor, plan_buffer: torch.Tensor,
                    k_offset: int, v_offset: int, page_stride: int, page_size: int, num_kv_heads: int,
                    head_dim: int, segment_sizes: list[int], batch_capacity: int, token_capacity: int) -> None:
    """Scatter the plan's new K/V rows into their pool slots (a bit-exact copy)."""
    pages, page_indptr, last, qo_indptr, _, _, scalars = _segment_pointers(plan_buffer, segment_sizes)
    lib = library(k.device)
    with torch.cuda.device(k.device):
        stream = torch.cuda.current_stream(k.device).cuda_stream
        code = lib.pw_append_paged_kv(
            k.data_ptr(), v.data_ptr(), pool.data_ptr(), k_offset, v_offset, page_stride, page_size, num_kv_heads,
            head_dim, k.element_size(), pages, page_indptr, last, qo_indptr, scalars, batch_capacity,
            token_capacity, stream)
    _check(code, "pw_append_paged_kv", lib.pw_append_paged_kv_error_string)


@append_paged_kv.register_fake
def _(k, v, pool, plan_buffer, k_offset, v_offset, page_stride, page_size, num_kv_heads, head_dim, segment_sizes,
      batch_capacity, token_capacity) -> None:
    return None
