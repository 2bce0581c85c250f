"""The query tiles the head_dim-256 kernels run, and the policy that picks a plan's default tile.

A tile is ``cta_tile_q`` packed GQA rows per CTA (packed row ``r`` is token ``r // group``, head-in-group
``r % group``); request ``i`` gets ``ceil(seq_i * group / cta_tile_q)`` tiles. Any supported tile is correct;
the policy picks the one measured fastest for the shape on the device the plan is for
(``benchmarks/NOTES.md``, "Tile policy by waves"; the split rule: runs 157-158):

- Every GPU: 16 when no request has more than ``DECODE_ROWS`` packed rows (one new token at group 2), or no
  more than 16 (a few new tokens), or no more than ``SHORT_ROWS`` while (packed rows x keys) of the largest
  request stays within ``SHORT_WORK`` (a few new tokens on a short context). Tile 16 runs the split-KV decode
  kernel (``kernels/decode_hd256.cu``), which reads each request's K/V once per KV head and 16-row tile and
  spreads a small batch's keys over every SM; a prefill tile would run mostly empty. Past that work the decode
  kernel's extra K/V reads (one pass per 16 rows) cost more. Except: tiles of more than ``DECODE_ROWS`` rows
  that the decode kernel would split (few tiles, enough keys) go to the prefill tiles when their grid has at
  least ``MIN_PREFILL_GRID`` CTAs (each split writes, and the merge re-reads, every row's fp32 partial), unless
  the batch is small on long keys: at most ``SPLIT_FEW_ROWS`` packed rows in all and at least
  ``SPLIT_LONG_KEYS`` keys, where each prefill CTA would walk the keys alone and the split tiles stay at 16
  (up to 32 rows a request).
- Hopper (compute capability 9.0, the wgmma kernel): 64 or 128, whichever has the smaller estimated time
  ``waves(tile) x tile x row_cost(tile)``, where ``waves`` is the grid (tiles x KV heads) over the SMs rounded
  up and ``row_cost`` is 1 at 128 and ``TILE64_ROW_COST`` at 64 (a full 64-row tile's per-row cost on long
  prefills). Ties go to 128. So a grid of one wave at 64 (and so at 128) goes to 64 (a 512-token chunk), and one
  that needs a second wave at 64 but only one at 128 goes to 128 (a 1024-token prompt).
- Other GPUs (the mma.sync kernel): else 64 (128 gains nothing there: the kernel is bound by its shared-memory
  reads).
- No GPU: the Hopper rule, so a plan built on a CPU host lays out the way it would on the target.

A preallocated plan fixes its tile from its capacity (``tile_for_capacity``): 16 when the capacity holds one new
token per request (a decode loop), else on Hopper 128 when it averages at least 64 new tokens per request, else
64.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

SUPPORTED_CTA_TILE_Q = (16, 64, 128)
"""Every tile both prefill kernels are built for (``kernels/prefill_launch.cuh`` checks the same list)."""

SHORT_ROWS = 64
"""Packed rows of the largest request up to which tile 16 can win beyond decode (measured on the H200)."""
SHORT_WORK = 4096
"""Packed rows x keys (kv_len) of the largest request up to which tile 16 beats tile 64 (measured on the H200:
32 rows x 128 keys 1.22x faster at 16, 32 x 256 level, 64 x 128 0.73x)."""
SPLIT_KV_TILE = 16
"""The tile whose plans run the split-KV decode kernel."""
SPLIT_KV_UNITS_PER_SM = 4
"""Split-KV work units per SM (the decode kernel keeps 4 one-warp CTAs per SM busy): the workspace's size, and
with the launch's tiles x KV heads ("items") what decides its split count,
``min(SPLIT_KV_MAX_SPLITS, units // items)``."""
SPLIT_KV_MAX_SPLITS = 64
"""Splits of one tile's keys at most (``kMaxSplits`` in ``kernels/decode_hd256.cu``)."""
DECODE_ROWS = 2
"""Packed rows per request up to which tile 16 wins whatever the split (one new token at group 2: split 2-row
tiles 1.1-1.7x faster than 64 on the H200; the decode sweep). Tiles of more rows that split lose to the
prefill tiles except on a small batch with long keys (on an H100, 8-, 16- and 32-row tiles: ``SPLIT_FEW_ROWS``)."""
SPLIT_FEW_ROWS = 32
"""Packed rows of the whole batch up to which split tiles of more than ``DECODE_ROWS`` rows stay at 16 on
``SPLIT_LONG_KEYS`` keys or more (on an H100 at 4 096 keys, window 1023: one request of 8 or 16 rows 1.66x /
1.33x faster at 16, two of 8 rows 1.36x; 32 rows in all level or 1.15x faster; 64 in all 1.1-1.3x slower)."""
SPLIT_LONG_KEYS = 1024
"""Keys (the longest kv_len) from which a small batch's split tiles stay at 16 (at 244 keys tile 64 is 1.2-1.7x
faster for 8-32 rows at every batch on an H100; at 1 024 visible keys 16 wins). The plan does not know the
window, so a request whose window shows it fewer keys is judged by its kv_len."""
SPLIT_STEP_KEYS = 16
"""Keys of one decode-kernel step (``kSteps`` in ``kernels/decode_hd256.cu``)."""
SPLIT_MIN_STEPS = 2
"""Steps a split of a tile's keys covers at least (``kMinStepsPerSplit``)."""
SPLIT_MIN_KEYS = 2 * SPLIT_MIN_STEPS * SPLIT_STEP_KEYS
"""Keys a tile needs before the decode kernel splits it (two splits of its two-step minimum, 16 keys a step): 64."""
MIN_PREFILL_GRID = 8
"""The smallest prefill grid (requests with new rows x KV heads) measured beating split 16-row tiles."""
TILE64_ROW_COST = 1.35
"""Time per packed row of a full 64-row tile relative to a full 128-row tile on the wgmma kernel (long prefills
run 1.3-1.4x faster at 128 on the H200)."""

CPU_DEFAULT_CAPABILITY = (9, 0)
CPU_DEFAULT_SM_COUNT = 132
"""The device the policy assumes when a plan is built with no GPU in sight: the H200 (sm_90a, 132 SMs)."""

_SMALL_BATCH = 32
"""Batches up to this size are walked by the policy as Python ints (cheaper than numpy's per-call cost there)."""


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
    seq_lens: np.ndarray,
    group: int,
    num_kv_heads: int,
    device=None,
    *,
    longest_kv_len: Callable[[], int],
) -> tuple[int, str]:
    """The default tile for a batch with these new-row counts (``seq_lens [batch]``); ``longest_kv_len()`` gives
    the largest kv_len of the batch and is called only when the rule needs it. Returns (tile, reason).
    :func:`tile_for_counts` with the counts taken from ``seq_lens``."""
    listed: list[int] | None = [s * group for s in seq_lens.tolist()] if len(seq_lens) <= _SMALL_BATCH else None
    busiest = max(listed) if listed is not None else int(seq_lens.max()) * group  # packed rows, largest request

    def tiles_at(tile: int) -> int:  # tiles at this tile; a request with no new rows has none
        if listed is not None:
            return sum(-(-r // tile) for r in listed)
        rows = seq_lens.astype(np.int64) * group  # [batch] packed rows per request
        return int((-(-rows // tile)).sum())

    return tile_for_counts(
        busiest,
        tiles_at,
        lambda: int(np.count_nonzero(seq_lens)),
        num_kv_heads,
        device,
        longest_kv_len=longest_kv_len,
        total_rows=lambda: sum(listed) if listed is not None else int(seq_lens.sum()) * group,
    )


def tile_for_counts(
    max_rows: int,
    tiles_at: Callable[[int], int],
    busy_requests: Callable[[], int],
    num_kv_heads: int,
    device=None,
    *,
    longest_kv_len: Callable[[], int],
    total_rows: Callable[[], int],
) -> tuple[int, str]:
    """The policy's rule on what it reads of a batch, each count asked only when the rule needs it: ``max_rows``
    (packed rows of the request with the most), ``tiles_at(tile)`` (the batch's tiles at ``tile``, one of
    ``SUPPORTED_CTA_TILE_Q``), ``busy_requests()`` (requests with new rows), ``longest_kv_len()``,
    ``total_rows()`` (packed rows of the whole batch). The plan's compiled pass hands the counts it computed;
    :func:`tile_for_batch` computes them from arrays."""
    capability, sm_count = device_traits(device)
    arch = f"sm_{capability[0]}{capability[1]}"
    if max_rows <= DECODE_ROWS:
        return 16, f"policy {arch}: at most {max_rows} packed rows per request (decode)"
    prefix = ""
    if max_rows <= SHORT_ROWS:
        keys = longest_kv_len()
        rows_in_all = total_rows() if keys >= SPLIT_LONG_KEYS else None
        if rows_in_all is not None and rows_in_all <= SPLIT_FEW_ROWS:  # a small batch on long keys: 16, split or not
            return 16, (
                f"policy {arch}: at most {max_rows} packed rows per request, {rows_in_all} in all on {keys} keys "
                "(few on long keys)"
            )
        if max_rows <= 16 or max_rows * keys <= SHORT_WORK:
            why = "per request (decode)" if max_rows <= 16 else f"x {keys} keys per request (short)"
            grid = tiles_at(SPLIT_KV_TILE) * num_kv_heads  # CTAs at tile 16
            splits = min(SPLIT_KV_MAX_SPLITS, SPLIT_KV_UNITS_PER_SM * sm_count // grid)
            if splits < 2 or keys < SPLIT_MIN_KEYS or busy_requests() * num_kv_heads < MIN_PREFILL_GRID:
                return 16, f"policy {arch}: at most {max_rows} packed rows {why}"
            prefix = f"{min(max_rows, 16)}-row tiles at 16 would split {splits} ways; "
    if capability != (9, 0):
        return 64, f"policy {arch}: {prefix}mma.sync kernel"
    waves = {t: -(-tiles_at(t) * num_kv_heads // sm_count) for t in (64, 128)}  # grid over the SMs, rounded up
    cost64, cost128 = waves[64] * 64 * TILE64_ROW_COST, waves[128] * 128
    tile = 128 if cost128 <= cost64 else 64
    return tile, (
        f"policy sm_90: {prefix}tile {tile}, waves x rows {waves[128]} x 128 = {cost128:.0f} at 128, "
        f"{waves[64]} x 64 x {TILE64_ROW_COST} = {cost64:.0f} at 64"
    )


def tile_for_capacity(max_total_tokens: int, max_batch: int, device=None) -> tuple[int, str]:
    """The tile a preallocated plan fixes at creation, from its capacity; returns (tile, reason)."""
    capability, _ = device_traits(device)
    per_request = max_total_tokens / max_batch
    if per_request <= 1:
        return 16, f"policy sm_{capability[0]}{capability[1]} capacity: one token per request (decode)"
    if capability == (9, 0) and per_request >= 64:
        return 128, f"policy sm_90 capacity: {per_request:.0f} tokens per request >= 64"
    return 64, f"policy sm_{capability[0]}{capability[1]} capacity: {per_request:.0f} tokens per request"
