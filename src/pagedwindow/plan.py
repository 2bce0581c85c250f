"""PrefillPagedPlan: the host-side plan every prefill launch and pool write is driven by.

A plan holds FlashInfer's CSR vocabulary as int32 arrays: ``page_indices`` (CSR values), ``page_indptr``
[batch+1], ``last_page_len`` [batch], ``qo_indptr`` [batch+1], and the tile list ``request_indices`` /
``qo_tile_indices`` [num_tiles]. Request ``i`` holds ``kv_len_i = (pages_i - 1) * page_size + last_page_len_i``
keys, ``seq_i`` of them new, starting at ``start_i = kv_len_i - seq_i`` (bottom-right alignment).

Rules, each checked with vectorised array operations (no Python loop over pages or tokens):

- the head relation is settled before anything divides by ``num_kv_heads``;
- a request's pages cover exactly its KV (``1 <= last_page_len <= page_size``; no empty page list);
- no page id repeats inside a request; a new row never lands in a slot another request of the plan writes or
  reads as cached prefix (requests may share read-only prefix pages);
- every value that reaches int32 is narrowed with a check (a value past int32 fails, never truncates);
- ``max_page_index`` / ``max_last_page_len`` are recorded for the wrappers to compare with the pool;
- a plan fixes its query tile when it is created (explicit, or ``tiles``' policy) and every update lays out
  with it: a CUDA graph captured a launch with that tile. An explicit different tile at update is refused;
- ``update`` / ``update_csr`` compute and check everything before they change anything;
- the tile list is longest first: tiles sorted by the end of their keys (one past the tile's last query position,
  under bottom-right alignment), largest first, ties in request order. The kernels take tiles in list order, so
  the longest start first and a launch's last wave is made of the shortest (the end of the keys orders tiles by
  their work with or without a window: under a window every tile past the window's length does the same work).

Two implementations of those checks accept exactly the same batches and build the same state: one compiled pass
(``pw_plan_pack`` in ``kernels/plan_pack.cpp``, from the kernels' library: it runs wherever that library is
loaded, or when the plan is for a CUDA device), and the vectorised numpy pass, which runs everywhere else and for
every batch the compiled pass hands back (a broken rule, which it names; page ids shared between requests, on
which it rules; ids too sparse for a table).

CSR tensors already on a GPU are checked where they are: the page-id part of the pass runs there as a kernel
(``pw_plan_check_pages``, ``kernels/plan_check.cu``: bounds, repeats, the largest id, a copy of the ids) while the
small arrays are copied to the host for the rest, with one synchronisation in all; the state keeps the ids on the
device and reads them back only when something on the host asks for them. Any finding of the device pass sends
the batch to the host's passes, which name the error or rule on shared pages, so all three accept the same
batches.

Device mirrors: a plan used on a GPU keeps one capacity-sized int32 buffer there whose address never changes
(CUDA-graph replay reads it in place). Each update writes the live parts into a pinned staging buffer and
copies them asynchronously on the current stream (one call, ``pw_plan_upload``, where the kernels' library is
loaded), normally in one copy (the batch-sized header, the tile list
and the live page ids): no host synchronisation, nothing of the page capacity beyond the live pages. Updates and
launches of one plan belong on one stream (the copies are ordered on it). Segment order in the buffer: ``scalars``
(``batch_size, total_tokens, num_tiles``) first, then ``page_indptr``, ``last_page_len``, ``qo_indptr``,
``request_indices``, ``qo_tile_indices``, ``page_indices``, each at capacity. A freed plan's mirrors go to a
pool that new plans on the same device and stream take from (``_MirrorPool``): building a plan every step
allocates nothing.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import itertools
import operator
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from .errors import INT32_MAX, NOT_INT_SEQUENCES, PagedWindowError, checked_i32, checked_i32_array, int_array
from .tiles import (
    SPLIT_KV_TILE,
    SPLIT_KV_UNITS_PER_SM,
    SUPPORTED_CTA_TILE_Q,
    device_traits,
    tile_for_batch,
    tile_for_capacity,
    tile_for_counts,
)

__all__ = [
    "PlanArrays",
    "PlanCapacity",
    "PrefillPagedPlan",
    "SUPPORTED_CTA_TILE_Q",
    "check_head_relation",
    "release_pooled_plan_buffers",
]

PLAN_BUFFER_MAX_ENTRIES = 1 << 28
"""A plan's device buffer holds at most 2**28 int32 entries (1 GiB); larger capacities are refused before
anything is allocated (``from_dict`` is a trust boundary)."""


def check_head_relation(num_qo_heads, num_kv_heads) -> int:
    """Settle the GQA relation before anything divides by ``num_kv_heads``; returns the group size."""
    num_qo_heads = checked_i32("num_qo_heads", num_qo_heads, minimum=1)
    num_kv_heads = checked_i32("num_kv_heads", num_kv_heads, minimum=1)
    if num_qo_heads % num_kv_heads != 0:
        raise PagedWindowError(f"num_qo_heads = {num_qo_heads} is not a multiple of num_kv_heads = {num_kv_heads}")
    return num_qo_heads // num_kv_heads


class PlanArrays(NamedTuple):
    """Views of a plan buffer at capacity, in buffer order."""

    scalars: torch.Tensor  # [3] int32: batch_size, total_tokens, num_tiles
    page_indptr: torch.Tensor  # [max_batch + 1] int32
    last_page_len: torch.Tensor  # [max_batch] int32
    qo_indptr: torch.Tensor  # [max_batch + 1] int32
    request_indices: torch.Tensor  # [max_tiles] int32
    qo_tile_indices: torch.Tensor  # [max_tiles] int32
    page_indices: torch.Tensor  # [max_total_pages] int32


@dataclass(frozen=True)
class PlanCapacity:
    """The most a plan can hold; its device buffer is sized by it."""

    max_total_tokens: int
    max_total_pages: int
    max_batch: int
    max_tiles: int

    def segment_sizes(self) -> tuple[int, ...]:
        """Entries of each :class:`PlanArrays` segment, in buffer order."""
        b = self.max_batch
        return (3, b + 1, b, b + 1, self.max_tiles, self.max_tiles, self.max_total_pages)

    def segment_offsets(self) -> tuple[int, ...]:
        """First entry of each :class:`PlanArrays` segment, in buffer order."""
        if torch.compiler.is_compiling():  # traced code computes the sums (dynamo warns on a cache wrapper)
            return _segment_offsets.__wrapped__(self)
        return _segment_offsets(self)

    @property
    def buffer_entries(self) -> int:
        """``sum(segment_sizes())``."""
        return 5 + 3 * self.max_batch + 2 * self.max_tiles + self.max_total_pages

    @staticmethod
    def checked(what: str, max_total_tokens, max_total_pages, max_batch, max_tiles) -> PlanCapacity:
        """A capacity whose every bound is a positive int32 and whose buffer fits ``PLAN_BUFFER_MAX_ENTRIES``."""
        cap = PlanCapacity(
            checked_i32(f"{what}max_total_tokens", max_total_tokens, minimum=1),
            checked_i32(f"{what}max_total_pages", max_total_pages, minimum=1),
            checked_i32(f"{what}max_batch", max_batch, minimum=1),
            checked_i32(f"{what}max_tiles", max_tiles, minimum=1),
        )
        return cap._bounded(what)

    def _bounded(self, what: str) -> PlanCapacity:
        """``self``, once its buffer is known to fit ``PLAN_BUFFER_MAX_ENTRIES``."""
        entries = self.buffer_entries
        if entries > PLAN_BUFFER_MAX_ENTRIES:
            raise PagedWindowError(
                f"{what}plan capacity {self} needs a buffer of {entries} int32 entries "
                f"({entries * 4 / 2**20:.0f} MiB), past the limit {PLAN_BUFFER_MAX_ENTRIES} (1 GiB)"
            )
        return self


def _exact_capacity(total_tokens: int, total_pages: int, batch: int, num_tiles: int) -> PlanCapacity:
    """The capacity of a plan sized exactly for a validated state's counts: ``PlanCapacity.checked("",
    max(total_tokens, 1), total_pages, batch, max(num_tiles, 1))`` (the same result, the same errors) without
    re-checking counts the state already narrowed to int32 (plain ints); only the buffer bound is checked."""
    tokens, tiles = max(total_tokens, 1), max(num_tiles, 1)
    if not (tokens <= INT32_MAX and tiles <= INT32_MAX and 0 < total_pages <= INT32_MAX and 0 < batch <= INT32_MAX):
        return PlanCapacity.checked("", tokens, total_pages, batch, tiles)  # not a validated state's counts
    return PlanCapacity(tokens, total_pages, batch, tiles)._bounded("")


@functools.lru_cache(maxsize=64)
def _segment_offsets(cap: PlanCapacity) -> tuple[int, ...]:
    sizes = cap.segment_sizes()
    return tuple(sum(sizes[:i]) for i in range(len(sizes)))


@functools.lru_cache(maxsize=64)
def _offsets_array(cap: PlanCapacity) -> tuple[np.ndarray, int]:
    """``cap``'s segment offsets as a read-only int64 array [7] for the compiled upload, and its address."""
    offsets = np.array(_segment_offsets(cap), dtype=np.int64)  # [7]
    offsets.flags.writeable = False
    return offsets, offsets.ctypes.data


class _DevicePageIds:
    """A state's page ids checked on the device (a plan from CUDA CSR tensors): they stay there, and the page
    segment of the state's host block is read back from them on first use (:meth:`fill`)."""

    __slots__ = ("ids", "stream", "target", "filled")
    _fill_lock = threading.Lock()  # fills are rare (host reads of a plan's ids): one lock for all

    def __init__(self, ids: torch.Tensor, target: np.ndarray):
        self.ids = ids  # [total_pages] int32 on the device, owned by the state (never written again)
        self.stream = _current_raw_stream(ids.device.index) if ids.is_cuda else None  # the stream ids was made on
        self.target = target  # [total_pages] the block's page segment (writable view)
        self.filled = False

    def fill(self) -> None:
        with self._fill_lock:
            if not self.filled:
                self.target[:] = self.ids.cpu().numpy()  # waits for the copy on the current stream
                self.filled = True


