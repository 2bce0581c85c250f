"""HF's captured per-layer q/k/v replayed through the paged API, and a probe of the attention weights used.

:func:`replay_capture` feeds one prompt's captured q/k/v (``pagedwindow.hf.capture_attention``, batch of one) into
a ``pagedwindow.PagedKvState`` in a chunk schedule — each step appends the chunk's K/V and attends through a
``PrefillPagedPlan`` (shuffled pages; a chunk starting at p > 0 is a chunked prefill on a cached prefix) — and
returns our output per layer.

:func:`probe_weights` reads back the attention weights ``P[h, q, k]`` a backend actually used, through the same
API: it replays one layer with one-hot values, key ``k`` carrying ``e_{k mod D}`` in pass ``(k // D) mod n`` and
zero in the others, so output ``[q, h, k mod D]`` of that pass is ``P[h, q, k]``. With ``n * D`` above the keys a
query can see (the probed span), no two keys share a slot in one pass. The weights are compared with a float64
softmax of the same q/k, by key distance ``q_pos − k`` and by the key's slot within its page. For sliding layers
the probed span reaches twice the window, so weight put beyond the window's edge (which must be exactly 0) shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kv_state import PagedKvState
from ..semantics import key_visible, window_left_from_sliding_window

PROBE_ROW_BLOCK = 128  # query rows per float64 block of the probe comparison


def _rows(t: torch.Tensor) -> torch.Tensor:
    """HF's ``[1, H, L, D]`` as ``[L, H, D]`` (contiguous)."""
    return t[0].transpose(0, 1).contiguous()


def _replay(
    layers: list,
    q: list,
    k: list,
    v: list,
    scale: list,
    window: list,
    *,
    chunks,
    page_size: int,
    backend: str,
    seed: int,
) -> list:
    """Replay per-layer ``q [L, Hq, D]``, ``k/v [L, Hkv, D]`` in ``chunks``; returns per layer ``[L, Hq, D]``."""
    state = PagedKvState(layers, page_size=page_size, backend=backend, seed=seed)
    state.reset(1)
    outs = [[] for _ in layers]
    at = 0
    for n in chunks:
        state.begin_step([n])
        for i in range(len(layers)):
            outs[i].append(
                state.attend(
                    i, q[i][at : at + n], k[i][at : at + n], v[i][at : at + n], sm_scale=scale[i], window_left=window[i]
                )
            )
        at += n
    return [torch.cat(o) for o in outs]


def replay_capture(capture, *, chunks, page_size: int, backend: str, seed: int = 0) -> list:
    """Our output of every layer of ``capture`` (one prompt) fed in ``chunks``: per layer ``[L, Hq, D]``."""
    calls = sorted(capture.calls, key=lambda c: c.layer_idx)
    return _replay(
        [(c.k.shape[1], c.k.shape[3]) for c in calls],
        [_rows(c.q) for c in calls],
        [_rows(c.k) for c in calls],
        [_rows(c.v) for c in calls],
        [c.scaling for c in calls],
        [window_left_from_sliding_window(c.sliding_window) for c in calls],
        chunks=chunks,
        page_size=page_size,
        backend=backend,
        seed=seed,
    )


@dataclass
class WeightProbe:
    """Attention weights of one layer as a backend used them, against float64 (see the module docstring)."""

    layer: int
    window_left: int
    span: int  # key distances probed: 0 .. span - 1
    passes: int
    distance_max_err: torch.Tensor  # [span] max over (head, query) of |P_ours − P_fp64| at distance q_pos − k
    distance_mean_weight: torch.Tensor  # [span] mean P_fp64 at that distance (over queries having such a key)
    distance_mean_ours: torch.Tensor  # [span] mean P_ours at that distance
    slot_max_err: torch.Tensor  # [page_size] max |ΔP| by the key's slot in its page
    max_err: float
    weight_beyond_window: float  # max P_ours on a key farther than window_left (must be exactly 0)
    weight_sum_err: float  # max |1 − Σ_probed P_ours| over (head, query)


