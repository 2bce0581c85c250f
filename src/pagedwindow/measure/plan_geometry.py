"""What each tile of a ``PrefillPagedPlan`` covers, and which keys each query of a request sees.

A tile is one CTA's work: ``cta_tile_q`` packed GQA rows of one request (packed row ``r`` is token ``r // group``,
head-in-group ``r % group``; docs/design.md §2), for every KV head. Its rows sit at KV positions ``q_lo .. q_hi - 1``
(bottom-right alignment: token ``j`` of request ``i`` at ``start_i + j``), so the keys it needs are
``window_start(q_lo) .. q_hi - 1``: pages left of the window of its first row, and pages right of its last row
(causal), are never read. This is the semantic footprint; the kernel may read less (it skips masked KV blocks) but
never more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..plan import PrefillPagedPlan
from ..semantics import check_window_left, key_visible, window_start


@dataclass(frozen=True)
class TileSpan:
    """The footprint of one tile. Ranges are half-open ``(lo, hi)``; page slots index the request's page list."""

    tile: int
    request: int
    qo_tile: int
    packed_rows: tuple  # (lo, hi) packed GQA rows of the request
    tokens: tuple  # (lo, hi) query rows of the request covered by those packed rows
    q_positions: tuple  # (lo, hi) KV positions of those query rows
    keys: tuple  # (lo, hi) keys visible to at least one of the rows
    pages_read: tuple  # (lo, hi) page slots holding those keys
    page_ids_read: tuple  # the page ids of pages_read
    pages_skipped_left: int  # page slots wholly left of the window of the tile's first row
    pages_skipped_right: int  # page slots wholly right of the tile's last row (causal)

    @property
    def num_packed_rows(self) -> int:
        return self.packed_rows[1] - self.packed_rows[0]

    @property
    def num_pages_read(self) -> int:
        return self.pages_read[1] - self.pages_read[0]

    def as_row(self) -> dict:
        """A flat dict for a table."""
        return {
            "tile": self.tile,
            "request": self.request,
            "qo_tile": self.qo_tile,
            "packed_rows": f"{self.packed_rows[0]}–{self.packed_rows[1] - 1}",
            "tokens": f"{self.tokens[0]}–{self.tokens[1] - 1}",
            "q_positions": f"{self.q_positions[0]}–{self.q_positions[1] - 1}",
            "keys": f"{self.keys[0]}–{self.keys[1] - 1}",
            "pages_read": self.num_pages_read,
            "page_ids": " ".join(map(str, self.page_ids_read)),
            "skipped_left": self.pages_skipped_left,
            "skipped_right": self.pages_skipped_right,
        }


def tile_spans(plan: PrefillPagedPlan, window_left: int) -> list[TileSpan]:
    """One :class:`TileSpan` per tile of ``plan`` (in the plan's tile order) under ``window_left``."""
    window_left = check_window_left(window_left)
    group, tile_q, page_size = plan.group_size, plan.cta_tile_q, plan.page_size
    spans = []
    for t, (r, qt) in enumerate(zip(plan.request_indices.tolist(), plan.qo_tile_indices.tolist())):
        start, seq = plan.start_positions[r], plan.seq_lens[r]
        pages = plan.pages[r]
        row_lo, row_hi = qt * tile_q, min((qt + 1) * tile_q, seq * group)
        tok_lo, tok_hi = row_lo // group, (row_hi - 1) // group + 1
        q_lo, q_hi = start + tok_lo, start + tok_hi
        k_lo = window_start(q_lo, window_left)
        page_lo, page_hi = k_lo // page_size, (q_hi - 1) // page_size + 1
        spans.append(
            TileSpan(
                tile=t,
                request=r,
                qo_tile=qt,
                packed_rows=(row_lo, row_hi),
                tokens=(tok_lo, tok_hi),
                q_positions=(q_lo, q_hi),
                keys=(k_lo, q_hi),
                pages_read=(page_lo, page_hi),
                page_ids_read=tuple(pages[page_lo:page_hi]),
                pages_skipped_left=page_lo,
                pages_skipped_right=len(pages) - page_hi,
            )
        )
    return spans


def visibility(start: int, seq: int, window_left: int) -> torch.Tensor:
    """Bool ``[seq, start + seq]``: query row ``j`` (at position ``start + j``) sees key ``k``."""
    window_left = check_window_left(window_left)
    q_pos = torch.arange(start, start + seq)[:, None]  # [seq, 1]
    k_pos = torch.arange(start + seq)[None, :]  # [1, kv_len]
    return key_visible(q_pos, k_pos, window_left)


def packed_row_values(values: torch.Tensor, plan: PrefillPagedPlan) -> list[torch.Tensor]:
    """Per request, ``values [total_tokens, num_qo_heads]`` rearranged to packed GQA rows
    ``[num_kv_heads, seq_i * group]`` (packed row ``r`` = token ``r // group``, head-in-group ``r % group``)."""
    hkv, group = plan.num_kv_heads, plan.group_size
    qo = plan.qo_indptr.tolist()
    out = []
    for r, seq in enumerate(plan.seq_lens):
        rows = values[qo[r] : qo[r] + seq].reshape(seq, hkv, group)  # [seq, hkv, group]
        out.append(rows.permute(1, 0, 2).reshape(hkv, seq * group))  # [hkv, seq * group]
    return out


def per_tile_max(values: torch.Tensor, plan: PrefillPagedPlan, spans: list[TileSpan]) -> torch.Tensor:
    """``values [total_tokens, num_qo_heads]`` reduced to ``[num_tiles, num_kv_heads]`` (max over each tile's
    packed rows)."""
    packed = packed_row_values(values, plan)
    out = torch.zeros(len(spans), plan.num_kv_heads, dtype=values.dtype)
    for s in spans:
        out[s.tile] = packed[s.request][:, s.packed_rows[0] : s.packed_rows[1]].amax(dim=1).cpu()
    return out
