"""PrefillPagedPlan: the host-side plan every prefill launch and pool write is driven by.

A plan is built from per-request lists (FlashInfer's vocabulary) and holds int32 arrays:
``page_indices`` (CSR values), ``page_indptr`` [batch+1], ``last_page_len`` [batch], ``qo_indptr`` [batch+1],
``request_indices`` and ``qo_tile_indices`` [num_tiles]. Rules (DESIGN §4): the head relation is settled before
anything divides by ``num_kv_heads``; a request's pages cover exactly its KV; no page id repeats inside a request;
every value reaching int32 goes through ``checked_i32``; the recorded ``max_page_index`` / ``max_last_page_len``
are compared with the pool before every launch; ``update`` validates everything before it commits anything.

All arrays live in one int32 host buffer laid out at capacity; a device mirror of the same layout is uploaded
once per update and keeps its address across updates (CUDA-graph replay reads it in place). The last three
entries of the buffer are the scalars ``{batch_size, total_tokens, num_tiles}`` so kernels gridded over the
capacity can find the live sizes on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .errors import PagedWindowError, checked_i32

SUPPORTED_CTA_TILE_Q = (16, 64, 128)
"""Query tiles (packed GQA rows per CTA) the head_dim-256 kernels are built for; the default rule uses 16 and 64."""

_SEGMENTS = ("page_indices", "page_indptr", "last_page_len", "qo_indptr", "request_indices", "qo_tile_indices",
             "scalars")


def default_cta_tile_q(total_tokens: int, group: int) -> int:
    """Tile rule for head_dim 256 over the whole batch: 16 packed rows when they all fit in one, else 64."""
    return 16 if total_tokens * group <= 16 else 64


def check_head_relation(num_qo_heads, num_kv_heads) -> int:
    """Settle the GQA relation before anything divides by ``num_kv_heads``; returns the group size."""
    num_qo_heads = checked_i32("num_qo_heads", num_qo_heads, minimum=1)
    num_kv_heads = checked_i32("num_kv_heads", num_kv_heads, minimum=1)
    if num_qo_heads % num_kv_heads != 0:
        raise PagedWindowError(
            f"num_qo_heads = {num_qo_heads} is not a multiple of num_kv_heads = {num_kv_heads}"
        )
    return num_qo_heads // num_kv_heads


class PlanArrays(NamedTuple):
    """Views of a plan buffer (host or device) at capacity, in kernel-argument order."""

    page_indices: torch.Tensor  # [max_total_pages] int32
    page_indptr: torch.Tensor  # [max_batch + 1] int32
    last_page_len: torch.Tensor  # [max_batch] int32
    qo_indptr: torch.Tensor  # [max_batch + 1] int32
    request_indices: torch.Tensor  # [max_tiles] int32
    qo_tile_indices: torch.Tensor  # [max_tiles] int32
    scalars: torch.Tensor  # [3] int32: batch_size, total_tokens, num_tiles


@dataclass(frozen=True)
class PlanCapacity:
    max_total_tokens: int
    max_total_pages: int
    max_batch: int
    max_tiles: int

    def segment_sizes(self) -> tuple[int, ...]:
        b = self.max_batch
        return (self.max_total_pages, b + 1, b, b + 1, self.max_tiles, self.max_tiles, 3)


@dataclass(frozen=True)
class _Layout:
    """Everything one plan state holds; computed and checked in full before a plan commits it."""

    pages: tuple[tuple[int, ...], ...]
    last_page_lens: tuple[int, ...]
    start_positions: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    cta_tile_q: int
    page_indptr: tuple[int, ...]
    qo_indptr: tuple[int, ...]
    request_indices: tuple[int, ...]
    qo_tile_indices: tuple[int, ...]
    max_page_index: int
    max_last_page_len: int
    new_slot_collision: str | None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def total_tokens(self) -> int:
        return self.qo_indptr[-1]

    @property
    def total_pages(self) -> int:
        return self.page_indptr[-1]

    @property
    def num_tiles(self) -> int:
        return len(self.request_indices)


def _as_int_list(what: str, values) -> list:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise PagedWindowError(f"{what} must be one-dimensional, got shape {tuple(values.shape)}")
        return values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise PagedWindowError(f"{what} must be a sequence of integers, got {type(values).__name__}")
    return list(values)


def _record_new_slots(new_slots: dict, request: int, pages: list, start: int, kv_len: int,
                      page_size: int) -> str | None:
    """Record the slot ranges request ``request`` writes (positions start..kv_len-1); describe the first clash."""
    for index in range(start // page_size, -(-kv_len // page_size)):
        lo = max(start, index * page_size) - index * page_size
        hi = min(kv_len, (index + 1) * page_size) - index * page_size
        page = pages[index]
        for other_lo, other_hi, other in new_slots.get(page, ()):
            if lo < other_hi and other_lo < hi:
                return f"requests {other} and {request} both write page {page} slot {max(lo, other_lo)}"
        new_slots.setdefault(page, []).append((lo, hi, request))
    return None


def _compute_layout(page_indices, last_page_lens, start_positions, seq_lens, *, num_qo_heads, num_kv_heads,
                    head_dim, page_size, cta_tile_q) -> _Layout:
    group = check_head_relation(num_qo_heads, num_kv_heads)
    num_qo_heads, num_kv_heads = int(num_qo_heads), int(num_kv_heads)
    head_dim = checked_i32("head_dim", head_dim, minimum=1)
    page_size = checked_i32("page_size", page_size, minimum=1)

    pages_in = _as_int_list("page_indices", page_indices)
    lasts = _as_int_list("last_page_lens", last_page_lens)
    starts = _as_int_list("start_positions", start_positions)
    seqs = _as_int_list("seq_lens", seq_lens)
    batch = len(seqs)
    if batch == 0:
        raise PagedWindowError("a plan needs at least one request; seq_lens is empty")
    for name, values in (("page_indices", pages_in), ("last_page_lens", lasts), ("start_positions", starts)):
        if len(values) != batch:
            raise PagedWindowError(f"{name} has {len(values)} entries but seq_lens has {batch} (one per request)")
    checked_i32("batch_size", batch)

    pages: list[tuple[int, ...]] = []
    page_indptr, qo_indptr = [0], [0]
    max_page_index, max_last = -1, 0
    new_slots: dict[int, list[tuple[int, int, int]]] = {}  # page id -> [(first slot, end slot, request)]
    collision = None
    for i in range(batch):
        seq = checked_i32(f"seq_lens[{i}]", seqs[i], minimum=0)
        start = checked_i32(f"start_positions[{i}]", starts[i], minimum=0)
        kv_len = checked_i32(f"kv_len of request {i} (start {start} + seq {seq})", start + seq)
        req_pages = [checked_i32(f"page_indices[{i}][{j}]", p, minimum=0)
                     for j, p in enumerate(_as_int_list(f"page_indices[{i}]", pages_in[i]))]
        if not req_pages:
            raise PagedWindowError(f"page_indices[{i}] is empty; every request needs at least one page")
        if kv_len == 0:
            raise PagedWindowError(f"request {i} has kv_len 0 (start 0 + seq 0) but {len(req_pages)} pages")
        need = -(-kv_len // page_size)
        if len(req_pages) != need:
            raise PagedWindowError(
                f"request {i}: {len(req_pages)} pages do not cover kv_len {kv_len} at page_size {page_size} "
                f"(needs exactly {need})"
            )
        last = checked_i32(f"last_page_lens[{i}]", lasts[i])
        want_last = kv_len - (need - 1) * page_size
        if last != want_last:
            raise PagedWindowError(
                f"last_page_lens[{i}] = {last} disagrees with kv_len {kv_len}: the last page holds {want_last} "
                f"(bound 1..{page_size})"
            )
        if len(set(req_pages)) != len(req_pages):
            dup = next(p for p in req_pages if req_pages.count(p) > 1)
            raise PagedWindowError(f"page id {dup} appears more than once in page_indices[{i}]")
        if collision is None:
            collision = _record_new_slots(new_slots, i, req_pages, start, kv_len, page_size)
        pages.append(tuple(req_pages))
        page_indptr.append(checked_i32("page_indptr entry", page_indptr[-1] + need))
        qo_indptr.append(checked_i32("qo_indptr entry (total_tokens)", qo_indptr[-1] + seq))
        max_page_index = max(max_page_index, max(req_pages))
        max_last = max(max_last, last)

    total_tokens = qo_indptr[-1]
    checked_i32("packed rows (total_tokens * group)", total_tokens * group)
    if cta_tile_q is None:
        cta_tile_q = default_cta_tile_q(total_tokens, group)
    else:
        cta_tile_q = checked_i32("cta_tile_q", cta_tile_q)
        if cta_tile_q not in SUPPORTED_CTA_TILE_Q:
            raise PagedWindowError(f"cta_tile_q = {cta_tile_q} is not a supported tile {SUPPORTED_CTA_TILE_Q}")
    request_indices, qo_tile_indices = [], []
    for i, seq in enumerate(qo_indptr[1 + k] - qo_indptr[k] for k in range(batch)):
        n = -(-(seq * group) // cta_tile_q)
        request_indices.extend([i] * n)
        qo_tile_indices.extend(range(n))
    checked_i32("num_tiles", len(request_indices))

    return _Layout(
        pages=tuple(pages), last_page_lens=tuple(int(x) for x in lasts), start_positions=tuple(int(x) for x in starts),
        seq_lens=tuple(int(x) for x in seqs), num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, page_size=page_size, cta_tile_q=cta_tile_q, page_indptr=tuple(page_indptr),
        qo_indptr=tuple(qo_indptr), request_indices=tuple(request_indices), qo_tile_indices=tuple(qo_tile_indices),
        max_page_index=max_page_index, max_last_page_len=max_last, new_slot_collision=collision,
    )


class PrefillPagedPlan:
    """Host plan for a batch of paged prefill (or decode) requests; see the module docstring for the rules.

    Build with :meth:`batch` / :meth:`single`, or :meth:`preallocated` then :meth:`update`. Host arrays are
    exposed trimmed to their live sizes (``plan.page_indices`` ...); :meth:`device_arrays` gives the
    capacity-sized device mirror kernels read.
    """

    def __init__(self, capacity: PlanCapacity, device=None):
        self.capacity = capacity
        sizes = capacity.segment_sizes()
        total = checked_i32("plan buffer length", sum(sizes))
        self._host = torch.zeros(total, dtype=torch.int32)
        self._layout: _Layout | None = None
        self._version = 0
        self._mirrors: dict[torch.device, tuple[torch.Tensor, int]] = {}
        if device is not None:
            self._mirror(torch.device(device))

    # -- constructors -------------------------------------------------------------------------------------------
    @classmethod
    def batch(cls, page_indices, last_page_lens, start_positions, seq_lens, *, num_qo_heads, num_kv_heads,
              head_dim, page_size, cta_tile_q=None, device=None) -> PrefillPagedPlan:
        """A plan sized exactly for these requests. ``page_indices[i]`` covers ``start_i + seq_i`` keys."""
        layout = _compute_layout(page_indices, last_page_lens, start_positions, seq_lens, num_qo_heads=num_qo_heads,
                                 num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                                 cta_tile_q=cta_tile_q)
        capacity = PlanCapacity(max(layout.total_tokens, 1), layout.total_pages, layout.batch_size,
                                max(layout.num_tiles, 1))
        plan = cls(capacity)
        plan._commit(layout)
        if device is not None:
            plan._mirror(torch.device(device))
        return plan

    @classmethod
    def single(cls, pages, last_page_len, start_position, seq_len, **kwargs) -> PrefillPagedPlan:
        """A batch of one request."""
        return cls.batch([pages], [last_page_len], [start_position], [seq_len], **kwargs)

    @classmethod
    def preallocated(cls, *, max_total_tokens, max_total_pages, max_batch, max_tiles, device=None):
        """An empty plan with fixed capacity; fill it with :meth:`update`. Device arrays never move."""
        capacity = PlanCapacity(
            checked_i32("max_total_tokens", max_total_tokens, minimum=1),
            checked_i32("max_total_pages", max_total_pages, minimum=1),
            checked_i32("max_batch", max_batch, minimum=1),
            checked_i32("max_tiles", max_tiles, minimum=1),
        )
        return cls(capacity, device=device)

    def update(self, page_indices, last_page_lens, start_positions, seq_lens, *, num_qo_heads, num_kv_heads,
               head_dim, page_size, cta_tile_q=None) -> PrefillPagedPlan:
        """Re-plan in place: validate everything (capacity included), then commit. On error nothing changes."""
        layout = _compute_layout(page_indices, last_page_lens, start_positions, seq_lens, num_qo_heads=num_qo_heads,
                                 num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                                 cta_tile_q=cta_tile_q)
        cap = self.capacity
        for name, value, bound in (("total_tokens", layout.total_tokens, cap.max_total_tokens),
                                   ("total_pages", layout.total_pages, cap.max_total_pages),
                                   ("batch_size", layout.batch_size, cap.max_batch),
                                   ("num_tiles", layout.num_tiles, cap.max_tiles)):
            if value > bound:
                raise PagedWindowError(f"update: {name} = {value} exceeds the plan's capacity {bound}")
        self._commit(layout)
        return self

    # -- state --------------------------------------------------------------------------------------------------
    def _commit(self, layout: _Layout) -> None:
        host = torch.zeros_like(self._host)
        views = self._views(host)
        flat_pages = [p for req in layout.pages for p in req]
        for view, values in ((views.page_indices, flat_pages), (views.page_indptr, layout.page_indptr),
                             (views.last_page_len, layout.last_page_lens), (views.qo_indptr, layout.qo_indptr),
                             (views.request_indices, layout.request_indices),
                             (views.qo_tile_indices, layout.qo_tile_indices),
                             (views.scalars, (layout.batch_size, layout.total_tokens, layout.num_tiles))):
            if values:
                view[: len(values)] = torch.tensor(values, dtype=torch.int32)
        self._host.copy_(host)
        self._layout = layout
        self._version += 1
        for device, (buffer, _) in list(self._mirrors.items()):
            buffer.copy_(self._host)  # in place: the device address never changes
            self._mirrors[device] = (buffer, self._version)

    def _views(self, buffer: torch.Tensor) -> PlanArrays:
        return PlanArrays(*torch.split(buffer, list(self.capacity.segment_sizes())))

    def _mirror(self, device: torch.device) -> torch.Tensor:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        entry = self._mirrors.get(device)
        if entry is None:
            buffer = self._host.to(device)
            self._mirrors[device] = (buffer, self._version)
            return buffer
        buffer, version = entry
        if version != self._version:
            buffer.copy_(self._host)
            self._mirrors[device] = (buffer, self._version)
        return buffer

    def device_buffer(self, device) -> torch.Tensor:
        """The whole int32 plan buffer on ``device`` (uploaded on first use and once per update; its address
        never changes). Segments, at capacity, follow ``capacity.segment_sizes()`` in :class:`PlanArrays` order."""
        device = torch.device(device)
        return self._host if device.type == "cpu" else self._mirror(device)

    def device_arrays(self, device) -> PlanArrays:
        """Capacity-sized views of :meth:`device_buffer`."""
        return self._views(self.device_buffer(device))

    @property
    def filled(self) -> bool:
        """False for a preallocated plan that was never updated."""
        return self._layout is not None

    def _require(self) -> _Layout:
        if self._layout is None:
            raise PagedWindowError("the plan was preallocated but never filled: call plan.update(...) first")
        return self._layout

    # -- fields (DESIGN §4 names) -------------------------------------------------------------------------------
    def _live(self, name: str, length: int) -> torch.Tensor:
        self._require()
        return getattr(self._views(self._host), name)[:length]

    @property
    def page_indices(self) -> torch.Tensor:
        return self._live("page_indices", self._require().total_pages)

    @property
    def page_indptr(self) -> torch.Tensor:
        return self._live("page_indptr", self._require().batch_size + 1)

    @property
    def last_page_len(self) -> torch.Tensor:
        return self._live("last_page_len", self._require().batch_size)

    @property
    def qo_indptr(self) -> torch.Tensor:
        return self._live("qo_indptr", self._require().batch_size + 1)

    @property
    def request_indices(self) -> torch.Tensor:
        return self._live("request_indices", self._require().num_tiles)

    @property
    def qo_tile_indices(self) -> torch.Tensor:
        return self._live("qo_tile_indices", self._require().num_tiles)

    batch_size = property(lambda self: self._require().batch_size)
    total_tokens = property(lambda self: self._require().total_tokens)
    total_pages = property(lambda self: self._require().total_pages)
    num_tiles = property(lambda self: self._require().num_tiles)
    cta_tile_q = property(lambda self: self._require().cta_tile_q)
    head_dim = property(lambda self: self._require().head_dim)
    num_qo_heads = property(lambda self: self._require().num_qo_heads)
    num_kv_heads = property(lambda self: self._require().num_kv_heads)
    page_size = property(lambda self: self._require().page_size)
    max_page_index = property(lambda self: self._require().max_page_index)
    max_last_page_len = property(lambda self: self._require().max_last_page_len)
    seq_lens = property(lambda self: self._require().seq_lens)
    start_positions = property(lambda self: self._require().start_positions)
    pages = property(lambda self: self._require().pages)
    new_slot_collision = property(lambda self: self._require().new_slot_collision)

    @property
    def group_size(self) -> int:
        layout = self._require()
        return layout.num_qo_heads // layout.num_kv_heads

    @property
    def kv_lens(self) -> tuple[int, ...]:
        layout = self._require()
        return tuple(s + q for s, q in zip(layout.start_positions, layout.seq_lens))

    # -- printing and round trips -------------------------------------------------------------------------------
    def __repr__(self) -> str:
        cap = self.capacity
        capacity = (f"capacity(tokens={cap.max_total_tokens}, pages={cap.max_total_pages}, "
                    f"batch={cap.max_batch}, tiles={cap.max_tiles})")
        if self._layout is None:
            return f"PrefillPagedPlan(unfilled, {capacity})"
        p = self._layout
        return (f"PrefillPagedPlan(batch={p.batch_size}, total_tokens={p.total_tokens}, "
                f"pages={p.total_pages}, tiles={p.num_tiles}, cta_tile_q={p.cta_tile_q}, "
                f"heads={p.num_qo_heads}/{p.num_kv_heads}, head_dim={p.head_dim}, page_size={p.page_size}, "
                f"max_page_index={p.max_page_index}, max_last_page_len={p.max_last_page_len}, {capacity})")

    def describe(self) -> str:
        """A multi-line summary: the plan and one line per request (start, seq, kv_len, pages, tiles)."""
        lines = [repr(self)]
        if self._layout is None:
            return lines[0]
        p = self._layout
        tiles = [0] * p.batch_size
        for r in p.request_indices:
            tiles[r] += 1
        header = ("req", 4), ("start", 7), ("seq", 6), ("kv_len", 7), ("pages", 6), ("last", 5), ("tiles", 6)
        lines.append(" ".join(f"{name:>{width}}" for name, width in header) + "  page ids")
        for i in range(p.batch_size):
            ids = p.pages[i]
            shown = " ".join(map(str, ids[:8])) + (" …" if len(ids) > 8 else "")
            lines.append(f"{i:>4} {p.start_positions[i]:>7} {p.seq_lens[i]:>6} "
                         f"{p.start_positions[i] + p.seq_lens[i]:>7} {len(ids):>6} {p.last_page_lens[i]:>5} "
                         f"{tiles[i]:>6}  {shown}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """A JSON-ready dict: capacity, the requests, and the derived arrays (for diffing)."""
        cap = self.capacity
        data = {"capacity": {"max_total_tokens": cap.max_total_tokens, "max_total_pages": cap.max_total_pages,
                             "max_batch": cap.max_batch, "max_tiles": cap.max_tiles}}
        if self._layout is None:
            return data
        p = self._layout
        data.update({
            "num_qo_heads": p.num_qo_heads, "num_kv_heads": p.num_kv_heads, "head_dim": p.head_dim,
            "page_size": p.page_size, "cta_tile_q": p.cta_tile_q,
            "page_indices": [list(x) for x in p.pages], "last_page_lens": list(p.last_page_lens),
            "start_positions": list(p.start_positions), "seq_lens": list(p.seq_lens),
            "derived": {"page_indptr": list(p.page_indptr), "qo_indptr": list(p.qo_indptr),
                        "request_indices": list(p.request_indices), "qo_tile_indices": list(p.qo_tile_indices),
                        "max_page_index": p.max_page_index, "max_last_page_len": p.max_last_page_len},
        })
        return data

    @classmethod
    def from_dict(cls, data: dict, *, device=None) -> PrefillPagedPlan:
        """Rebuild (and re-validate) a plan from :meth:`to_dict`; derived arrays, if present, must agree."""
        plan = cls.preallocated(**data["capacity"], device=device)
        if "seq_lens" not in data:
            return plan
        plan.update(data["page_indices"], data["last_page_lens"], data["start_positions"], data["seq_lens"],
                    num_qo_heads=data["num_qo_heads"], num_kv_heads=data["num_kv_heads"],
                    head_dim=data["head_dim"], page_size=data["page_size"], cta_tile_q=data["cta_tile_q"])
        derived = data.get("derived")
        if derived is not None and derived != plan.to_dict()["derived"]:
            raise PagedWindowError("from_dict: the recorded derived arrays disagree with the rebuilt plan")
        return plan

    def __eq__(self, other) -> bool:
        return isinstance(other, PrefillPagedPlan) and self.to_dict() == other.to_dict()

    __hash__ = None  # mutable (update)

