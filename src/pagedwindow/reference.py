"""The PyTorch reference of pagedwindow's math; also the CPU backend (``backend="reference"``).

Accepts bf16 / fp16 / fp32 / fp64 tensors. Math runs in fp32 (fp64 when the inputs are fp64, so the same code is
a float64 oracle); the output is cast once to ``out``'s dtype. Callers pass inputs the API has already checked.
Under ``torch.compile`` the three entry points run eagerly (a graph break): they read the plan's host arrays
and loop over requests, which a graph cannot hold.
"""

from __future__ import annotations

import torch

from .layout import PagedGeometry
from .plan import PrefillPagedPlan
from .semantics import key_visible, window_start

_LOGITS_BUDGET = 1 << 25  # logits elements materialised at once (128 MiB in fp32)


def _layer_cache(pool: torch.Tensor, geometry: PagedGeometry, which: int, num_kv_heads: int, head_dim: int):
    """K (which=0) or V (which=1) of the geometry's layer as ``[num_pages, page_size, num_kv_heads, head_dim]``."""
    offset = geometry.k_offset if which == 0 else geometry.v_offset
    block = geometry.page_size * num_kv_heads * head_dim
    pages = pool.view(geometry.num_pages, geometry.page_stride)  # [num_pages, page_stride]
    return pages[:, offset : offset + block].view(geometry.num_pages, geometry.page_size, num_kv_heads, head_dim)


def _slots(pages: torch.Tensor, page_size: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page id, slot) of KV positions ``lo .. hi-1`` of a request whose page ids are ``pages``."""
    pos = torch.arange(lo, hi, device=pages.device)  # [hi - lo]
    return pages[pos // page_size], pos % page_size


def _request_pages(plan: PrefillPagedPlan, device) -> list[torch.Tensor]:
    """Each request's page ids as a long tensor on ``device``."""
    ids = plan.page_indices.to(device=device, dtype=torch.long)  # [total_pages]
    return list(torch.split(ids, torch.diff(plan.page_indptr).tolist()))


@torch.compiler.disable
def batch_prefill_paged_window(
    q: torch.Tensor,
    pool: torch.Tensor,
    geometry: PagedGeometry,
    plan: PrefillPagedPlan,
    *,
    sm_scale: float,
    window_left: int,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
) -> None:
    """Write ``out[:total_tokens]`` (and ``lse[:total_tokens]`` if given) for every request of ``plan``.

    q/out: ``[rows >= total_tokens, num_qo_heads, head_dim]``; lse: ``[rows >= total_tokens, num_qo_heads]``.
    """
    hq, hkv, d, group = plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.group_size
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    k_cache = _layer_cache(pool, geometry, 0, hkv, d)  # [num_pages, page_size, hkv, d]
    v_cache = _layer_cache(pool, geometry, 1, hkv, d)
    qo = plan.qo_indptr.tolist()
    request_pages = _request_pages(plan, pool.device)
    for r, (start, seq) in enumerate(zip(plan.start_positions, plan.seq_lens)):
        if seq == 0:
            continue
        kv_len = start + seq
        rows_per_chunk = max(1, _LOGITS_BUDGET // max(1, hq * kv_len))
        for j0 in range(0, seq, rows_per_chunk):
            j1 = min(seq, j0 + rows_per_chunk)
            q_lo, q_hi = start + j0, start + j1  # KV positions of these query rows: [q_lo, q_hi)
            k_lo = window_start(q_lo, window_left)
            page_ids, slots = _slots(request_pages[r], plan.page_size, k_lo, q_hi)
            keys = k_cache[page_ids, slots].to(compute)  # [m, hkv, d]
            values = v_cache[page_ids, slots].to(compute)  # [m, hkv, d]
            rows = q[qo[r] + j0 : qo[r] + j1].to(compute).view(j1 - j0, hkv, group, d)  # [n, hkv, g, d]
            logits = torch.einsum("nhgd,mhd->hgnm", rows, keys) * sm_scale  # [hkv, g, n, m]
            q_pos = torch.arange(q_lo, q_hi, device=pool.device)[:, None]  # [n, 1]
            k_pos = torch.arange(k_lo, q_hi, device=pool.device)[None, :]  # [1, m]
            visible = key_visible(q_pos, k_pos, window_left)  # [n, m]
            logits = logits.masked_fill(~visible, float("-inf"))
            row_lse = torch.logsumexp(logits, dim=-1)  # [hkv, g, n]
            probs = torch.exp(logits - row_lse[..., None])
            result = torch.einsum("hgnm,mhd->nhgd", probs, values).reshape(j1 - j0, hq, d)  # [n, hq, d]
            out[qo[r] + j0 : qo[r] + j1] = result.to(out.dtype)
            if lse is not None:
                lse[qo[r] + j0 : qo[r] + j1] = row_lse.permute(2, 0, 1).reshape(j1 - j0, hq).to(lse.dtype)


@torch.compiler.disable
def append_paged_kv(
    k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor, geometry: PagedGeometry, plan: PrefillPagedPlan
) -> None:
    """Copy each request's new rows (positions ``start_i .. start_i + seq_i - 1``) into their pool slots.

    k/v: ``[rows >= total_tokens, num_kv_heads, head_dim]``, rows in request order (``qo_indptr``).
    """
    k_cache = _layer_cache(pool, geometry, 0, plan.num_kv_heads, plan.head_dim)
    v_cache = _layer_cache(pool, geometry, 1, plan.num_kv_heads, plan.head_dim)
    qo = plan.qo_indptr.tolist()
    request_pages = _request_pages(plan, pool.device)
    for r, (start, seq) in enumerate(zip(plan.start_positions, plan.seq_lens)):
        if seq == 0:
            continue
        page_ids, slots = _slots(request_pages[r], plan.page_size, start, start + seq)
        k_cache[page_ids, slots] = k[qo[r] : qo[r] + seq]
        v_cache[page_ids, slots] = v[qo[r] : qo[r] + seq]


def _token_positions(plan: PrefillPagedPlan, device) -> torch.Tensor:
    """The KV position of every new row, in request order: ``start_i + j`` (``[total_tokens]`` long)."""
    pieces = [torch.arange(s, s + n, device=device) for s, n in zip(plan.start_positions, plan.seq_lens) if n]
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long, device=device)


