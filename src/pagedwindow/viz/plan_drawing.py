"""Draw a plan: the mask of each request (which keys each query sees, pages, the window), the plan's tiles
(packed rows per tile, pages each tile reads and skips) and a per-tile error map."""

from __future__ import annotations

import math

import torch
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from ..measure.plan_geometry import TileSpan, tile_spans, visibility
from ..plan import PrefillPagedPlan
from .figures import error_log_range, new_figure, plt, zero_floor

MASK_COLORS = ListedColormap(["#ffffff", "#9ecae1", "#08519c"])  # hidden, visible cached key, visible new key
TILE_COLORS = ListedColormap(["#ffffff", "#d9d9d9", "#31a354", "#fcbba1"])  # no page, left, read, right
MAX_MASK_PIXELS = 1024  # a mask is subsampled to at most this many rows and columns


def _label_pages(ax, pages, page_size: int, kv_len: int, step: int) -> None:
    """Page boundaries as dotted vertical lines (at most ~64) and page ids along the top (at most ~12)."""
    line_every = max(1, math.ceil(len(pages) / 64))
    for p in range(line_every, len(pages), line_every):
        ax.axvline((p * page_size - 0.5) / step, color="#636363", lw=0.6, ls=":")
    label_every = max(1, math.ceil(len(pages) / 12))
    shown = range(0, len(pages), label_every)
    top = ax.secondary_xaxis("top")
    top.set_xticks([(min(p * page_size + page_size / 2, kv_len) - 0.5) / step for p in shown])
    top.set_xticklabels([str(pages[p]) for p in shown], fontsize=7)
    top.set_xlabel(
        "page id"
        + (f" (1 in {label_every} shown; a boundary line every {line_every} pages)" if label_every > 1 else ""),
        fontsize=8,
    )


