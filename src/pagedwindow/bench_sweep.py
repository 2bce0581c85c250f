"""The bench's sweep: slices of the shape space around the Gemma-4 local layer, and each point's speed-up over
FlashInfer's best.

A slice varies two things and holds the rest at the base point (page 16, window 1023, Hq 16 / Hkv 8 / head_dim
256); every request of a point has the same new tokens and cached prefix. The slices together cover batch size
1-512, new tokens per request 1-32 k, cached prefix 0-128 k, page sizes 1-128 and windows 0 / 255 / 1023 /
none. ``pagedwindow bench --sweep`` times every point (the paged kernels only: pagedwindow, FlashInfer fa2 and fa3);
``--decode-sweep`` the decode slices alone. A point's speed-up is FlashInfer's best kernel time (the faster of fa2
and fa3) over ours: below 1 we are slower there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .measure.bench_results import FLASHINFER_SYSTEMS

BASE_PAGE_SIZE, BASE_WINDOW = 16, 1023

MAX_SWEEP_TOKENS = 1 << 17
"""New tokens of one point at most (q and out of 131 072 rows: 1 GiB each at Hq 16)."""
MAX_SWEEP_KEYS = 1 << 21
"""Keys of one point at most (16 GiB of bf16 K/V at Hkv 8): the bench holds its input sets and FlashInfer's
contiguous K and V copies of each, so larger batches do not fit on an H200."""


@dataclass(frozen=True)
class SweepPoint:
    """One point: ``batch`` requests of ``new_tokens`` new tokens on ``cached`` cached keys each; its place in its
    slice is ``(x, y)`` (values of the slice's two axes)."""

    slice: str
    batch: int
    new_tokens: int
    cached: int
    page_size: int = BASE_PAGE_SIZE
    window_left: int = BASE_WINDOW
    x: int | str = 0
    y: int | str = 0

    @property
    def name(self) -> str:
        if self.slice.startswith("decode"):  # the decode slices' names, as recorded since they were first timed
            return f"decode_b{self.batch}_kv{self.cached + 1}_w{self.window_left}"
        return (
            f"sweep_{self.slice}_b{self.batch}_n{self.new_tokens}_c{self.cached}_p{self.page_size}_w{self.window_left}"
        )

    def fits(self) -> bool:
        return (
            self.batch * self.new_tokens <= MAX_SWEEP_TOKENS
            and self.batch * (self.cached + self.new_tokens) <= MAX_SWEEP_KEYS
        )


@dataclass(frozen=True)
class SweepSlice:
    name: str
    x: str  # axis names (viz.bench_plots.AXIS_LABELS labels them)
    y: str
    points: tuple[SweepPoint, ...]


DECODE_BATCHES = (1, 16, 64, 256, 512)
DECODE_KV_LENS = (1, 1024, 4096, 32768, 131072)

# Named batch shapes of the page-size slice: (requests, new tokens, cached keys).
PAGE_SHAPES = {
    "decode 64x4096": (64, 1, 4095),
    "chunk 512 on 30000": (1, 512, 30000),
    # keys ending one short of a 64-key tile (30 527): at every page size the last page-sized chunk is partial
    "chunk 512 on 30015": (1, 512, 30015),
    "prefill 1x8192": (1, 8192, 0),
    "prompts 32x128": (32, 128, 0),
}


def _grid(name: str, x: str, y: str, xs, ys, make) -> SweepSlice:
    points = tuple(p for yv in ys for xv in xs if (p := make(xv, yv)).fits())
    return SweepSlice(name, x, y, points)


def _decode_slice(window_left: int) -> SweepSlice:
    name = f"decode_w{window_left}"
    return _grid(
        name,
        "kv_len",
        "batch",
        DECODE_KV_LENS,
        DECODE_BATCHES,
        lambda kv, b: SweepPoint(name, b, 1, kv - 1, window_left=window_left, x=kv, y=b),
    )


def _page_point(page: int, shape: str) -> SweepPoint:
    batch, new, cached = PAGE_SHAPES[shape]
    return SweepPoint("page_x_shape", batch, new, cached, page_size=page, x=page, y=shape)


def sweep_slices(*, decode_only: bool = False) -> list[SweepSlice]:
    """Every slice of ``--sweep`` (the decode slices alone with ``decode_only``), points that do not fit the
    bounds (``MAX_SWEEP_TOKENS``, ``MAX_SWEEP_KEYS``) left out."""
    decode = [_decode_slice(1023), _decode_slice(-1)]
    if decode_only:
        return decode
    return [
        _grid(
            "batch_x_new",
            "new_tokens",
            "batch",
            (1, 16, 128, 1024, 4096, 32768),
            (1, 4, 16, 64, 256, 512),
            lambda n, b: SweepPoint("batch_x_new", b, n, 0, x=n, y=b),
        ),
        _grid(
            "cached_x_new",
            "new_tokens",
            "cached",
            (1, 128, 1024, 8192, 32768),
            (0, 1024, 8192, 32768, 131072),
            lambda n, c: SweepPoint("cached_x_new", 1, n, c, x=n, y=c),
        ),
        _grid(
            "window_x_cached",
            "cached",
            "window_left",
            (0, 4096, 32768, 131072),
            (0, 255, 1023, -1),
            lambda c, w: SweepPoint("window_x_cached", 1, 1024, c, window_left=w, x=c, y=w),
        ),
        _grid("page_x_shape", "page_size", "shape", (1, 16, 32, 64, 128), tuple(PAGE_SHAPES), _page_point),
        *decode,
    ]


POINT_NAME_FORMS = ("decode_b<batch>_kv<keys>_w<window>", "sweep_<slice>_b<batch>_n<new>_c<cached>_p<page>_w<window>")
"""The forms of the names :func:`point_named` takes, for messages that list them."""
_OFF_GRID_NAME = re.compile(r"sweep_([a-z_]+?)_b(\d+)_n(\d+)_c(\d+)_p(\d+)_w(-?\d+)")
_DECODE_NAME = re.compile(r"decode_b(\d+)_kv(\d+)_w(-?\d+)")


def point_named(name: str) -> SweepPoint | None:
    """The sweep point called ``name``: one of :func:`sweep_slices`' points, or a point off their grids named as
    theirs are, ``sweep_<slice>_b<batch>_n<new>_c<cached>_p<page size>_w<window>`` or, one new token per request
    on ``kv - 1`` cached keys at page 16, ``decode_b<batch>_kv<kv>_w<window>`` (a ``sweep_decode…`` name of such a
    point gives the point, whose own name is the latter). None for any other name, for a ``sweep_decode…`` name
    of another shape (the decode names could not say it), and for a named point out of bounds (no request, no new
    token, no key, page size 0, window below -1, or more than ``MAX_SWEEP_TOKENS`` / ``MAX_SWEEP_KEYS``)."""
    for sweep_slice in sweep_slices():
        for point in sweep_slice.points:
            if point.name == name:
                return point
    if match := _OFF_GRID_NAME.fullmatch(name):
        batch, new, cached, page_size, window = (int(match.group(i)) for i in range(2, 7))
        name_slice = f"decode_w{window}" if match.group(1).startswith("decode") else match.group(1)
        point = SweepPoint(name_slice, batch, new, cached, page_size, window)
    elif match := _DECODE_NAME.fullmatch(name):
        batch, kv, window = (int(g) for g in match.groups())
        point = SweepPoint(f"decode_w{window}", batch, 1, kv - 1, window_left=window)
    else:
        return None
    in_bounds = min(point.batch, point.new_tokens, point.page_size) >= 1 and point.cached >= 0
    # A decode slice's point is named by batch, keys and window alone: one new token at page 16, or it has no name.
    named = not point.slice.startswith("decode") or (point.new_tokens, point.page_size) == (1, BASE_PAGE_SIZE)
    return point if in_bounds and named and point.window_left >= -1 and point.fits() else None


def sweep_summary(records: list[dict], slices: list[SweepSlice]) -> list[dict]:
    """One row per point of ``slices`` that ``records`` hold: its slice, axes and coordinates, pagedwindow's kernel
    ms, FlashInfer's best kernel ms and which backend, and ``speedup`` = FlashInfer's best / ours (None where a
    time is missing)."""
    ms = {(r["workload"], r["system"]): r.get("ms") for r in records}
    run = {r["workload"] for r in records}
    rows = []
    for s in slices:
        for p in s.points:
            if p.name not in run:
                continue
            ours = ms.get((p.name, "pagedwindow"))
            peers = [(ms[(p.name, f)], f) for f in FLASHINFER_SYSTEMS if ms.get((p.name, f)) is not None]
            best_ms, best = min(peers) if peers else (None, None)
            rows.append(
                {
                    "workload": p.name,
                    "slice": s.name,
                    "x_axis": s.x,
                    "y_axis": s.y,
                    "x": p.x,
                    "y": p.y,
                    "batch": p.batch,
                    "new_tokens": p.new_tokens,
                    "cached": p.cached,
                    "page_size": p.page_size,
                    "window_left": p.window_left,
                    "pagedwindow_ms": ours,
                    "flashinfer_best_ms": best_ms,
                    "flashinfer_best": best,
                    "speedup": best_ms / ours if ours and best_ms else None,
                }
            )
    return rows


def slower_points(rows: list[dict]) -> list[dict]:
    """The rows where pagedwindow is slower than FlashInfer's best (speed-up below 1), slowest first."""
    return sorted((r for r in rows if r["speedup"] is not None and r["speedup"] < 1), key=lambda r: r["speedup"])