class _PlanState(NamedTuple):
    """One validated plan: every array the kernels read plus the scalars the wrappers check. Immutable (a tuple;
    its arrays are read-only); compared by identity."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    cta_tile_q: int
    block: np.ndarray  # [3 + 3 * batch + 2 + 2 * num_tiles + total_pages] int32: every segment, exactly full
    # (the page segment not yet read back while device_pages is unfilled: read it through ``packed``)
    device_pages: _DevicePageIds | None  # the page ids on the device, for a plan from CUDA CSR tensors
    page_indptr: np.ndarray  # [batch + 1] int32
    last_page_len: np.ndarray  # [batch] int32
    qo_indptr: np.ndarray  # [batch + 1] int32
    request_indices: np.ndarray  # [num_tiles] int32
    qo_tile_indices: np.ndarray  # [num_tiles] int32
    start_positions: np.ndarray  # [batch] int32
    max_page_index: int
    max_last_page_len: int
    batch_size: int  # plain ints (not array reads), so torch.compile sees constants
    total_tokens: int
    total_pages: int
    num_tiles: int

    @property
    def packed(self) -> np.ndarray:
        """``block`` with its page segment filled (read back from the device on first use)."""
        if self.device_pages is not None:
            self.device_pages.fill()
        return self.block

    @property
    def page_indices(self) -> np.ndarray:  # [total_pages] int32
        return self.packed[len(self.block) - self.total_pages :]

    def fits(self, cap: PlanCapacity) -> None:
        for name, value, bound in (
            ("total_tokens", self.total_tokens, cap.max_total_tokens),
            ("total_pages", self.total_pages, cap.max_total_pages),
            ("batch_size", self.batch_size, cap.max_batch),
            ("num_tiles", self.num_tiles, cap.max_tiles),
        ):
            if value > bound:
                raise PagedWindowError(f"update: {name} = {value} exceeds the plan's capacity {bound}")

    # A tuple of arrays has no useful value equality: identity instead. Methods, not assignments, which a
    # NamedTuple body would declare as fields for a type checker.
    def __eq__(self, other: object) -> bool:
        return object.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return object.__ne__(self, other)

    def __hash__(self) -> int:
        return object.__hash__(self)


# -- validation: CSR arrays in, a _PlanState out ----------------------------------------------------------------


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _check_indptr(name: str, indptr: np.ndarray, batch: int, item: str, minimum: int = 0) -> np.ndarray:
    """``indptr`` [batch+1] starts at 0 and grows by at least ``minimum`` per request; returns the per-request
    counts [batch]."""
    if len(indptr) != batch + 1:
        raise PagedWindowError(f"{name} has {len(indptr)} entries; last_page_len has {batch}, so it needs {batch + 1}")
    if indptr[0] != 0:
        raise PagedWindowError(f"{name}[0] = {int(indptr[0])} must be 0")
    counts = indptr[1:] - indptr[:-1]  # [batch]
    low = int(counts.min())
    if low < 0:
        i = _first(counts < 0)
        raise PagedWindowError(
            f"{name} decreases at request {i}: {name}[{i}] = {int(indptr[i])} > "
            f"{name}[{i + 1}] = {int(indptr[i + 1])} (negative {item})"
        )
    if low < minimum:
        i = _first(counts < minimum)
        raise PagedWindowError(
            f"request {i} has no pages ({name}[{i}] = {name}[{i + 1}] = {int(indptr[i])}); "
            f"every request needs at least one page"
        )
    if indptr[-1] > INT32_MAX:
        raise PagedWindowError(f"{name}[-1] = {int(indptr[-1])} does not fit in int32 (bound {INT32_MAX})")
    return counts


def _check_shared_pages(
    pages: np.ndarray,
    top: int,
    page_indptr: np.ndarray,
    start: np.ndarray,
    kv_len: np.ndarray,
    page_size: int,
    page_name,
) -> None:
    """No page id twice in one request; across requests, no new row in a slot another request writes or reads
    as cached prefix. Only entries whose page id appears more than once are examined."""
    total = len(pages)
    if total < 2:
        return
    pages = pages.astype(np.intp, copy=False)  # [total] (fancy indexing is fastest with native indices)
    if top < max(4 * total, 1 << 20):
        used = np.zeros(top + 1, dtype=np.bool_)  # [top + 1]
        used[pages] = True
        if np.count_nonzero(used) == total:
            return  # every page id is used once: nothing is shared
        seen = np.bincount(pages)  # [top + 1] uses of each page id
        shared = seen[pages] > 1  # [total]
    else:  # sparse ids: a sort instead of a counting table
        order = np.argsort(pages, kind="stable")
        equal = pages[order[1:]] == pages[order[:-1]]
        shared = np.zeros(total, dtype=bool)
        shared[order[1:][equal]] = True
        shared[order[:-1][equal]] = True
    if not shared.any():
        return
    entry = np.flatnonzero(shared)  # [n] entries on pages used more than once
    request = np.searchsorted(page_indptr, entry, side="right") - 1  # [n]
    page = pages[entry]  # [n]
    order = np.lexsort((request, page))
    entry, request, page = entry[order], request[order], page[order]
    same_page = page[1:] == page[:-1]
    repeat = same_page & (request[1:] == request[:-1])
    if repeat.any():
        j = _first(repeat)
        r = int(request[j])
        raise PagedWindowError(
            f"page id {int(page[j])} appears more than once in request {r}'s pages "
            f"({page_name(int(entry[j]), page_indptr)} and "
            f"{page_name(int(entry[j + 1]), page_indptr)})"
        )
    base = (entry - page_indptr[request]) * page_size  # [n] KV position of each entry's slot 0
    first_new = np.clip(start[request] - base, 0, page_size)  # [n] slots [0, first_new) are cached prefix
    end_new = np.clip(kv_len[request] - base, 0, page_size)  # [n] slots [first_new, end_new) are new rows
    writes = first_new < end_new
    # write vs cached read: a write starting below the largest cached extent of its page hits someone's prefix
    # (a request's own cached slots end where its writes begin, so including it is harmless).
    groups = np.flatnonzero(np.concatenate(([True], ~same_page)))  # [distinct shared pages] first entry of each
    cached_top = np.maximum.reduceat(first_new, groups)  # [distinct shared pages]
    group_of = np.cumsum(np.concatenate(([0], ~same_page)))  # [n] group of each entry
    hit = writes & (first_new < cached_top[group_of])
    if hit.any():
        j = _first(hit)
        reader = _first((page == page[j]) & (first_new > first_new[j]))
        raise PagedWindowError(
            f"request {int(request[j])} writes new rows into page {int(page[j])} slot {int(first_new[j])}, which "
            f"request {int(request[reader])} reads as cached prefix (slots 0..{int(first_new[reader]) - 1})"
        )
    # write vs write: sorted by (page, first slot), any overlap shows between neighbours
    w = np.flatnonzero(writes)
    if len(w) > 1:
        w = w[np.lexsort((first_new[w], page[w]))]
        clash = (page[w[1:]] == page[w[:-1]]) & (first_new[w[1:]] < end_new[w[:-1]])
        if clash.any():
            j = _first(clash)
            a, b = w[j], w[j + 1]
            raise PagedWindowError(
                f"requests {int(request[a])} and {int(request[b])} both write page "
                f"{int(page[a])} slot {int(first_new[b])}"
            )


def _tiles(
    seq: np.ndarray, start: np.ndarray, group: int, tile: int, total_tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """``request_indices`` and ``qo_tile_indices`` [num_tiles]: request i (``seq_i`` new rows from position
    ``start_i``) gets ceil(seq_i * group / tile) tiles, listed longest first (the module docstring's tile order)."""
    batch = len(seq)
    # One tile per request (decode's one row each, or short prompts): the tile's keys end at the request's kv_len.
    if total_tokens == batch and group <= tile and seq.min() == 1:
        return _longest_first(start + seq), _zeros(batch)
    per_request = -(-(seq * group) // tile)  # [batch]
    if per_request.max() <= 1 and per_request.min() == 1:
        return _longest_first(start + seq), _zeros(batch)
    num_tiles = checked_i32("num_tiles", int(per_request.sum()))
    request_indices = np.repeat(_arange(batch), per_request)  # [num_tiles] request by request
    first = np.cumsum(per_request) - per_request  # [batch] first tile of each request
    qo_tile_indices = np.arange(num_tiles) - np.repeat(first, per_request)  # [num_tiles]
    rows_end = np.minimum((qo_tile_indices + 1) * tile, np.repeat(seq * group, per_request))  # [num_tiles]
    keys_end = np.repeat(start, per_request) + (rows_end + group - 1) // group  # [num_tiles] one past the last key
    order = _longest_first(keys_end)  # [num_tiles]
    return request_indices[order], qo_tile_indices[order].astype(np.int32)


def _longest_first(keys_end: np.ndarray) -> np.ndarray:
    """Indices ordering ``keys_end`` largest first, ties in their given order (int32, same length)."""
    return np.argsort(-keys_end, kind="stable").astype(np.int32)


@functools.lru_cache(maxsize=16)
def _arange(n: int) -> np.ndarray:
    """``0 .. n-1`` as a read-only int32 array (shared: callers only read it)."""
    values = np.arange(n, dtype=np.int32)
    values.flags.writeable = False
    return values


@functools.lru_cache(maxsize=16)
def _zeros(n: int) -> np.ndarray:
    values = np.zeros(n, dtype=np.int32)
    values.flags.writeable = False
    return values


def _check_tile(cta_tile_q) -> int:
    tile = checked_i32("cta_tile_q", cta_tile_q)
    if tile not in SUPPORTED_CTA_TILE_Q:
        raise PagedWindowError(f"cta_tile_q = {tile} is not a supported tile {SUPPORTED_CTA_TILE_Q}")
    return tile


@dataclass(frozen=True)
class _Heads:
    num_qo_heads: int
    num_kv_heads: int
    group: int
    head_dim: int
    page_size: int

    @staticmethod
    def checked(num_qo_heads, num_kv_heads, head_dim, page_size) -> _Heads:
        key = (num_qo_heads, num_kv_heads, head_dim, page_size)
        plain = (  # bools compare equal to ints and other types may not hash
            type(num_qo_heads) is int and type(num_kv_heads) is int and type(head_dim) is int and type(page_size) is int
        )
        heads = _checked_heads.get(key) if plain else None
        if heads is not None:
            return heads
        group = check_head_relation(num_qo_heads, num_kv_heads)  # first: nothing has divided yet
        heads = _Heads(
            int(num_qo_heads),
            int(num_kv_heads),
            group,
            checked_i32("head_dim", head_dim, minimum=1),
            checked_i32("page_size", page_size, minimum=1),
        )
        if plain and len(_checked_heads) < 64:
            _checked_heads[key] = heads
        return heads


_checked_heads: dict[tuple, _Heads] = {}  # plain-int arguments -> their checked _Heads


def _csr_page_name(flat: int, kv_indptr: np.ndarray) -> str:
    return f"kv_indices[{flat}]"


def _request_page_name(flat: int, kv_indptr: np.ndarray) -> str:
    r = int(np.searchsorted(kv_indptr, flat, side="right")) - 1
    return f"page_indices[{r}][{flat - int(kv_indptr[r])}]"


def _packed_offsets(batch: int, num_tiles: int) -> tuple[int, ...]:
    """First entry of each buffer segment when every segment is exactly full (an exact-size plan's buffer):
    ``PlanCapacity(0, 0, batch, num_tiles).segment_offsets()``, by arithmetic."""
    b, t = batch, num_tiles
    return (0, 3, 4 + b, 4 + 2 * b, 5 + 3 * b, 5 + 3 * b + t, 5 + 3 * b + 2 * t)


def _packed_sizes(state: _PlanState) -> tuple[int, ...]:
    """Entries of each segment of ``state.packed``: ``PlanCapacity(0, total_pages, batch, num_tiles)
    .segment_sizes()``, by arithmetic."""
    b, t = state.batch_size, state.num_tiles
    return (3, b + 1, b, b + 1, t, t, state.total_pages)


def _scatter_live(state: _PlanState, cap: PlanCapacity, out: np.ndarray) -> None:
    """Write each segment of ``state.packed`` to its offset in a capacity-sized buffer ``out`` [entries]."""
    sizes = _packed_sizes(state)
    for src, dst, n in zip(_packed_offsets(state.batch_size, state.num_tiles), cap.segment_offsets(), sizes):
        out[dst : dst + n] = state.packed[src : src + n]


def _kv_lens(num_pages: np.ndarray, last_page_len: np.ndarray, page_size: int) -> np.ndarray:
    """Each request's kv_len: ``(pages - 1) * page_size + last_page_len`` (``num_pages`` int64, ``[batch]``)."""
    return (num_pages - 1) * page_size + last_page_len


def _state_from_csr(
    qo_indptr: np.ndarray,
    kv_indptr: np.ndarray,
    kv_indices: np.ndarray,
    last_page_len: np.ndarray,
    heads: _Heads,
    tile: int | None,
    device,
    page_name=_csr_page_name,
    given=(),
) -> tuple[_PlanState, str]:
    """Validate CSR arrays (any integer dtype) and derive the plan; ``tile`` None asks the policy. Returns
    (state, tile reason). ``page_name(flat index, kv_indptr)`` names a page id in error messages. ``given``: the
    caller's objects the arrays were read from (CPU tensors hand the compiled pass their addresses cheaply).

    Each rule is first checked in one vectorised pass over everything it covers; only a failing pass re-runs the
    detailed check that names the offending entry."""
    batch = len(last_page_len)
    if batch == 0:
        raise PagedWindowError("a plan needs at least one request; last_page_len is empty")
    if batch > INT32_MAX:
        checked_i32("batch_size", batch)
    lib = _host_pass_library(device)
    if lib is not None:
        compiled = _compiled_pass(lib, (qo_indptr, kv_indptr, kv_indices, last_page_len), given, heads, tile, device)
        if compiled is not None:
            return compiled
    if len(qo_indptr) != batch + 1 or len(kv_indptr) != batch + 1:
        _check_indptr("qo_indptr", qo_indptr.astype(np.int64, copy=False), batch, "seq_len")
        _check_indptr("kv_indptr", kv_indptr.astype(np.int64, copy=False), batch, "page count", minimum=1)
    indptr = np.empty((2, batch + 1), dtype=np.int64)  # [2, batch + 1]: qo_indptr, kv_indptr
    indptr[0] = qo_indptr
    indptr[1] = kv_indptr
    counts = indptr[:, 1:] - indptr[:, :-1]  # [2, batch]: seq_len, page count
    low = counts.min(axis=1)  # [2]
    if indptr[0, 0] or indptr[1, 0] or low[0] < 0 or low[1] < 1 or indptr[:, -1].max() > INT32_MAX:
        _check_indptr("qo_indptr", indptr[0], batch, "seq_len")
        _check_indptr("kv_indptr", indptr[1], batch, "page count", minimum=1)
    seq, num_pages = counts  # [batch] each
    total_tokens, total_pages = int(indptr[0, -1]), int(indptr[1, -1])
    if total_pages > len(kv_indices):
        raise PagedWindowError(f"kv_indptr[-1] = {total_pages} but kv_indices has only {len(kv_indices)} entries")
    pages = kv_indices[:total_pages]  # [total_pages] the caller's dtype
    low_id, high = int(pages.min()), int(pages.max())
    if low_id < 0 or high > INT32_MAX:
        flat = _first((pages < 0) | (pages > INT32_MAX))
        value = int(pages[flat])
        bound = "is below its minimum 0" if value < 0 else f"does not fit in int32 (bound {INT32_MAX})"
        raise PagedWindowError(f"page id {page_name(flat, indptr[1])} = {value} {bound}")
    page_size = heads.page_size
    last = last_page_len.astype(np.int64, copy=False)  # [batch]
    min_last, max_last = int(last.min()), int(last.max())
    if min_last < 1 or max_last > page_size:
        i = _first((last < 1) | (last > page_size))
        raise PagedWindowError(f"last_page_len[{i}] = {int(last[i])} is outside 1..{page_size} (page_size {page_size})")
    kv_len = _kv_lens(num_pages, last, page_size)  # [batch] int64
    if total_pages * page_size > INT32_MAX and kv_len.max() > INT32_MAX:  # every kv_len <= total_pages * page_size
        i = _first(kv_len > INT32_MAX)
        raise PagedWindowError(f"kv_len of request {i} = {int(kv_len[i])} does not fit in int32 (bound {INT32_MAX})")
    start = kv_len - seq  # [batch]
    if start.min() < 0:
        i = _first(start < 0)
        raise PagedWindowError(
            f"request {i} has seq_len {int(seq[i])} new rows but only kv_len {int(kv_len[i])} "
            f"keys (seq_len must be <= kv_len)"
        )
    checked_i32("packed rows (total_tokens * group)", total_tokens * heads.group)
    _check_shared_pages(pages, high, indptr[1], start, kv_len, page_size, page_name)
    reason = "explicit"
    if tile is None:
        tile, reason = tile_for_batch(
            seq, heads.group, heads.num_kv_heads, _policy_device(device), longest_kv_len=lambda: int(kv_len.max())
        )
    request_indices, qo_tile_indices = _tiles(seq, start, heads.group, tile, total_tokens)
    num_tiles = len(request_indices)
    # One int32 block in the buffer's segment order, exactly full: the state's arrays are views of it, and it is
    # what an exact-size plan uploads as it is.
    o = _packed_offsets(batch, num_tiles)
    packed = np.empty(o[6] + total_pages, dtype=np.int32)  # [entries]
    packed[:3] = (batch, total_tokens, num_tiles)
    packed[o[1] : o[2]] = indptr[1]
    packed[o[2] : o[3]] = last
    packed[o[3] : o[4]] = indptr[0]
    packed[o[4] : o[5]] = request_indices
    packed[o[5] : o[6]] = qo_tile_indices
    packed[o[6] :] = pages
    state = _state_of_block(
        heads,
        tile,
        packed,
        start.astype(np.int32),
        batch=batch,
        total_tokens=total_tokens,
        total_pages=total_pages,
        num_tiles=num_tiles,
        max_page_index=high,
        max_last_page_len=max_last,
    )
    return state, reason


def _state_of_block(
    heads: _Heads,
    tile: int,
    packed: np.ndarray,
    start_positions: np.ndarray,
    *,
    batch: int,
    total_tokens: int,
    total_pages: int,
    num_tiles: int,
    max_page_index: int,
    max_last_page_len: int,
    device_ids: torch.Tensor | None = None,
) -> _PlanState:
    """The state whose arrays are read-only views of ``packed`` (the block in buffer order, exactly full).
    ``device_ids``: the page ids, checked on the device; ``packed``'s page segment is then filled from them on
    first use."""
    o = _packed_offsets(batch, num_tiles)
    device_pages = None if device_ids is None else _DevicePageIds(device_ids, packed[o[6] :])  # writable view
    packed.flags.writeable = False  # views taken below are read-only too
    start_positions.flags.writeable = False
    return _PlanState(
        num_qo_heads=heads.num_qo_heads,
        num_kv_heads=heads.num_kv_heads,
        head_dim=heads.head_dim,
        page_size=heads.page_size,
        cta_tile_q=tile,
        block=packed,
        device_pages=device_pages,
        page_indptr=packed[o[1] : o[2]],
        last_page_len=packed[o[2] : o[3]],
        qo_indptr=packed[o[3] : o[4]],
        request_indices=packed[o[4] : o[5]],
        qo_tile_indices=packed[o[5] : o[6]],
        start_positions=start_positions,
        max_page_index=max_page_index,
        max_last_page_len=max_last_page_len,
        batch_size=batch,
        total_tokens=total_tokens,
        total_pages=total_pages,
        num_tiles=num_tiles,
    )


_NATIVE_DTYPES = {np.dtype(np.int32): 0, np.dtype(np.int64): 1}


def _host_pass_library(device):
    """The compiled host pass's library for a plan on ``device`` (``pagedwindow.cuda.host_pass.library``)."""
    return _host_pass().library(_as_device(device))


@functools.cache
def _host_pass():
    """``pagedwindow.cuda.host_pass``, imported on first use (importing it at module level would be a cycle)."""
    from .cuda import host_pass

    return host_pass


def _address(array: np.ndarray, given) -> int:
    """``array``'s data address: from the CPU tensor it views when there is one (cheap), else numpy's."""
    if isinstance(given, torch.Tensor) and given.is_cpu:
        return given.data_ptr()  # int_array returned given.numpy(): the same memory
    return array.ctypes.data


def _writable_address(array: np.ndarray) -> int:
    """The data address of a writable, C-contiguous array (a third of ``array.ctypes.data``'s cost)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(array.data))


_PACK_SCALARS = 11
"""The scalars ``pw_plan_pack`` writes (``PW_PACK_SCALARS``): max_page_index, max_last_page_len, total_tokens,
total_pages, num_tiles, then the tile policy's counts: the most packed rows of one request, the longest kv_len,
the requests with new rows, the tiles at each of ``SUPPORTED_CTA_TILE_Q``."""
_SMALLEST_TILE = min(SUPPORTED_CTA_TILE_Q)


def _compiled_pass(
    lib, arrays, given, heads: _Heads, tile: int | None, device, checked=None
) -> tuple[_PlanState, str] | None:
    """The batch validated and packed by ``pw_plan_pack`` (one pass in compiled code), or None when the numpy
    pass must run: an argument it does not take (a dtype other than int32/int64, strided, a size the numpy pass
    refuses anyway) or any status but OK (the numpy pass then names the error, or rules on shared pages).
    ``checked``: the page ids' pass already ran on the device (a ``host_pass.DeviceChecked``, which then holds the
    small arrays: ``arrays`` is None): only the rest is checked here, and the state keeps the ids on the device.
    ``tile`` None: the pass packs at the smallest tile and returns the counts the policy reads; ``pw_plan_retile``
    then lays the tile list out at the tile the policy picks (the page ids are not read again)."""
    if checked is not None:
        arrays = (checked.qo_indptr, checked.kv_indptr, None, checked.last_page_len)
    qo_indptr, kv_indptr, kv_indices, last_page_len = arrays
    host_arrays = (qo_indptr, kv_indptr, last_page_len) if checked is not None else arrays
    flags = [_NATIVE_DTYPES.get(a.dtype) for a in host_arrays]
    if None in flags or not all(a.flags.c_contiguous for a in host_arrays):
        return None
    num_indices = len(kv_indices) if checked is None else checked.num_indices
    indices_flag = flags[2] if checked is None else 0
    batch = len(last_page_len)
    if len(qo_indptr) != batch + 1 or len(kv_indptr) != batch + 1:
        return None
    total_tokens, total_pages = int(qo_indptr[-1]), int(kv_indptr[-1])
    group = heads.group
    if not (0 <= total_tokens and total_tokens * group <= INT32_MAX and 0 <= total_pages <= num_indices):
        return None
    # num_tiles <= total rows // tile + batch: the bound at the smallest tile covers every tile
    bound = 3 + 3 * batch + 2 + 2 * (total_tokens * group // (tile or _SMALLEST_TILE) + batch + 1) + total_pages
    out = np.empty(_PACK_SCALARS + batch + bound, dtype=np.int32)  # [scalars + batch + bound]
    address = _writable_address(out)
    given = given or (None,) * 4
    addresses: list[int | None]
    if checked is None:
        addresses = [_address(a, g) for a, g in zip(arrays, given)]
    else:  # one int64 array: qo_indptr [batch + 1], kv_indptr [batch + 1], last_page_len [batch]
        base = _writable_address(checked.arrays)
        addresses = [base, base + 8 * (batch + 1), None, base + 16 * (batch + 1)]

    block, start_positions = address + 4 * (_PACK_SCALARS + batch), address + 4 * _PACK_SCALARS  # in `out`
    reason = "explicit"
    # A pass whose tile the policy may still change leaves the tile list unordered: it is laid out and ordered once,
    # at the tile the plan keeps.
    status = lib.pw_plan_pack(
        addresses[0],
        flags[0],
        addresses[1],
        flags[1],
        addresses[2],
        indices_flag,
        num_indices,
        addresses[3],
        flags[-1],
        batch,
        heads.page_size,
        group,
        tile or _SMALLEST_TILE,
        block,
        bound,
        start_positions,
        address,
        int(tile is not None),
    )
    if status != 0:
        return None
    scalars = out[:_PACK_SCALARS].tolist()
    if tile is None:
        tiles = dict(zip(SUPPORTED_CTA_TILE_Q, scalars[8:]))
        tile, reason = tile_for_counts(
            scalars[5],
            tiles.__getitem__,
            lambda: scalars[7],
            heads.num_kv_heads,
            _policy_device(device),
            longest_kv_len=lambda: scalars[6],
            total_rows=lambda: scalars[2] * group,
        )
        if lib.pw_plan_retile(block, bound, start_positions, group, tile, address) != 0:
            return None
        scalars = out[:_PACK_SCALARS].tolist()  # the tile count at the policy's tile
    high, max_last, total_tokens, total_pages, num_tiles = scalars[:5]
    if checked is not None:
        high = checked.max_page_index
    entries = _packed_offsets(batch, num_tiles)[6] + total_pages
    start = _PACK_SCALARS + batch
    state = _state_of_block(
        heads,
        tile,
        out[start : start + entries],
        out[_PACK_SCALARS:start],
        batch=batch,
        total_tokens=total_tokens,
        total_pages=total_pages,
        num_tiles=num_tiles,
        max_page_index=high,
        max_last_page_len=max_last,
        device_ids=None if checked is None else checked.page_ids,
    )
    return state, reason


def _state_from_device_csr(given, heads: _Heads, tile: int | None, device, bound: int | None):
    """For CSR tensors on a GPU: the page ids checked there (``host_pass.DeviceChecked``) and the rest by the
    compiled pass on host copies of the small arrays, one synchronisation in all. Returns (state, tile reason),
    or None where the host's pass must run instead: inputs of another kind, no kernels library, or any finding
    of the device pass (the host's pass names the error, or rules on page ids shared between requests).
    ``bound``: the most page ids the plan may hold (a preallocated plan's capacity), None for none."""
    first = given[2]
    if type(first) is not torch.Tensor or not first.is_cuda:
        return None
    on = first.device
    sizes = []
    for t in given:  # every planning call passes here: one cheap expression per tensor
        if not (
            type(t) is torch.Tensor
            and t.device == on
            and t.dtype in _CUDA_CSR_DTYPES
            and t.dim() == 1
            and t.is_contiguous()
        ):
            return None
        sizes.append(t.shape[0])
    batch = sizes[3]
    if batch < 1 or sizes[0] != batch + 1 or sizes[1] != batch + 1 or sizes[2] == 0:  # the host pass names why
        return None
    where = _cuda_device(on)
    if device is not None and device is not on and _cuda_device(device) != where:  # a plan for another device
        return None
    check = _host_pass().device_check(where)
    if check is None:
        return None
    checked = check.run(given, sizes, bound)
    if checked is None:
        return None
    return _compiled_pass(check.lib, None, (), heads, tile, device if device is not None else on, checked)


_CsrArrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""``(qo_indptr, kv_indptr, kv_indices, last_page_len)`` as host integer arrays."""


def _derived_form(derived) -> dict:
    """``from_dict``'s recorded 'derived' entry in :meth:`PrefillPagedPlan.to_dict`'s form (names to ints or lists
    of ints), so that comparing it with the rebuilt plan's is plain equality; anything else raises."""

    def plain(v):
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        if isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return list(v)
        shown = type(v).__name__
        raise PagedWindowError(f"from_dict: 'derived' values must be integers or lists of integers, got {shown}")

    if not isinstance(derived, Mapping):
        raise PagedWindowError(f"from_dict: 'derived' must be a dict of named arrays, got {type(derived).__name__}")
    for k in derived:
        if not isinstance(k, str):
            raise PagedWindowError(
                f"from_dict: 'derived' keys must be array names (str), got {k!r} ({type(k).__name__})"
            )
    return {k: plain(v) for k, v in derived.items()}


def _csr_from_requests(page_indices, last_page_lens, start_positions, seq_lens, page_size: int) -> _CsrArrays:
    """Per-request lists (the ``batch`` form) to CSR arrays, with the coverage rule checked per request."""
    seq = checked_i32_array("seq_lens", int_array("seq_lens", seq_lens), minimum=0).astype(np.int64)
    batch = len(seq)
    if batch == 0:
        raise PagedWindowError("a plan needs at least one request; seq_lens is empty")
    if (
        isinstance(page_indices, NOT_INT_SEQUENCES)
        or not isinstance(page_indices, (Sequence, np.ndarray))
        or (isinstance(page_indices, np.ndarray) and page_indices.ndim == 0)
    ):
        shown = "a 0-d array" if isinstance(page_indices, np.ndarray) else type(page_indices).__name__
        raise PagedWindowError(f"page_indices must be a sequence of per-request page lists, got {shown}")
    starts = int_array("start_positions", start_positions)
    lasts = int_array("last_page_lens", last_page_lens)
    for name, n in (
        ("page_indices", len(page_indices)),
        ("last_page_lens", len(lasts)),
        ("start_positions", len(starts)),
    ):
        if n != batch:
            raise PagedWindowError(f"{name} has {n} entries but seq_lens has {batch} (one per request)")
    start = checked_i32_array("start_positions", starts, minimum=0)
    last = checked_i32_array("last_page_lens", lasts).astype(np.int64)
    counts, kv_indices = _request_page_ids(page_indices, batch)
    kv_len = start.astype(np.int64) + seq  # [batch]
    if kv_len.max() > INT32_MAX:
        i = _first(kv_len > INT32_MAX)
        raise PagedWindowError(
            f"kv_len of request {i} (start {int(start[i])} + seq {int(seq[i])}) = "
            f"{int(kv_len[i])} does not fit in int32 (bound {INT32_MAX})"
        )
    if counts.min() == 0:
        i = _first(counts == 0)
        raise PagedWindowError(f"page_indices[{i}] is empty; every request needs at least one page")
    if kv_len.min() == 0:
        i = _first(kv_len == 0)
        raise PagedWindowError(f"request {i} has kv_len 0 (start 0 + seq 0) but {int(counts[i])} pages")
    need = -(-kv_len // page_size)  # [batch]
    if (counts != need).any():
        i = _first(counts != need)
        raise PagedWindowError(
            f"request {i}: {int(counts[i])} pages do not cover kv_len {int(kv_len[i])} at "
            f"page_size {page_size} (needs exactly {int(need[i])})"
        )
    want_last = kv_len - (need - 1) * page_size  # [batch]
    if (last != want_last).any():
        i = _first(last != want_last)
        raise PagedWindowError(
            f"last_page_lens[{i}] = {int(last[i])} disagrees with kv_len {int(kv_len[i])}: the "
            f"last page holds {int(want_last[i])} (bound 1..{page_size})"
        )
    kv_indptr = np.concatenate(([0], np.cumsum(counts)))  # [batch + 1]
    qo_indptr = np.concatenate(([0], np.cumsum(seq)))  # [batch + 1]
    return qo_indptr, kv_indptr, kv_indices, last


def _request_page_ids(page_indices, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """``(counts [batch], kv_indices [total_pages])`` int64 from per-request page lists. Lists of plain ints (the
    common case) are read in one conversion; anything else, or any entry that is not a plain int, goes request by
    request through ``int_array``, whose error names the request and the entry."""
    if all(type(p) is list for p in page_indices):
        flat = list(itertools.chain.from_iterable(page_indices))
        if operator.countOf(map(type, flat), int) == len(flat):  # plain ints only (no bools, floats, ...)
            try:
                ids = np.array(flat, dtype=np.int64)  # [total_pages]
            except OverflowError:
                pass  # past int64: the loop below names where
            else:
                return np.fromiter(map(len, page_indices), dtype=np.int64, count=batch), ids
    per_request = [
        int_array(f"page_indices[{i}]", p).astype(np.int64, copy=False)  # a loop over requests
        for i, p in enumerate(page_indices)
    ]
    counts = np.fromiter((len(p) for p in per_request), dtype=np.int64, count=batch)  # [batch]
    return counts, (np.concatenate(per_request) if batch > 1 else per_request[0])


# -- device mirrors ---------------------------------------------------------------------------------------------


def _split_kv_unit_floats(state: _PlanState) -> int:
    """fp32 entries of one split-KV unit for ``state`` (a tile's rows x (head_dim outputs + 1 LSE)), 0 if the
    plan's launches do not split."""
    return SPLIT_KV_TILE * (state.head_dim + 1) if state.cta_tile_q == SPLIT_KV_TILE else 0


class _DeviceMirror:
    """A plan's int32 buffer on one GPU, its pinned staging twins, and the event of each one's upload.

    ``storage`` is allocated once, at a size class (a power of two) so that a freed plan's mirror fits the next
    plans of about its size; ``buffer`` is its first ``capacity.buffer_entries`` entries, the view the kernels
    read, at a fixed address for the plan's life."""

    __slots__ = (
        "storage",
        "buffer",
        "stream",
        "staging",
        "staged",
        "events",
        "turn",
        "lib",
        "entries",
        "index",
        "fitted",
        "offsets",
        "offsets_address",
        "event_handles",
        "events_address",
        "split_kv",
        "split_kv_unit_floats",
        "__weakref__",
    )

    STAGING_BUFFERS = 2
    """Pinned staging buffers used in turn: an update waits only for the upload two updates back, so the host
    may run a step ahead of the GPU without waiting."""
    MAX_COPIED_GAP = 4096
    """Unused tile entries (at most ``max_tiles - num_tiles``) copied along with the live ones so that one copy
    covers the whole live range; a larger gap costs a second copy instead."""
    MIN_ENTRIES = 1024
    """The smallest size class (4 KiB)."""

    def __init__(self, capacity: PlanCapacity, device: torch.device):
        # Never reallocated. Only live entries are ever read by the kernels, so neither buffer is zeroed.
        self.storage = torch.empty(
            self.size_class(capacity.buffer_entries), dtype=torch.int32, device=device
        )  # [size class]
        self.entries = len(self.storage)  # the size class, read by the pool
        self.index: int = self.storage.device.index
        self.stream = _current_raw_stream(self.index)  # the stream the storage was made on
        self.staging: list[torch.Tensor | None] = [None] * self.STAGING_BUFFERS  # pinned, made on first use
        self.turn = 0
        # The upload path, fixed for the mirror's life: the compiled upload (``pw_plan_upload``, with CUDA events
        # it creates and a finalizer destroys) from the kernels' library, loaded here if no plan or launch has yet
        # (built on first use: the plan's launches need it anyway); torch copies and events only where it cannot
        # be built or loaded. A mirror made before the library and kept on torch copies would, pooled, hand its
        # path to later plans: a plan from CUDA CSR tensors would then read its page ids back to upload them.
        self.lib = _host_pass_library(self.storage.device)
        if self.lib is not None:
            self.event_handles = np.zeros(self.STAGING_BUFFERS, dtype=np.uint64)  # cudaEvent_t, 0: none yet
            self.events_address = self.event_handles.ctypes.data
            weakref.finalize(self, _destroy_events, self.lib, self.event_handles).atexit = False  # exit frees all
        else:
            self.staged: list[np.ndarray | None] = [None] * self.STAGING_BUFFERS  # numpy views of the staging
            self.events: list[torch.cuda.Event | None] = [None] * self.STAGING_BUFFERS
        self.fitted: PlanCapacity | None = None
        self.split_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # made by ensure_split_kv
        self.split_kv_unit_floats = 0  # the unit size split_kv was made for
        self.fit(capacity)

    @classmethod
    def size_class(cls, entries: int) -> int:
        """The storage entries for a buffer of ``entries``: the next power of two, at least ``MIN_ENTRIES``; a
        buffer the pool would not keep (past ``_MirrorPool.MAX_ENTRIES``) is allocated exactly."""
        if entries > _MirrorPool.MAX_ENTRIES:
            return entries
        return max(cls.MIN_ENTRIES, 1 << (entries - 1).bit_length())

    def fit(self, capacity: PlanCapacity) -> None:
        """Lay ``capacity``'s segments over the storage (a new plan taking a pooled mirror); nothing to do when the
        mirror already has that layout (the buffer is the same view of the storage)."""
        if capacity == self.fitted:
            return
        self.buffer = self.storage[: capacity.buffer_entries]  # [entries] a view: the storage's address
        if self.lib is not None:
            self.offsets, self.offsets_address = _offsets_array(capacity)
        self.fitted = capacity

    def ensure_split_kv(self, unit_floats: int) -> None:
        """Give the mirror ``split_kv``, the split-KV scratch on its device, unless it has one of this unit size:
        ``SPLIT_KV_UNITS_PER_SM`` units per SM of ``unit_floats`` fp32 each, and a zeroed int32 counter per unit
        (the kernel leaves the counters zero after every launch). It stays with the mirror, pooled with it."""
        if unit_floats != self.split_kv_unit_floats:
            units = SPLIT_KV_UNITS_PER_SM * device_traits(self.storage.device)[1]
            self.split_kv = (
                torch.empty(units * unit_floats, dtype=torch.float32, device=self.storage.device),  # [units*unit]
                torch.zeros(units, dtype=torch.int32, device=self.storage.device),  # [units]
            )
            self.split_kv_unit_floats = unit_floats

    def upload(self, state: _PlanState, cap: PlanCapacity) -> None:
        """Copy ``state`` asynchronously on the device's current stream: its live entries, in one copy (an
        exact-size plan's whole buffer; else the header, the tile list and the live page ids, with the unused
        tile entries between them when there are at most ``MAX_COPIED_GAP``), or two when the gap is larger.
        Waits only for the copy that last used the staging buffer it takes (two uploads back)."""
        turn = self.turn
        self.turn = (turn + 1) % self.STAGING_BUFFERS
        staging = self.staging[turn]
        if staging is None:
            staging = self.staging[turn] = torch.empty(
                self.entries, dtype=torch.int32, pin_memory=True
            )  # [size class] host
        index = self.index
        if self.lib is not None:
            if index == _current_device():
                self._upload_compiled(turn, staging, state, cap, index)
            else:
                with torch.cuda.device(index):
                    self._upload_compiled(turn, staging, state, cap, index)
            return
        staged, event = self.staged[turn], self.events[turn]
        if staged is None or event is None:  # made together
            staged = self.staged[turn] = staging.numpy()
            event = self.events[turn] = torch.cuda.Event()
        event.synchronize()  # the upload that last used this staging buffer has run (never recorded: no wait)
        entries = len(state.packed)
        if entries == len(self.buffer):  # every segment exactly full: the packed block is the buffer
            staged[:entries] = state.packed
            copies: tuple[tuple[int, int], ...] = ((0, entries),)
        else:
            _scatter_live(state, cap, staged)
            o_pages, p = cap.segment_offsets()[6], state.total_pages
            head = cap.segment_offsets()[5] + state.num_tiles  # end of the live tile list
            if o_pages - head <= self.MAX_COPIED_GAP:
                copies = ((0, o_pages + p),)
            else:
                copies = ((0, head), (o_pages, o_pages + p))
        if index == _current_device():
            self._copy(staging, copies, event)
        else:
            with torch.cuda.device(index):
                self._copy(staging, copies, event)

    def _upload_compiled(
        self, turn: int, staging: torch.Tensor, state: _PlanState, cap: PlanCapacity, index: int
    ) -> None:
        """The same upload in one call (``pw_plan_upload``, device ``index`` current): wait for the staging
        buffer's last copy, write the live segments into it, enqueue the copies, record the turn's event."""
        sizes = np.array(_packed_sizes(state), dtype=np.int64)  # [7] the live segments
        stream = _current_raw_stream(index)
        pages = state.device_pages
        if pages is not None and pages.ids.device.index == index:  # ids checked on this device: copied there
            if stream != pages.stream:  # keep the ids' memory until this stream's copy has run
                pages.ids.record_stream(torch.cuda.current_stream(index))
            block, device_pages = state.block, pages.ids.data_ptr()
        else:
            block, device_pages = state.packed, None
        status = self.lib.pw_plan_upload(
            self.buffer.data_ptr(),
            staging.data_ptr(),
            block.ctypes.data,
            self.offsets_address,
            _writable_address(sizes),
            self.MAX_COPIED_GAP,
            device_pages,
            stream,
            self.events_address + 8 * turn,
        )
        if status != 0:
            raise RuntimeError(f"plan upload to {self.buffer.device} failed: CUDA error {status}")

    def _copy(self, staging: torch.Tensor, copies, event) -> None:
        for begin, end in copies:
            self.buffer[begin:end].copy_(staging[begin:end], non_blocking=True)
        event.record()


class _MirrorPool:
    """Mirrors of freed plans, kept for new plans to take instead of allocating device and pinned memory.

    Keyed by (device, the stream the storage was made on): as with torch's caching allocator, memory is reused
    only on the stream it was made on, where the new plan's first upload is ordered after every launch the freed
    plan made there. Uploads still wait for the staging buffer's last copy (its event), so no copy in flight is
    overwritten. A new plan takes the smallest pooled storage that holds it, at most ``MAX_GROWTH`` times its
    size; at most ``PER_STREAM`` mirrors of at most ``MAX_ENTRIES`` entries are kept per key, the oldest dropped
    first. :func:`release_pooled_plan_buffers` empties it."""

    PER_STREAM = 8
    MAX_ENTRIES = 1 << 22  # 16 MiB of device memory (and twice that pinned) per mirror
    MAX_GROWTH = 4

    def __init__(self):
        self.free: dict[tuple[int, int], list[_DeviceMirror]] = {}

    def take(self, capacity: PlanCapacity, device: torch.device) -> _DeviceMirror | None:
        """A pooled mirror fitted to ``capacity`` on ``device`` (an indexed CUDA device) and its current stream, or
        None. Reads each mirror's ``entries`` (its storage size) and calls its ``fit``."""
        free = self.free.get((device.index, _current_raw_stream(device.index)))
        if not free:
            return None
        need = capacity.buffer_entries
        most = self.MAX_GROWTH * max(need, _DeviceMirror.MIN_ENTRIES)
        mirror, smallest = None, 0
        for m in free:  # the smallest storage in [need, most]; the first of equals
            size = m.entries
            if need <= size <= most and (mirror is None or size < smallest):
                mirror, smallest = m, size
        if mirror is None:
            return None
        try:
            free.remove(mirror)
        except ValueError:  # taken meanwhile (a finalizer ran inside this call)
            return None
        mirror.fit(capacity)
        return mirror

    def give(self, mirrors) -> None:
        """Keep ``mirrors`` (freed plans') by their ``index`` and ``stream``, within the pool's bounds."""
        for mirror in mirrors:
            if mirror.entries > self.MAX_ENTRIES:
                continue
            free = self.free.setdefault((mirror.index, mirror.stream), [])
            free.append(mirror)
            if len(free) > self.PER_STREAM:
                free.pop(0)

    def clear(self) -> None:
        self.free.clear()


_MIRROR_POOL = _MirrorPool()


def release_pooled_plan_buffers() -> None:
    """Free the device and pinned buffers kept from plans that were freed (new plans then allocate afresh)."""
    _MIRROR_POOL.clear()


_plan_refs: dict[int, weakref.ref] = {}
"""A weak reference to each plan with mirrors (by the reference's id: plans do not hash), whose callback
(:func:`_return_mirrors`) pools them when the plan is freed: a finalizer at a tenth of ``weakref.finalize``'s cost.
Emptied at exit, so that (as with ``finalize``'s ``atexit = False``) nothing is pooled while the interpreter shuts
down."""
atexit.register(_plan_refs.clear)


def _pool_at_end(plan: PrefillPagedPlan) -> None:
    """When ``plan`` is freed, its mirrors go to the pool."""
    ref = weakref.ref(plan, functools.partial(_return_mirrors, plan._mirrors))
    _plan_refs[id(ref)] = ref


def _return_mirrors(mirrors: dict, ref: weakref.ref) -> None:
    """A freed plan's callback: its mirrors go to the pool."""
    _plan_refs.pop(id(ref), None)
    _MIRROR_POOL.give(list(mirrors.values()))


_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
_current_raw_stream = getattr(
    torch._C, "_cuda_getCurrentRawStream", lambda index: torch.cuda.current_stream(index).cuda_stream
)


def _destroy_events(lib, handles: np.ndarray) -> None:
    """A mirror's finalizer: destroy the CUDA events its compiled uploads created."""
    lib.pw_plan_events_destroy(handles.ctypes.data, len(handles))


_checked_devices: dict[str | torch.device, torch.device] = {}
_indexed_cuda_devices: dict[int, torch.device] = {}
_DEVICE_CACHE_LIMIT = 64


def _as_device(device) -> torch.device | None:
    """``torch.device(device)``: None for None, a device itself (devices are immutable), a CUDA device for a
    non-negative int. A value that names no device raises PagedWindowError. Parsing is not cached here: the
    public entry points go through :func:`_checked_device`, which remembers what passed."""
    if device is None or isinstance(device, torch.device):
        return device
    if type(device) is int and device >= 0:  # torch's reading on a CUDA host (a bool is no index)
        return torch.device("cuda", device)
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        shown = repr(device) if type(device) is str else f"{device!r} ({type(device).__name__})"
        raise PagedWindowError(
            f"device {shown} is not a device: give None, 'cpu', 'cuda', 'cuda:N', a CUDA index or a torch.device"
        ) from None


def _checked_device(device) -> torch.device | None:
    """The ``device`` argument of every public constructor, checked before anything else: None, or the
    torch.device it names. Raises PagedWindowError for a value that names no device, and for a CUDA device where
    CUDA is not available or past the visible devices. A string or torch.device that passed is remembered (up to
    ``_DEVICE_CACHE_LIMIT`` of them): a serving loop's repeated device costs one lookup."""
    if device is None:  # the serving loop's usual case: the plan's device comes from its tensors
        return None
    try:
        found = _checked_devices.get(device)  # the hot case: a device checked before
    except TypeError:  # unhashable: no device, refused below
        found = None
    if found is not None:
        return found
    found = _as_device(device)
    assert found is not None  # device is not None
    if found.type == "cuda":
        count = torch.cuda.device_count()
        shown = repr(str(device) if isinstance(device, torch.device) else device)
        if count == 0:
            raise PagedWindowError(f"device {shown} requested but CUDA is not available")
        if found.index is not None and found.index >= count:
            raise PagedWindowError(f"device {shown} requested but only {count} CUDA device(s) are visible")
    if (type(device) is str or type(device) is torch.device) and len(_checked_devices) < _DEVICE_CACHE_LIMIT:
        _checked_devices[device] = found  # never an int: 1 == True == 1.0 would share an entry
    return found


def _cuda_device(device) -> torch.device | None:
    """The CUDA device ``device`` names, with its index (the current device's when it has none); None for anything
    else. One device object per index."""
    device = _as_device(device)
    if device is None or device.type != "cuda":
        return None
    index = _current_cuda_index() if device.index is None else device.index
    found = _indexed_cuda_devices.get(index)
    if found is None:
        found = torch.device("cuda", index)
        if len(_indexed_cuda_devices) < _DEVICE_CACHE_LIMIT:
            _indexed_cuda_devices[index] = found
    return found


def _current_cuda_index() -> int:
    """``torch.cuda.current_device()``; once CUDA is initialized, torch's getter alone (what it returns then)."""
    return _current_device() if torch.cuda.is_initialized() else torch.cuda.current_device()


def _policy_device(device):
    """The device to hand the tile policy: a CUDA device with its index resolved (the policy then skips that
    lookup), else ``device`` as given. The policy's answer is the same for both."""
    return _cuda_device(device) or device


def _device_of(*values) -> torch.device | None:
    """The device of the first CUDA tensor among ``values``, else None."""
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_cuda:
            return v.device
    return None


class PrefillPagedPlan:
    """Host plan for a batch of paged prefill (or decode) requests; see the module docstring for the rules.

    Build with :meth:`from_csr` (FlashInfer's CSR arrays), :meth:`batch` / :meth:`single` (per-request lists), or
    :meth:`preallocated` then :meth:`update_csr` / :meth:`update`. Array properties return copies; the device
    buffer the kernels read (:meth:`device_buffer`) is only ever filled from validated state. Every constructor
    checks its ``device`` first (:func:`_checked_device`): a value naming no device, or a CUDA device this process
    cannot use, raises PagedWindowError.
    """

    def __init__(self, capacity: PlanCapacity, *, cta_tile_q: int | None, tile_reason: str = "explicit", device=None):
        """Internal: use the constructors below. ``cta_tile_q`` None fixes the tile at the first commit."""
        self.capacity = capacity
        self._tile = cta_tile_q
        self._tile_reason = tile_reason
        self._device = _as_device(device)
        self._state: _PlanState | None = None
        self._version = 0
        self._mirrors: dict[torch.device, _DeviceMirror] = {}
        self._derived: dict = {}  # host-side views computed on demand; cleared at every commit
        self.launch_cache: dict = {}
        """Backends keep per-plan launch arguments here; emptied at every commit."""
        cuda_device = _cuda_device(self._device)
        if cuda_device is not None:
            self._mirror(cuda_device)

    # -- constructors -------------------------------------------------------------------------------------------
    @classmethod
    def from_csr(
        cls,
        qo_indptr,
        kv_indptr,
        kv_indices,
        last_page_len,
        *,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        cta_tile_q=None,
        device=None,
    ) -> PrefillPagedPlan:
        """A plan sized exactly for FlashInfer-style CSR arrays (int32/int64 tensors on any device, numpy arrays
        or lists): ``qo_indptr [batch+1]``, ``kv_indptr [batch+1]``, ``kv_indices [>= kv_indptr[-1]]`` (page ids),
        ``last_page_len [batch]``. ``device`` (default: the device of any CUDA input) is the GPU the plan is for:
        it decides the default tile and receives the plan's buffer now."""
        device = _checked_device(device) or _device_of(qo_indptr, kv_indptr, kv_indices, last_page_len)
        heads = _Heads.checked(num_qo_heads, num_kv_heads, head_dim, page_size)
        tile = None if cta_tile_q is None else _check_tile(cta_tile_q)
        given = (qo_indptr, kv_indptr, kv_indices, last_page_len)
        found = _state_from_device_csr(given, heads, tile, device, None)
        state, reason = found or _state_from_csr(*_csr_arrays(*given), heads, tile, device, given=given)
        return cls._exact(state, reason, device)

    @classmethod
    def batch(
        cls,
        page_indices,
        last_page_lens,
        start_positions,
        seq_lens,
        *,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        cta_tile_q=None,
        device=None,
    ) -> PrefillPagedPlan:
        """A plan sized exactly for these requests: ``page_indices[i]`` (a list, array or tensor) covers exactly
        ``start_positions[i] + seq_lens[i]`` keys and ``last_page_lens[i]`` is its last page's fill."""
        device = _checked_device(device)
        heads = _Heads.checked(num_qo_heads, num_kv_heads, head_dim, page_size)
        tile = None if cta_tile_q is None else _check_tile(cta_tile_q)
        arrays = _csr_from_requests(page_indices, last_page_lens, start_positions, seq_lens, heads.page_size)
        state, reason = _state_from_csr(*arrays, heads, tile, device, page_name=_request_page_name)
        return cls._exact(state, reason, device)

    @classmethod
    def single(cls, pages, last_page_len, start_position, seq_len, **kwargs) -> PrefillPagedPlan:
        """A batch of one request."""
        return cls.batch([pages], [last_page_len], [start_position], [seq_len], **kwargs)

    @classmethod
    def _exact(cls, state: _PlanState, reason: str, device) -> PrefillPagedPlan:
        """A plan sized exactly for validated ``state``, holding it (uploaded to ``device``'s buffer on a GPU)."""
        capacity = _exact_capacity(state.total_tokens, state.total_pages, state.batch_size, state.num_tiles)
        plan = cls(capacity, cta_tile_q=state.cta_tile_q, tile_reason=reason, device=device)
        plan._commit(state)  # uploads to the mirror the constructor made for a CUDA device
        return plan

    @classmethod
    def preallocated(
        cls, *, max_total_tokens, max_total_pages, max_batch, max_tiles, cta_tile_q=None, device=None
    ) -> PrefillPagedPlan:
        """An empty plan with fixed capacity and a fixed tile (``cta_tile_q``, else the policy's pick for this
        capacity on ``device``); fill it with :meth:`update_csr` or :meth:`update`. Device arrays never move."""
        device = _checked_device(device)
        capacity = PlanCapacity.checked("", max_total_tokens, max_total_pages, max_batch, max_tiles)
        if cta_tile_q is None:
            tile, reason = tile_for_capacity(capacity.max_total_tokens, capacity.max_batch, device)
        else:
            tile, reason = _check_tile(cta_tile_q), "explicit"
        return cls(capacity, cta_tile_q=tile, tile_reason=reason, device=device)

    def update_csr(
        self,
        qo_indptr,
        kv_indptr,
        kv_indices,
        last_page_len,
        *,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        cta_tile_q=None,
    ) -> PrefillPagedPlan:
        """Re-plan in place from CSR arrays (as :meth:`from_csr`): validate everything, capacity included, then
        commit. On error nothing changes. The layout uses the plan's fixed tile."""
        heads = _Heads.checked(num_qo_heads, num_kv_heads, head_dim, page_size)
        tile = self._update_tile(cta_tile_q)
        given = (qo_indptr, kv_indptr, kv_indices, last_page_len)
        found = _state_from_device_csr(given, heads, tile, self._device, self.capacity.max_total_pages)
        state, _ = found or _state_from_csr(*_csr_arrays(*given), heads, tile, self._device, given=given)
        state.fits(self.capacity)
        self._commit(state)
        return self

    def update(
        self,
        page_indices,
        last_page_lens,
        start_positions,
        seq_lens,
        *,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        cta_tile_q=None,
    ) -> PrefillPagedPlan:
        """Re-plan in place from per-request lists (as :meth:`batch`); validate, then commit."""
        heads = _Heads.checked(num_qo_heads, num_kv_heads, head_dim, page_size)
        tile = self._update_tile(cta_tile_q)
        arrays = _csr_from_requests(page_indices, last_page_lens, start_positions, seq_lens, heads.page_size)
        state, _ = _state_from_csr(*arrays, heads, tile, self._device, page_name=_request_page_name)
        state.fits(self.capacity)
        self._commit(state)
        return self

    def _update_tile(self, cta_tile_q) -> int | None:
        if cta_tile_q is None:
            return self._tile
        tile = _check_tile(cta_tile_q)
        if tile != self._tile:
            raise PagedWindowError(
                f"update: cta_tile_q = {tile} differs from the plan's fixed tile {self._tile} (a captured launch "
                f"uses that tile); build a new plan for another tile"
            )
        return tile

    # -- state --------------------------------------------------------------------------------------------------
    def _commit(self, state: _PlanState) -> None:
        """Install validated state; upload it to every device mirror (async, current stream)."""
        self._state = state
        self._version += 1
        self._derived = {}
        self.launch_cache = {}
        for mirror in self._mirrors.values():
            self._install(mirror, state)

    def _install(self, mirror: _DeviceMirror, state: _PlanState) -> None:
        """Upload ``state`` to ``mirror`` and give the mirror the split-KV workspace ``state``'s launches need."""
        mirror.upload(state, self.capacity)
        split_floats = _split_kv_unit_floats(state)
        if split_floats:
            mirror.ensure_split_kv(split_floats)

    def _mirror(self, device: torch.device) -> _DeviceMirror:
        mirror = self._mirrors.get(device)
        if mirror is None:
            mirror = _MIRROR_POOL.take(self.capacity, device) or _DeviceMirror(self.capacity, device)
            if not self._mirrors:  # the first mirror: at the plan's end, its mirrors go to the pool
                _pool_at_end(self)
            if self._state is not None:
                self._install(mirror, self._state)
            self._mirrors[device] = mirror
        return mirror

    def split_kv_workspace(self, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a plan at tile ``SPLIT_KV_TILE`` on a GPU: the scratch its split-KV launches use on ``device``,
        ``(partials [units * 16 * (head_dim + 1)] fp32, counters [units] int32, zero between launches)``, made
        with the plan's device buffer and kept at fixed addresses for the plan's life (a captured launch reads
        them after every update). None for other tiles and on the CPU. A unit holds one split's 16 partial rows
        and their 16 log-sum-exps; ``units`` is ``SPLIT_KV_UNITS_PER_SM`` per SM. The kernels' scratch: writing it
        (the counters above all) corrupts the plan's next launches."""
        if not _split_kv_unit_floats(self._require()):
            return None
        mirror = self._mirror_for(device)
        if mirror is None:
            cuda_device = _cuda_device(_checked_device(device))
            if cuda_device is None:
                return None
            mirror = self._mirror(cuda_device)
        return mirror.split_kv  # given by _install with the state

    def device_buffer(self, device) -> torch.Tensor:
        """The whole int32 plan buffer on ``device`` at capacity (segments at ``capacity.segment_offsets()`` in
        :class:`PlanArrays` order). On a GPU: uploaded on first use and at every update, at a fixed address. On
        the CPU: a fresh copy."""
        mirror = self._mirror_for(device)  # the launch path: a tensor's device, already indexed
        if mirror is not None:
            return mirror.buffer
        device = _checked_device(device)
        if device is None:
            raise PagedWindowError("device_buffer: a device is required (the buffer is made on it)")
        if device.type == "cuda":
            cuda_device = _cuda_device(device)
            assert cuda_device is not None  # a CUDA device
            return self._mirror(cuda_device).buffer
        buffer = torch.zeros(self.capacity.buffer_entries, dtype=torch.int32)
        if self._state is not None:
            _scatter_live(self._state, self.capacity, buffer.numpy())
        return buffer

    def _mirror_for(self, device) -> _DeviceMirror | None:
        """The plan's mirror on ``device`` if it has one (any value: one that names no device has none)."""
        try:
            return self._mirrors.get(device)
        except TypeError:  # unhashable: no device, named by the caller's check
            return None

    def device_arrays(self, device) -> PlanArrays:
        """Capacity-sized views of :meth:`device_buffer`."""
        return self._views(self.device_buffer(device))

    def _views(self, buffer: torch.Tensor) -> PlanArrays:
        return PlanArrays(*torch.split(buffer, list(self.capacity.segment_sizes())))

    @property
    def state(self) -> _PlanState:
        """The validated state of the last commit (frozen; its arrays are read-only). Raises if unfilled."""
        return self._require()

    @property
    def filled(self) -> bool:
        """False for a preallocated plan that was never updated."""
        return self._state is not None

    @property
    def version(self) -> int:
        """Increments at every commit (caches keyed on a plan compare it)."""
        return self._version

    @property
    def device(self) -> torch.device | None:
        """The device the plan was made for (decides the default tile); None when it was not given."""
        return self._device

    def _require(self) -> _PlanState:
        if self._state is None:
            raise PagedWindowError("the plan was preallocated but never filled: call plan.update(...) first")
        return self._state

    # -- fields -------------------------------------------------------------------------------------------------
    def _copy(self, name: str) -> torch.Tensor:
        return torch.from_numpy(getattr(self._require(), name).copy())

    page_indices = property(lambda self: self._copy("page_indices"), doc="[total_pages] int32 (a copy)")
    page_indptr = property(lambda self: self._copy("page_indptr"), doc="[batch + 1] int32 (a copy)")
    last_page_len = property(lambda self: self._copy("last_page_len"), doc="[batch] int32 (a copy)")
    qo_indptr = property(lambda self: self._copy("qo_indptr"), doc="[batch + 1] int32 (a copy)")
    request_indices = property(lambda self: self._copy("request_indices"), doc="[num_tiles] int32 (a copy)")
    qo_tile_indices = property(lambda self: self._copy("qo_tile_indices"), doc="[num_tiles] int32 (a copy)")

    batch_size = property(lambda self: self._require().batch_size)
    total_tokens = property(lambda self: self._require().total_tokens)
    total_pages = property(lambda self: self._require().total_pages)
    num_tiles = property(lambda self: self._require().num_tiles)
    head_dim = property(lambda self: self._require().head_dim)
    num_qo_heads = property(lambda self: self._require().num_qo_heads)
    num_kv_heads = property(lambda self: self._require().num_kv_heads)
    page_size = property(lambda self: self._require().page_size)
    max_page_index = property(lambda self: self._require().max_page_index)
    max_last_page_len = property(lambda self: self._require().max_last_page_len)

    @property
    def cta_tile_q(self) -> int:
        """The query tile every layout of this plan uses (fixed at creation)."""
        return self._tile if self._tile is not None else self._require().cta_tile_q

    @property
    def tile_reason(self) -> str:
        """Why the plan has its tile: ``explicit`` or the policy's rule."""
        return self._tile_reason

    @property
    def group_size(self) -> int:
        s = self._require()
        return s.num_qo_heads // s.num_kv_heads

    def _tuple(self, name: str, make) -> tuple:
        self._require()
        if name not in self._derived:
            self._derived[name] = make(self._state)
        return self._derived[name]

    @property
    def start_positions(self) -> tuple[int, ...]:
        return self._tuple("start", lambda s: tuple(s.start_positions.tolist()))

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return self._tuple("seq", lambda s: tuple(np.diff(s.qo_indptr).tolist()))

    @property
    def kv_lens(self) -> tuple[int, ...]:
        return self._tuple("kv", lambda s: tuple((s.start_positions + np.diff(s.qo_indptr)).tolist()))

    @property
    def pages(self) -> tuple[tuple[int, ...], ...]:
        """Each request's page ids."""

        def split(s):
            ids, bounds = s.page_indices.tolist(), s.page_indptr.tolist()
            return tuple(tuple(ids[a:b]) for a, b in zip(bounds, bounds[1:]))

        return self._tuple("pages", split)

    # -- printing and round trips -------------------------------------------------------------------------------
    def __repr__(self) -> str:
        cap = self.capacity
        capacity = (
            f"capacity(tokens={cap.max_total_tokens}, pages={cap.max_total_pages}, "
            f"batch={cap.max_batch}, tiles={cap.max_tiles})"
        )
        if self._state is None:
            return f"PrefillPagedPlan(unfilled, cta_tile_q={self._tile}, {capacity})"
        p = self._state
        return (
            f"PrefillPagedPlan(batch={p.batch_size}, total_tokens={p.total_tokens}, "
            f"pages={p.total_pages}, tiles={p.num_tiles}, cta_tile_q={p.cta_tile_q}, "
            f"heads={p.num_qo_heads}/{p.num_kv_heads}, head_dim={p.head_dim}, page_size={p.page_size}, "
            f"max_page_index={p.max_page_index}, max_last_page_len={p.max_last_page_len}, {capacity})"
        )

    def describe(self) -> str:
        """A multi-line summary: the plan, its tile and why, and one line per request."""
        lines = [repr(self), f"tile: cta_tile_q={self.cta_tile_q} ({self._tile_reason})"]
        if self._state is None:
            return "\n".join(lines)
        p = self._state
        tiles = np.bincount(p.request_indices, minlength=p.batch_size).tolist()
        header = ("req", 4), ("start", 7), ("seq", 6), ("kv_len", 7), ("pages", 6), ("last", 5), ("tiles", 6)
        lines.append(" ".join(f"{name:>{width}}" for name, width in header) + "  page ids")
        for i, (start, seq, kv, ids) in enumerate(zip(self.start_positions, self.seq_lens, self.kv_lens, self.pages)):
            shown = " ".join(map(str, ids[:8])) + (" …" if len(ids) > 8 else "")
            lines.append(
                f"{i:>4} {start:>7} {seq:>6} {kv:>7} {len(ids):>6} {int(p.last_page_len[i]):>5} {tiles[i]:>6}  {shown}"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """A JSON-ready dict: capacity, the fixed tile, the requests, and the derived arrays (for diffing)."""
        cap = self.capacity
        data: dict[str, Any]
        data = {
            "capacity": {
                "max_total_tokens": cap.max_total_tokens,
                "max_total_pages": cap.max_total_pages,
                "max_batch": cap.max_batch,
                "max_tiles": cap.max_tiles,
            },
            "cta_tile_q": self._tile,
        }
        if self._state is None:
            return data
        p = self._state
        data.update(
            {
                "num_qo_heads": p.num_qo_heads,
                "num_kv_heads": p.num_kv_heads,
                "head_dim": p.head_dim,
                "page_size": p.page_size,
                "page_indices": [list(x) for x in self.pages],
                "last_page_lens": p.last_page_len.tolist(),
                "start_positions": list(self.start_positions),
                "seq_lens": list(self.seq_lens),
                "derived": {
                    "page_indptr": p.page_indptr.tolist(),
                    "qo_indptr": p.qo_indptr.tolist(),
                    "request_indices": p.request_indices.tolist(),
                    "qo_tile_indices": p.qo_tile_indices.tolist(),
                    "max_page_index": p.max_page_index,
                    "max_last_page_len": p.max_last_page_len,
                },
            }
        )
        return data

    _REQUEST_KEYS = (
        "num_qo_heads",
        "num_kv_heads",
        "head_dim",
        "page_size",
        "page_indices",
        "last_page_lens",
        "start_positions",
        "seq_lens",
    )
    _CAPACITY_KEYS = ("max_total_tokens", "max_total_pages", "max_batch", "max_tiles")

    @classmethod
    def from_dict(cls, data, *, device=None) -> PrefillPagedPlan:
        """Rebuild a plan from :meth:`to_dict`, re-validating everything (a trust boundary). It takes exactly what
        ``to_dict`` writes: 'capacity' and 'cta_tile_q' (the plan's fixed tile, an int: kept, never re-picked),
        and for a filled plan every request key and 'derived', which must agree with the rebuilt plan. Unknown or
        missing keys, wrong types (None included) and oversized capacities raise PagedWindowError naming the key,
        before anything is allocated. ``device`` is checked first, as by every constructor."""
        device = _checked_device(device)
        if not isinstance(data, Mapping):
            raise PagedWindowError(f"from_dict: expected a dict, got {type(data).__name__}")
        known = {"capacity", "cta_tile_q", "derived", *cls._REQUEST_KEYS}
        unknown = sorted(map(str, set(data) - known))
        if unknown:
            raise PagedWindowError(f"from_dict: unknown key(s) {unknown}")
        capacity = data.get("capacity")
        if not isinstance(capacity, Mapping):
            raise PagedWindowError(
                f"from_dict: 'capacity' must be a dict with keys {list(cls._CAPACITY_KEYS)}, "
                f"got {type(capacity).__name__}"
            )
        if set(capacity) != set(cls._CAPACITY_KEYS):
            raise PagedWindowError(
                f"from_dict: 'capacity' has keys {sorted(map(str, capacity))}; expected {sorted(cls._CAPACITY_KEYS)}"
            )
        if "cta_tile_q" not in data:
            raise PagedWindowError("from_dict: missing 'cta_tile_q' (the plan's fixed tile)")
        present = any(k in data for k in cls._REQUEST_KEYS)
        if present:
            missing = [k for k in (*cls._REQUEST_KEYS, "derived") if k not in data]
            if missing:
                raise PagedWindowError(f"from_dict: a filled plan needs every request key; missing {missing}")
            recorded = _derived_form(data["derived"])
        elif "derived" in data:
            raise PagedWindowError("from_dict: 'derived' arrays given for a plan with no requests")
        try:
            checked = PlanCapacity.checked("capacity.", *(capacity[k] for k in cls._CAPACITY_KEYS))
            tile = _check_tile(data["cta_tile_q"])  # never None: that would ask the policy again
            plan = cls.preallocated(
                **{k: getattr(checked, k) for k in cls._CAPACITY_KEYS}, cta_tile_q=tile, device=device
            )
            if not present:
                return plan
            plan.update(
                data["page_indices"],
                data["last_page_lens"],
                data["start_positions"],
                data["seq_lens"],
                num_qo_heads=data["num_qo_heads"],
                num_kv_heads=data["num_kv_heads"],
                head_dim=data["head_dim"],
                page_size=data["page_size"],
            )
        except PagedWindowError as exc:
            raise PagedWindowError(f"from_dict: {exc}") from None
        except (TypeError, ValueError, KeyError, OverflowError, AttributeError) as exc:
            raise PagedWindowError(f"from_dict: malformed plan dict ({type(exc).__name__}: {exc})") from None
        if recorded != plan.to_dict()["derived"]:
            raise PagedWindowError("from_dict: the recorded 'derived' arrays disagree with the rebuilt plan")
        return plan

    def __eq__(self, other) -> bool:
        return isinstance(other, PrefillPagedPlan) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable (update)


def _csr_arrays(qo_indptr, kv_indptr, kv_indices, last_page_len) -> _CsrArrays:
    given = (qo_indptr, kv_indptr, kv_indices, last_page_len)
    host = _read_cuda_csr(given)
    if host is not None:
        return host
    return (
        int_array("qo_indptr", qo_indptr),
        int_array("kv_indptr", kv_indptr),
        int_array("kv_indices", kv_indices),
        int_array("last_page_len", last_page_len),
    )


def _read_cuda_csr(given) -> _CsrArrays | None:
    """Four 1-D CUDA integer tensors of one dtype on one device, read to the host in one copy (one
    synchronisation instead of four) as views of one array; None for anything else (read one by one, with
    every check of ``int_array``)."""
    first = given[0]
    if not (isinstance(first, torch.Tensor) and first.is_cuda and first.dtype in _CUDA_CSR_DTYPES):
        return None
    for t in given:
        if not (isinstance(t, torch.Tensor) and t.device == first.device and t.dtype == first.dtype and t.dim() == 1):
            return None
    block = torch.cat([t.detach() for t in given]).cpu().numpy()  # [sum of lengths]
    ends = np.cumsum([len(t) for t in given])
    qo_indptr, kv_indptr, kv_indices, last_page_len = np.split(block, ends[:-1])
    return qo_indptr, kv_indptr, kv_indices, last_page_len


_CUDA_CSR_DTYPES = (torch.int32, torch.int64)