def _rms_normed(x: torch.Tensor, eps: float, weight: torch.Tensor | None, norm_style: str) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dim (in ``x``'s dtype, fp32 or fp64), times the norm's weight:
    ``w`` for gemma4, ``1 + w`` for gemma3, none when ``weight`` is None."""
    normed = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is None:
        return normed
    w = weight.to(x.dtype)
    return normed * (w if norm_style == "gemma4" else 1.0 + w)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: ``x [n, h, D]``, ``cos``/``sin`` ``[n, 1, D/2]``."""
    x1, x2 = x.chunk(2, dim=-1)  # [n, h, D/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@torch.compiler.disable
def prepare_paged_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: torch.Tensor,
    geometry: PagedGeometry,
    plan: PrefillPagedPlan,
    *,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    inv_freq: tuple[float, ...],
    norm_style: str,
    out_q: torch.Tensor,
) -> None:
    """The Gemma prep (``pagedwindow.gemma_prep``): write the normed, rotated q into ``out_q[:total_tokens]`` and
    the normed, rotated K and the normed V into each request's new slots (positions ``start_i + j``).

    q/out_q: ``[rows >= total_tokens, num_qo_heads, D]``; k/v: ``[rows >= total_tokens, num_kv_heads, D]``.
    Math in fp32 (fp64 for fp64 inputs), one rounding to the output dtype; angles ``pos * inv_freq`` in fp32.
    """
    rows = plan.total_tokens
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    positions = _token_positions(plan, q.device)  # [rows]
    freqs = torch.tensor(inv_freq, dtype=torch.float32, device=q.device)  # [D/2]
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]  # [rows, D/2] fp32
    cos = angles.cos().to(compute)[:, None, :]  # [rows, 1, D/2]
    sin = angles.sin().to(compute)[:, None, :]
    q_rows = _rms_normed(q[:rows].to(compute), eps, q_norm_weight, norm_style)  # [rows, hq, D]
    k_rows = _rms_normed(k[:rows].to(compute), eps, k_norm_weight, norm_style)  # [rows, hkv, D]
    out_q[:rows] = _rotated(q_rows, cos, sin).to(out_q.dtype)
    k_new = _rotated(k_rows, cos, sin).to(pool.dtype)  # [rows, hkv, D]
    if norm_style == "gemma4":
        v_new = _rms_normed(v[:rows].to(compute), eps, None, norm_style).to(pool.dtype)  # [rows, hkv, D]
    else:
        v_new = v[:rows]  # gemma3: v is written as given
    append_paged_kv(k_new, v_new, pool, geometry, plan)
