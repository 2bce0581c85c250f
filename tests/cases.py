"""Random paged batches and an independent dense float64 attention, shared by the CPU and GPU suites."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import pagedwindow as pw


@dataclass
class Case:
    layout: pw.PagedKvLayout
    pool: torch.Tensor  # [num_pages, num_layers, 2, page_size, hkv, d]
    layer: int
    plan: pw.PrefillPagedPlan
    q: torch.Tensor  # [total_tokens, hq, d]
    k: torch.Tensor  # [total_tokens, hkv, d] new rows
    v: torch.Tensor  # [total_tokens, hkv, d]
    full_k: list  # per request [kv_len, hkv, d], prefix and new rows
    full_v: list


def make_case(gen: torch.Generator, *, seq_lens, start_positions, page_size, num_qo_heads, num_kv_heads,
              head_dim, dtype=torch.float64, device="cpu", num_layers=2, layer=1, spare_pages=3,
              cta_tile_q=None, shared_plan_device=None, num_pages=None, unused_slots=None) -> Case:
    """A batch whose pages are a random permutation of the pool, its prefix K/V written straight into the pool
    (positions < start), every other slot filled with noise, and the new rows' K/V returned for appending.
    ``num_pages`` fixes the pool size (default: the pages needed plus ``spare_pages``). ``unused_slots`` (e.g.
    NaN), when given, fills every slot that holds no request position (past each kv_len, spare pages) instead."""
    kv_lens = [s + n for s, n in zip(start_positions, seq_lens)]
    need = [math.ceil(kv / page_size) for kv in kv_lens]
    num_pages = sum(need) + spare_pages if num_pages is None else num_pages
    order = torch.randperm(num_pages, generator=gen).tolist()
    pages, at = [], 0
    for n in need:
        pages.append(order[at: at + n])
        at += n
    lasts = [kv - (n - 1) * page_size for kv, n in zip(kv_lens, need)]
    layout = pw.PagedKvLayout(num_layers, num_kv_heads, head_dim, page_size)
    pool = torch.randn(layout.pool_shape(num_pages), generator=gen, dtype=torch.float64).to(dtype).to(device)
    if unused_slots is not None:
        used = torch.zeros(num_pages, page_size, dtype=torch.bool)  # [page, slot]
        for req_pages, kv in zip(pages, kv_lens):
            positions = torch.arange(kv)
            used[torch.tensor(req_pages, dtype=torch.long)[positions // page_size], positions % page_size] = True
        page_idx, slot_idx = (~used).nonzero(as_tuple=True)
        pool[page_idx.to(device), :, :, slot_idx.to(device)] = unused_slots

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(device)

    full_k = [rand(kv, num_kv_heads, head_dim) for kv in kv_lens]
    full_v = [rand(kv, num_kv_heads, head_dim) for kv in kv_lens]
    for i, start in enumerate(start_positions):
        for pos in range(start):
            page, slot = pages[i][pos // page_size], pos % page_size
            pool[page, layer, 0, slot] = full_k[i][pos]
            pool[page, layer, 1, slot] = full_v[i][pos]
    k = torch.cat([fk[s:] for fk, s in zip(full_k, start_positions)])
    v = torch.cat([fv[s:] for fv, s in zip(full_v, start_positions)])
    q = rand(sum(seq_lens), num_qo_heads, head_dim)
    plan = pw.PrefillPagedPlan.batch(pages, lasts, start_positions, seq_lens, num_qo_heads=num_qo_heads,
                                     num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                                     cta_tile_q=cta_tile_q, device=shared_plan_device)
    return Case(layout, pool, layer, plan, q, k, v, full_k, full_v)


def dense_attention(case: Case, *, sm_scale: float, window_left: int) -> torch.Tensor:
    """float64 attention from the per-request dense K/V, the mask built by broadcasting positions."""
    hq, hkv = case.q.shape[1], case.k.shape[1]
    group = hq // hkv
    rows = []
    at = 0
    for fk, fv, seq in zip(case.full_k, case.full_v, case.plan.seq_lens):
        kv_len = fk.shape[0]
        q = case.q[at: at + seq].double().cpu()  # [seq, hq, d]
        at += seq
        keys = fk.double().cpu().repeat_interleave(group, dim=1)  # [kv, hq, d]
        vals = fv.double().cpu().repeat_interleave(group, dim=1)
        q_pos = torch.arange(kv_len - seq, kv_len)[:, None]  # [seq, 1]: bottom-right aligned
        key = torch.arange(kv_len)[None, :]  # [1, kv]
        mask = (key <= q_pos) & ((q_pos - key <= window_left) | (window_left == -1))
        logits = torch.einsum("shd,khd->hsk", q, keys) * sm_scale
        logits = logits.masked_fill(~mask, float("-inf"))
        rows.append(torch.einsum("hsk,khd->shd", torch.softmax(logits, dim=-1), vals))
    return torch.cat(rows) if rows else case.q.new_zeros((0, hq, case.q.shape[2]), dtype=torch.float64)