@torch.no_grad()
def probe_weights(call, *, chunks, page_size: int, backend: str, seed: int = 0) -> WeightProbe:
    """Probe one captured layer call (``pagedwindow.hf.LayerCall`` of a batch of one); see the module docstring."""
    q, k = _rows(call.q), _rows(call.k)  # [L, Hq, D], [L, Hkv, D]
    length, hq, d = q.shape
    hkv = k.shape[1]
    window_left = window_left_from_sliding_window(call.sliding_window)
    span = length if window_left < 0 else min(length, 2 * (window_left + 1))
    passes = math.ceil(span / d)
    key_pos = torch.arange(length, device=k.device)
    outs = []
    for j in range(passes):
        v = torch.zeros(length, hkv, d, dtype=k.dtype, device=k.device)  # [L, Hkv, D] one-hot values
        mine = ((key_pos // d) % passes) == j
        v[key_pos[mine], :, (key_pos % d)[mine]] = 1
        outs.append(
            _replay(
                [(hkv, d)],
                [q],
                [k],
                [v],
                [call.scaling],
                [window_left],
                chunks=chunks,
                page_size=page_size,
                backend=backend,
                seed=seed,
            )[0]
        )
    table = torch.stack(outs, dim=2).double().reshape(length, hq, passes * d)  # [L, Hq, passes*D]

    dist_max = torch.zeros(span, dtype=torch.float64)
    dist_sum = torch.zeros(span, dtype=torch.float64)
    ours_sum = torch.zeros(span, dtype=torch.float64)
    dist_cnt = torch.zeros(span, dtype=torch.float64)
    slot_max = torch.zeros(page_size, dtype=torch.float64)
    beyond, sum_err = 0.0, 0.0
    group = hq // hkv
    k64 = k.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
    t = torch.arange(span, device=k.device)
    for a in range(0, length, PROBE_ROW_BLOCK):
        b = min(length, a + PROBE_ROW_BLOCK)
        p = torch.arange(a, b, device=k.device)[:, None]  # [n, 1] query positions
        keys = p - t[None, :]  # [n, span] key at each distance
        valid = keys >= 0
        keys_c = keys.clamp_min(0)
        slot = ((keys_c // d) % passes) * d + keys_c % d  # [n, span] column of the key in the table
        ours = table[a:b].gather(2, slot[:, None, :].expand(-1, hq, -1))  # [n, Hq, span]
        logits = torch.einsum("nhd,lhd->nhl", q[a:b].double(), k64) * call.scaling  # [n, Hq, L]
        visible = key_visible(p, key_pos[None, :], window_left)  # [n, L]
        truth = torch.softmax(logits.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
        truth = truth.gather(2, keys_c[:, None, :].expand(-1, hq, -1))  # [n, Hq, span]
        ours = ours.masked_fill(~valid[:, None, :], 0.0)
        truth = truth.masked_fill(~valid[:, None, :], 0.0)
        err = (ours - truth).abs()  # [n, Hq, span]
        dist_max = torch.maximum(dist_max, err.amax(dim=(0, 1)).cpu())
        dist_sum += truth.sum(dim=(0, 1)).cpu()
        ours_sum += ours.sum(dim=(0, 1)).cpu()
        dist_cnt += valid.sum(dim=0).cpu().double() * hq
        slot_err = err.amax(dim=1)  # [n, span]
        slot_max = slot_max.scatter_reduce(
            0, (keys_c % page_size).flatten().cpu(), slot_err.flatten().cpu(), reduce="amax"
        )
        if window_left >= 0 and span > window_left + 1:
            beyond = max(beyond, float(ours[:, :, window_left + 1 :].abs().max()))
        sum_err = max(sum_err, float((1.0 - ours.sum(dim=2)).abs().max()))
    return WeightProbe(
        layer=int(call.layer_idx),
        window_left=window_left,
        span=span,
        passes=passes,
        distance_max_err=dist_max,
        distance_mean_weight=dist_sum / dist_cnt.clamp_min(1),
        distance_mean_ours=ours_sum / dist_cnt.clamp_min(1),
        slot_max_err=slot_max,
        max_err=float(dist_max.max()),
        weight_beyond_window=beyond,
        weight_sum_err=sum_err,
    )
