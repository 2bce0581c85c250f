"""The query tiles the head_dim-256 kernels run, and the policy that picks a plan's default tile.

A tile is ``cta_tile_q`` packed GQA rows per CTA (packed row ``r`` is token ``r // group``, head-in-group
``r % group``); request ``i`` gets ``ceil(seq_i * group / cta_tile_q)`` tiles. Any supported tile is correct;
the policy picks the one measured fastest for the shape on the device the plan is for
(``benchmarks/NOTES.md``, "Tile policy"):

- Every GPU: 16 when no request has more than 16 packed rows (decode, and a few new tokens per request): tile 16
  runs the split-KV decode kernel (``kernels/decode_hd256.cu``), which reads each request's K/V window once per
  KV head and spreads a small batch's keys over every SM; the prefill tiles would compute 4-64x more padding.
- Hopper (compute capability 9.0, the wgmma kernel): 128 when the requests carrying new rows average at least
  128 packed rows and the 128-row grid (tiles x KV heads) still fills every SM (long prefills and chunks:
  1.3-1.4x faster than 64 on the H200), else 64 (a 512-token chunk at 8 KV heads makes 64 CTAs at tile 128
  on 132 SMs and runs 1.35x faster at 64).
- Other GPUs (the mma.sync kernel): else 64 (128 gains nothing there: the kernel is bound by its shared-memory
  reads).
- No GPU: the Hopper rule, so a plan built on a CPU host lays out the way it would on the target.

A preallocated plan fixes its tile from its capacity (``tile_for_capacity``): 16 when the capacity holds one new
token per request (a decode loop), else on Hopper 128 when it averages at least 64 new tokens per request, else
64.
"""

from __future__ import annotations

import numpy as np
import torch

SUPPORTED_CTA_TILE_Q = (16, 64, 128)
"""Every tile both prefill kernels are built for (``kernels/prefill_launch.cuh`` checks the same list)."""

CPU_DEFAULT_CAPABILITY = (9, 0)
CPU_DEFAULT_SM_COUNT = 132
"""The device the policy assumes when a plan is built with no GPU in sight: the H200 (sm_90a, 132 SMs)."""

_devices: dict[int, tuple[tuple[int, int], int]] = {}


def device_traits(device) -> tuple[tuple[int, int], int]:
    """(compute capability, SM count) of the GPU a plan is for: ``device`` if it is a CUDA device, else the current
    CUDA device when one is present, else the CPU default (an H200). Cached per device index."""
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return CPU_DEFAULT_CAPABILITY, CPU_DEFAULT_SM_COUNT
        index = device.index
    elif torch.cuda.is_available():
        index = None
    else:
        return CPU_DEFAULT_CAPABILITY, CPU_DEFAULT_SM_COUNT
    if index is None:
        index = torch.cuda.current_device()
    found = _devices.get(index)
    if found is None:
        props = torch.cuda.get_device_properties(index)
        found = _devices[index] = ((props.major, props.minor), props.multi_processor_count)
    return found


def tile_for_batch(
    seq_lens: np.ndarray, group: int, num_kv_heads: int, device=None, *, total_tokens: int | None = None
) -> tuple[int, str]:
    """The default tile for a batch with these new-row counts (``seq_lens [batch]``, summing to ``total_tokens``
    when given); returns (tile, reason)."""
    capability, sm_count = device_traits(device)
    busiest = int(seq_lens.max()) * group  # packed rows of the largest request
    if busiest <= 16:
        return 16, f"policy sm_{capability[0]}{capability[1]}: at most {busiest} packed rows per request (decode)"
    total = (int(seq_lens.sum()) if total_tokens is None else total_tokens) * group  # packed rows
    if capability == (9, 0):
        mean = total / np.count_nonzero(seq_lens)  # packed rows per request with new rows
        if mean < 128:
            return 64, f"policy sm_90: {mean:.0f} packed rows per request < 128"
        busy = seq_lens[seq_lens > 0] * group  # [requests with new rows] packed rows
        ctas = int((-(-busy // 128)).sum()) * num_kv_heads
        if ctas < sm_count:
            return 64, f"policy sm_90: {ctas} CTAs at tile 128 leave some of {sm_count} SMs idle"
        return 128, f"policy sm_90: {mean:.0f} packed rows per request >= 128, {ctas} CTAs"
    return 64, f"policy sm_{capability[0]}{capability[1]}: mma.sync kernel"


def tile_for_capacity(max_total_tokens: int, max_batch: int, device=None) -> tuple[int, str]:
    """The tile a preallocated plan fixes at creation, from its capacity; returns (tile, reason)."""
    capability, _ = device_traits(device)
    per_request = max_total_tokens / max_batch
    if per_request <= 1:
        return 16, f"policy sm_{capability[0]}{capability[1]} capacity: one token per request (decode)"
    if capability == (9, 0) and per_request >= 64:
        return 128, f"policy sm_90 capacity: {per_request:.0f} tokens per request >= 64"
    return 64, f"policy sm_{capability[0]}{capability[1]} capacity: {per_request:.0f} tokens per request"