def draw_mask(plan: PrefillPagedPlan, window_left: int, request: int = 0, ax=None):
    """Which keys each query of ``request`` sees: cached keys (start_i before this step) light, new keys dark;
    page boundaries dotted with page ids on top; the window's left edge and the diagonal in red."""
    if ax is None:
        _, (ax,) = new_figure(width=6.5, height=4.5)
    start, seq = plan.start_positions[request], plan.seq_lens[request]
    kv_len = start + seq
    step = max(1, math.ceil(max(seq, kv_len) / MAX_MASK_PIXELS))
    if seq == 0:
        ax.text(
            0.5, 0.5, f"request {request}: no new rows (seq_len 0)", ha="center", va="center", transform=ax.transAxes
        )
        ax.set_axis_off()
        return ax
    vis = visibility(start, seq, window_left)[::step, ::step]  # [rows, keys] (subsampled)
    new_key = (torch.arange(kv_len)[::step] >= start)[None, :]
    codes = vis.to(torch.int8) * (1 + new_key.to(torch.int8))
    ax.imshow(
        codes.numpy(),
        cmap=MASK_COLORS,
        vmin=0,
        vmax=2,
        aspect="auto",
        interpolation="nearest",
        extent=(-0.5, codes.shape[1] - 0.5, codes.shape[0] - 0.5, -0.5),
    )
    _label_pages(ax, plan.pages[request], plan.page_size, kv_len, step)
    rows = torch.arange(seq)
    ax.plot((start + rows) / step, rows / step, color="#cb181d", lw=0.8, label="diagonal k = q")
    if window_left >= 0:
        ax.plot(
            (start + rows - window_left - 0.5) / step,
            rows / step,
            color="#cb181d",
            lw=1.2,
            ls="--",
            label=f"window edge k = q − {window_left}",
        )
    if start > 0:
        ax.axvline((start - 0.5) / step, color="#08519c", lw=1.0, label=f"cached | new (start {start})")
    ax.set_xlim(-0.5, codes.shape[1] - 0.5)
    if codes.shape[0] <= 8:
        ax.set_yticks(range(codes.shape[0]))
    else:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("key position" + (f" (every {step})" if step > 1 else ""))
    ax.set_ylabel(f"query row (position − {start})" + (f", every {step}" if step > 1 else ""))
    ax.set_title(f"request {request}: start {start}, seq {seq}, kv_len {kv_len}, window_left {window_left}", fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    return ax


MASK_COLUMNS = 2  # the masks are drawn in a grid this many panels wide


def draw_masks(plan: PrefillPagedPlan, window_left: int, *, max_requests: int = 4):
    """:func:`draw_mask` for the first ``max_requests`` requests in a grid :data:`MASK_COLUMNS` panels wide
    (four requests: 2 × 2), each panel large enough to read in an HTML page. Returns the figure."""
    n = max(1, min(plan.batch_size, max_requests))
    ncols = min(n, MASK_COLUMNS)
    fig, axes = new_figure(ncols=ncols, nrows=math.ceil(n / ncols), width=6.0, height=4.6)
    for r, ax in enumerate(axes):
        if r < n:
            draw_mask(plan, window_left, r, ax)
        else:
            ax.set_axis_off()
    fig.tight_layout()
    return fig


def draw_tiles(plan: PrefillPagedPlan, window_left: int, spans: list[TileSpan] | None = None):
    """One row per tile, one column per page slot of its request: pages read (green), skipped left of the window
    (grey) and right of the tile's last row (red). Row labels give the tile's request and packed rows."""
    spans = tile_spans(plan, window_left) if spans is None else spans
    width = max((len(p) for p in plan.pages), default=1)
    grid = torch.zeros(max(len(spans), 1), width, dtype=torch.int8)
    for s in spans:
        n_pages = len(plan.pages[s.request])
        grid[s.tile, :n_pages] = 3
        grid[s.tile, : s.pages_read[0]] = 1
        grid[s.tile, s.pages_read[0] : s.pages_read[1]] = 2
    fig, (ax,) = new_figure(width=min(14.0, 3.0 + 0.35 * width), height=min(12.0, 1.2 + 0.32 * len(spans)))
    ax.imshow(grid.numpy(), cmap=TILE_COLORS, vmin=0, vmax=3, aspect="auto", interpolation="nearest")
    annotate = width <= 40 and len(spans) <= 48
    if annotate:
        for s in spans:
            for slot in range(len(plan.pages[s.request])):
                ax.text(slot, s.tile, str(plan.pages[s.request][slot]), ha="center", va="center", fontsize=6)
    labelled = spans[:: max(1, math.ceil(len(spans) / 48))]
    ax.set_yticks([s.tile for s in labelled])
    ax.set_yticklabels(
        [
            f"r{s.request} t{s.qo_tile}: rows {s.packed_rows[0]}–{s.packed_rows[1] - 1} ({s.num_packed_rows})"
            for s in labelled
        ],
        fontsize=7,
    )
    for a, b in zip(spans, spans[1:]):
        if a.request != b.request:
            ax.axhline(b.tile - 0.5, color="black", lw=1.2)
    ax.set_xlabel("page slot in the request" + (" (cell text: page id)" if annotate else ""))
    ax.set_title(
        f"{len(spans)} tiles of {plan.cta_tile_q} packed rows (group {plan.group_size}); window_left {window_left}",
        fontsize=9,
    )
    ax.legend(
        handles=[
            Patch(color=TILE_COLORS(2), label="read"),
            Patch(color=TILE_COLORS(1), label="skipped: left of the window"),
            Patch(color=TILE_COLORS(3), label="skipped: right of the last row"),
        ],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
    )
    fig.tight_layout()
    return fig


def draw_tile_errors(
    tile_err: torch.Tensor,
    spans: list[TileSpan],
    packed_err: list[torch.Tensor],
    *,
    limit: float | None = None,
    label: str = "max |ours − fp64|",
    dtype: torch.dtype = torch.bfloat16,
):
    """Left: ``tile_err [num_tiles, num_kv_heads]`` as a heatmap on a fixed log scale anchored at the eps of
    ``dtype`` (:func:`figures.error_log_range`, widened upwards only), so one ulp is a small step. Right: the error
    of every packed row (``packed_err``: per request ``[num_kv_heads, packed rows]``), as points (rows are
    separate outputs), requests one after another, tile boundaries dotted, request boundaries solid, the gate's
    ``limit`` dashed. Exact zeros are drawn at least a decade below the smallest non-zero error, as the axis says."""
    fig, (left, right) = new_figure(ncols=2, width=6.0, height=max(3.2, min(9.0, 0.9 + 0.25 * len(spans))))
    if not spans:
        for ax in (left, right):
            ax.text(0.5, 0.5, "no tiles: no request has new rows", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
        return fig
    lo, hi = error_log_range(dtype)
    finite = tile_err.double()[torch.isfinite(tile_err.double()) & (tile_err.double() > 0)]
    if finite.numel():
        hi = max(hi, math.ceil(10 * math.log10(float(finite.max()))) / 10)
    log_err = torch.log10(tile_err.double().nan_to_num(nan=10.0**hi, posinf=10.0**hi).clamp(10.0**lo, 10.0**hi))
    im = left.imshow(log_err.numpy(), aspect="auto", cmap="viridis", interpolation="nearest", vmin=lo, vmax=hi)
    fig.colorbar(
        im,
        ax=left,
        label=f"log10 {label}\n(fixed scale for {str(dtype).removeprefix('torch.')}, eps {torch.finfo(dtype).eps:.1e})",
    )
    left.set_xticks(range(tile_err.shape[1]))
    left.set_xlabel("KV head")
    left.set_ylabel("tile")
    left.set_yticks(range(len(spans)))
    left.set_yticklabels([f"r{s.request} t{s.qo_tile}" for s in spans], fontsize=7)
    left.set_title("per-tile error", fontsize=9)
    zero = zero_floor(*packed_err)
    offset = 0
    for r, err in enumerate(packed_err):
        rows = err.shape[1]
        x = torch.arange(offset, offset + rows)
        for h in range(err.shape[0]):
            right.plot(
                x.numpy(),
                err[h].double().clamp_min(zero).numpy(),
                ls="none",
                marker=".",
                ms=3,
                color=f"C{h}",
                label=f"kv head {h}" if r == 0 else None,
            )
        right.axvline(offset - 0.5, color="black", lw=1.0)
        offset += rows
    for s in spans:
        right.axvline(
            sum(e.shape[1] for e in packed_err[: s.request]) + s.packed_rows[0] - 0.5, color="grey", lw=0.5, ls=":"
        )
    if limit is not None:
        right.axhline(limit, color="#cb181d", ls="--", lw=1.0, label=f"gate {limit:.2g}")
    right.set_yscale("log")
    right.set_xlabel("packed row (requests in order; dotted: tile boundaries)")
    right.set_ylabel(f"{label} (exact 0 drawn at {zero:.0e})")
    right.legend(fontsize=7)
    right.set_title("per packed row", fontsize=9)
    fig.tight_layout()
    return fig


__all__ = ["draw_mask", "draw_masks", "draw_tile_errors", "draw_tiles", "plt"]
