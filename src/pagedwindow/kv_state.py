"""Paged KV state of a batch of requests across every layer of a model, driven through pagedwindow's public API.

One concept: the resident KV of ``batch_size`` requests. Each *step* gives every request ``seq_i >= 0`` new tokens
(prefill chunk, or one token in decode); every layer then is fed once with the step's new rows (concatenated in
request order), by one of:

- :meth:`PagedKvState.attend` (q/k/v after Gemma's norms and RoPE): the K/V are appended into the pool with
  ``pagedwindow.append_paged_kv``, attention is read with ``pagedwindow.batch_prefill_paged_window``;
- :meth:`PagedKvState.prepare_and_attend` (the projections before the norms): ``pagedwindow.prepare_paged_qkv``
  norms and rotates them and writes K/V into the same slots, then the same attention read (nothing is appended
  twice); :meth:`PagedKvState.prepare` is the prep alone (what the prep oracle compares).

Both read through a ``PrefillPagedPlan`` whose ``start_i`` is what request i already holds. Positions therefore
come from this state, never from whatever key tensor a caller happens to hold (HF's sliding layers hand over only
the last W keys). A layer counts as fed once its call returned: a call that raised (nothing written: every op
checks before it writes, and the attention's checks run before the step's pool write) may be retried.
It knows nothing of any model: ``pagedwindow.hf`` drives it from HF's attention calls, ``pagedwindow.measure``
from captured q/k/v.

Pages: one page table per request, shared by all layers (the pool layout holds every layer of a page). Layers are
grouped by (num_kv_heads, head_dim) — Gemma 4's full layers may differ from its sliding ones — and each group has
its own pool with the same page count, so one page id means the same slots in every group. Page ids are handed
out from a seeded random permutation (shuffled, never contiguous by accident); when the pool runs out it grows
(copying the old pages). Fresh pools are poisoned with NaN, so a read of a slot nobody wrote shows up as NaN.

Chunk schedules, the one place they are checked: a request's prompt is fed in chunks (:func:`prompt_chunks`,
:func:`prefix_chunks`), and step ``s`` feeds chunk ``s`` of every request that has one (:func:`chunk_steps`).
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .api import append_paged_kv, batch_prefill_paged_window, check_batch_prefill_paged_window, prepare_paged_qkv
from .errors import NOT_INT_SEQUENCES, PagedWindowError, checked_i32, checked_i32_array, checked_int, int_array
from .layout import PagedKvLayout
from .plan import PrefillPagedPlan


def _lengths(what: str, values, *, minimum: int | None = 0) -> list[int]:
    """``values`` (a sequence, numpy array or tensor of integers) as a list of int32-sized Python ints, each at least
    ``minimum``: the one check every list of lengths goes through (bools, floats, strings refused)."""
    return checked_i32_array(what, int_array(what, values), minimum=minimum).tolist()


def prompt_chunks(prompt_lens, chunks=None, *, what: str = "") -> tuple[tuple[int, ...], ...]:
    """Per request, the chunk sizes its prompt is fed in, checked: one list per prompt, every chunk at least one
    token, a prompt's chunks summing to its length. ``chunks=None`` feeds each prompt in one chunk. ``what``
    (e.g. ``"case short: "``) starts the error's message."""
    lens = _lengths(f"{what}prompt_lens", prompt_lens, minimum=None)
    if any(n < 1 for n in lens):
        raise PagedWindowError(f"{what}prompt lengths {lens} must each be at least one token")
    if chunks is None:
        return tuple((n,) for n in lens)
    if isinstance(chunks, NOT_INT_SEQUENCES) or not isinstance(chunks, Sequence):
        raise PagedWindowError(f"{what}chunks must be one sequence of chunk sizes per prompt, got {chunks!r}")
    chunks = tuple(tuple(_lengths(f"{what}chunks[{i}]", c, minimum=None)) for i, c in enumerate(chunks))
    if len(chunks) != len(lens):
        raise PagedWindowError(f"{what}{len(chunks)} chunk lists for {len(lens)} prompts")
    for n, c in zip(lens, chunks):
        if sum(c) != n or any(x < 1 for x in c):
            raise PagedWindowError(f"{what}chunks {c} do not split a prompt of {n} tokens")
    return chunks


def prefix_chunks(prompt_len: int, prefix_len: int) -> tuple[int, ...]:
    """A prompt fed as a prefix then the rest on top of it: ``(prompt_len,)`` for ``prefix_len == 0``, else
    ``(prefix_len, prompt_len - prefix_len)``; ``prefix_len`` must be in ``[0, prompt_len)``."""
    prompt_len, prefix_len = checked_int("prompt_len", prompt_len), checked_int("prefix_len", prefix_len)
    if not 0 <= prefix_len < prompt_len:
        raise PagedWindowError(f"prefix_len = {prefix_len} must be in [0, prompt_len = {prompt_len})")
    return (prompt_len,) if prefix_len == 0 else (prefix_len, prompt_len - prefix_len)


def chunk_steps(chunks) -> list[list[int]]:
    """Per step, per request, its new tokens: step ``s`` feeds chunk ``s`` of every request that has one, 0 to
    the others (``chunks`` as :func:`prompt_chunks` returns them)."""
    steps = max((len(c) for c in chunks), default=0)
    return [[c[s] if s < len(c) else 0 for c in chunks] for s in range(steps)]


def _layer_geometry(layers) -> list[tuple[int, int]]:
    """``layers`` checked: per model layer a ``(num_kv_heads, head_dim)`` pair of positive int32s."""
    try:
        pairs = [tuple(pair) for pair in layers]
    except TypeError:
        raise PagedWindowError(f"PagedKvState: layers must be (num_kv_heads, head_dim) pairs, got {layers!r}") from None
    geom = []
    for i, pair in enumerate(pairs):
        what = f"PagedKvState: layers[{i}]"
        if len(pair) != 2:
            raise PagedWindowError(f"{what} = {pair} is not a (num_kv_heads, head_dim) pair")
        h = checked_i32(f"{what} num_kv_heads", pair[0], minimum=1)
        geom.append((h, checked_i32(f"{what} head_dim", pair[1], minimum=1)))
    return geom


@dataclass(frozen=True)
class StepInfo:
    """The current step: per request, tokens already resident (``start``) and new tokens (``seq``)."""

    index: int
    start: tuple
    seq: tuple

    @property
    def active(self) -> tuple:
        """Requests with at least one new token this step (the plan's requests, in order)."""
        return tuple(i for i, n in enumerate(self.seq) if n > 0)

    @property
    def total_tokens(self) -> int:
        return sum(self.seq)


class _Group:
    """The layers sharing one (num_kv_heads, head_dim): one layout, one pool."""

    def __init__(self, layers: list, num_kv_heads: int, head_dim: int, page_size: int):
        self.layers = layers  # model layer indices, in order
        self.layout = PagedKvLayout(len(layers), num_kv_heads, head_dim, page_size)
        self.pool: torch.Tensor | None = None

    def local(self, layer: int) -> int:
        return self.layers.index(layer)


def _pools_undone_on_refusal(feed):
    """Decorates a feed (attend, prepare, prepare_and_attend): a refused feed that allocated the pools (the state's
    first) takes them back, so the state is as it was and a retry may bring K/V of another dtype or device."""

    @functools.wraps(feed)
    def guarded(self, *args, **kwargs):
        fresh = self.dtype is None
        try:
            return feed(self, *args, **kwargs)
        except PagedWindowError:
            if fresh:
                self._drop_pools()
            raise

    return guarded


class PagedKvState:
    """Resident KV of a batch of requests, every layer, in pagedwindow pools.

    layers: per model layer, ``(num_kv_heads, head_dim)``. backend: passed to both pagedwindow calls.
    Every integer argument (sizes, lengths, layer and request indices) is checked before anything changes: bools,
    floats, strings and None are refused with a ``PagedWindowError`` (numpy integers are accepted), and a refused
    call leaves the state as it was.
    """

    def __init__(
        self,
        layers,
        *,
        page_size: int = 16,
        backend: str = "auto",
        seed: int = 0,
        initial_pages: int = 64,
        poison: bool = True,
    ):
        self.page_size = checked_i32("PagedKvState: page_size", page_size, minimum=1)
        self._initial_pages = checked_i32("PagedKvState: initial_pages", initial_pages, minimum=1)
        self._layer_geom = _layer_geometry(layers)
        self.backend = backend
        self.poison = poison
        self._rng = random.Random(seed)
        groups: dict = {}
        for idx, key in enumerate(self._layer_geom):
            groups.setdefault(key, []).append(idx)
        self._groups = {key: _Group(idx, key[0], key[1], self.page_size) for key, idx in groups.items()}
        self._group_of = {idx: self._groups[key] for key, idx_list in groups.items() for idx in idx_list}
        self.num_pages = 0
        self._free: list = []
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        self.batch_size = 0
        self.kv_lens: list = []
        self.pages: list = []
        self.step: StepInfo | None = None
        self._step_count = 0
        self._attended: set = set()
        self._plans: dict = {}
        self.plans_built = 0
        self.attend_calls = 0  # layer feeds: attend, prepare, prepare_and_attend
        self.prep_calls = 0  # of them, through prepare_paged_qkv

    # ----------------------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self._layer_geom)

    def _layer(self, what: str, layer: int) -> int:
        """``layer`` checked: an integer (not a bool) in ``[0, num_layers)``."""
        layer = checked_int(f"{what}: layer", layer)
        if not 0 <= layer < self.num_layers:
            raise PagedWindowError(f"{what}: layer {layer} out of range [0, {self.num_layers})")
        return layer

    def layout(self, layer: int) -> PagedKvLayout:
        return self._group_of[self._layer("layout", layer)].layout

    def pool(self, layer: int) -> torch.Tensor | None:
        return self._group_of[self._layer("pool", layer)].pool

    def reset(self, batch_size: int) -> None:
        """Forget every request; start ``batch_size`` empty ones. Pages go back to the free list and the pools go
        too: the next feed allocates them afresh (poisoned, in its K/V's dtype), so a reused page never shows an
        old request's K/V and a new sequence may change dtype or device."""
        batch_size = checked_i32("reset: batch_size", batch_size, minimum=1)
        for pages in self.pages:
            self._free.extend(pages)
        self._rng.shuffle(self._free)
        self._drop_pools()
        self.batch_size = batch_size
        self.kv_lens = [0] * self.batch_size
        self.pages = [[] for _ in range(self.batch_size)]
        self.step = None
        self._attended = set()
        self._plans = {}

    # ----------------------------------------------------------------------------------------------------------
    def _grow(self, need: int) -> None:
        """Make at least ``need`` free pages available (new ids shuffled into the free list). The larger pools are
        allocated before anything changes, so an allocation that fails (out of memory) leaves the state as it
        was."""
        if len(self._free) >= need:
            return
        old = self.num_pages
        new = max(self._initial_pages, 2 * old, old + need - len(self._free))
        pools = [] if self.dtype is None else self._pools(new, self.dtype, self.device)
        fresh = list(range(old, new))
        self._rng.shuffle(fresh)
        self._free = fresh + self._free
        self.num_pages = new
        for group, pool in pools:
            group.pool = pool

    def _pools(self, num_pages: int, dtype, device) -> list[tuple[_Group, torch.Tensor]]:
        """Per group, a pool of ``num_pages`` in ``dtype`` on ``device`` (NaN-poisoned when asked) holding the
        group's current pool, if any, in its first pages; the groups keep their pools until the caller swaps."""
        pools = []
        for group in self._groups.values():
            pool = group.layout.allocate(num_pages, dtype, device)
            if self.poison:
                pool.fill_(float("nan"))
            if group.pool is not None:
                pool[: group.pool.shape[0]].copy_(group.pool)
            pools.append((group, pool))
        return pools

    def _drop_pools(self) -> None:
        self.dtype = self.device = None
        for group in self._groups.values():
            group.pool = None

    def _materialize(self, dtype: torch.dtype, device: torch.device) -> None:
        if self.dtype is None:
            pools = self._pools(self.num_pages, dtype, device)  # every pool allocated before anything changes
            self.dtype, self.device = dtype, device
            for group, pool in pools:
                group.pool = pool
        elif (dtype, device) != (self.dtype, self.device):
            raise PagedWindowError(f"paged state holds {self.dtype} on {self.device}, got K/V in {dtype} on {device}")

    # ----------------------------------------------------------------------------------------------------------
    def begin_step(self, seq_lens) -> StepInfo:
        """Start a step: request i gets ``seq_lens[i]`` new tokens. Allocates the pages they need.

        Every layer that attended in the previous step must have attended exactly once (no layer skipped).
        """
        seq = _lengths("begin_step: seq_lens", seq_lens)
        if len(seq) != self.batch_size:
            raise PagedWindowError(f"begin_step: {len(seq)} seq_lens for a batch of {self.batch_size}")
        self._check_step_complete()
        start = tuple(self.kv_lens)
        need = [math.ceil((s + n) / self.page_size) - len(p) for s, n, p in zip(start, seq, self.pages)]
        self._grow(sum(need))
        for i, n in enumerate(need):
            for _ in range(n):
                self.pages[i].append(self._free.pop())
        self.kv_lens = [s + n for s, n in zip(start, seq)]
        self.step = StepInfo(index=self._step_count, start=start, seq=tuple(seq))
        self._step_count += 1
        self._attended = set()
        self._plans = {}
        return self.step

    def _check_step_complete(self) -> None:
        if self.step is not None and self.step.total_tokens > 0 and len(self._attended) != self.num_layers:
            missing = sorted(set(range(self.num_layers)) - self._attended)
            raise PagedWindowError(f"step {self.step.index}: layers {missing} never attended")

    @property
    def fed_layers(self) -> frozenset:
        """The layers fed in the current step."""
        return frozenset(self._attended)

    def abandon_step(self) -> None:
        """Take back the current step before any layer was fed in it (e.g. a forward refused at its first layer):
        the requests hold what they held before it and the pages it added go back to the free list. Refused once a
        layer was fed (its rows are in the pool)."""
        step = self._require_step()
        if self._attended:
            raise PagedWindowError(f"abandon_step: step {step.index} already fed layers {sorted(self._attended)}")
        for pages, start in zip(self.pages, step.start):
            held = math.ceil(start / self.page_size)  # the pages before the step: they cover exactly its start
            self._free.extend(pages[held:])
            del pages[held:]
        self.kv_lens = list(step.start)
        self.step = None
        self._plans = {}

    def plan_for(self, num_qo_heads: int, num_kv_heads: int, head_dim: int) -> PrefillPagedPlan:
        """The step's plan for one head geometry (built once per step, shared by the layers using it)."""
        step = self._require_step()
        key = (
            checked_i32("plan_for: num_qo_heads", num_qo_heads, minimum=1),
            checked_i32("plan_for: num_kv_heads", num_kv_heads, minimum=1),
            checked_i32("plan_for: head_dim", head_dim, minimum=1),
        )
        if key not in self._plans:
            act = step.active
            kv = [step.start[i] + step.seq[i] for i in act]
            page_lists = [list(self.pages[i]) for i in act]
            lasts = [k - (len(p) - 1) * self.page_size for k, p in zip(kv, page_lists)]
            self._plans[key] = PrefillPagedPlan.batch(
                page_lists,
                lasts,
                [step.start[i] for i in act],
                [step.seq[i] for i in act],
                num_qo_heads=key[0],
                num_kv_heads=key[1],
                head_dim=key[2],
                page_size=self.page_size,
            )
            self.plans_built += 1
        return self._plans[key]

    def _require_step(self) -> StepInfo:
        if self.step is None:
            raise PagedWindowError("paged state: no step begun (call begin_step)")
        return self.step

    def _feed(self, what: str, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Check one layer's rows for this step (a layer is fed once per step: a second feed is an error).
        Returns ``(layer, pool group, plan, local layer)`` (``layer`` as checked, a Python int), or None for a step
        without new rows (the layer is then marked fed at once; otherwise the caller marks it with :meth:`_fed` when
        its ops returned)."""
        step = self._require_step()
        layer = self._layer(what, layer)
        if layer in self._attended:
            raise PagedWindowError(f"{what}: layer {layer} already attended in step {step.index} (double feed?)")
        hkv, d = self._layer_geom[layer]
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise PagedWindowError(f"{what}: q/k/v must be [T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}")
        if tuple(k.shape[1:]) != (hkv, d) or tuple(v.shape[1:]) != (hkv, d):
            raise PagedWindowError(f"{what}: layer {layer} k/v {tuple(k.shape)} must be [T, {hkv}, {d}]")
        if q.shape[0] != step.total_tokens or k.shape[0] != step.total_tokens or v.shape[0] != step.total_tokens:
            raise PagedWindowError(
                f"{what}: layer {layer} got {q.shape[0]} q / {k.shape[0]} k rows for a step of {step.total_tokens}"
            )
        if step.total_tokens == 0:
            self._fed(layer)
            return None
        self._materialize(k.dtype, k.device)
        group = self._group_of[layer]
        return layer, group, self.plan_for(int(q.shape[1]), hkv, d), group.local(layer)

    def _fed(self, layer: int) -> None:
        self._attended.add(layer)
        self.attend_calls += 1

    @_pools_undone_on_refusal
    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float, window_left: int
    ) -> torch.Tensor:
        """Append this step's new K/V of ``layer`` and attend: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` with the
        active requests' rows concatenated in request order (T = step total). Returns ``[T, Hq, D]``."""
        fed = self._feed("attend", layer, q, k, v)
        if fed is None:
            return q.new_empty(q.shape)
        layer, group, plan, local = fed
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        check_batch_prefill_paged_window(  # before any write
            q, group.pool, group.layout, local, plan, sm_scale=sm_scale, window_left=window_left, backend=self.backend
        )
        append_paged_kv(k, v, group.pool, group.layout, local, plan, backend=self.backend)
        out = batch_prefill_paged_window(
            q, group.pool, group.layout, local, plan, sm_scale=sm_scale, window_left=window_left, backend=self.backend
        )
        self._fed(layer)
        return out

    @_pools_undone_on_refusal
    def prepare(
        self,
        layer: int,
        q_proj: torch.Tensor,
        k_proj: torch.Tensor,
        v_proj: torch.Tensor,
        *,
        q_norm_weight: torch.Tensor,
        k_norm_weight: torch.Tensor,
        eps: float,
        rope_theta: float,
        norm_style: str,
        rope_position_factor: float = 1.0,
    ) -> torch.Tensor:
        """Gemma's prep of ``layer`` for this step, with ``pagedwindow.prepare_paged_qkv``: the normed, rotated K
        and the normed V of the new rows land in their slots (positions from this state: ``start_i + j``), and
        the normed, rotated q comes back (``[T, Hq, D]``). q_proj ``[T, Hq, D]``, k_proj/v_proj ``[T, Hkv, D]``:
        the projections before the norms, rows as in :meth:`attend`. Feeds the layer: an :meth:`attend` of it in
        the same step is a double feed."""
        fed = self._feed("prepare", layer, q_proj, k_proj, v_proj)
        if fed is None:
            return q_proj.new_empty(q_proj.shape)
        q = self._prepare(
            fed,
            q_proj,
            k_proj,
            v_proj,
            q_norm_weight=q_norm_weight,
            k_norm_weight=k_norm_weight,
            eps=eps,
            rope_theta=rope_theta,
            norm_style=norm_style,
            rope_position_factor=rope_position_factor,
        )
        self._fed(fed[0])
        return q

    def _prepare(self, fed, q_proj, k_proj, v_proj, **prep) -> torch.Tensor:
        _, group, plan, local = fed
        q = prepare_paged_qkv(
            q_proj.contiguous(),
            k_proj.contiguous(),
            v_proj.contiguous(),
            group.pool,
            group.layout,
            local,
            plan,
            **prep,
            backend=self.backend,
        )
        self.prep_calls += 1
        return q

    @_pools_undone_on_refusal
    def prepare_and_attend(
        self,
        layer: int,
        q_proj: torch.Tensor,
        k_proj: torch.Tensor,
        v_proj: torch.Tensor,
        *,
        q_norm_weight: torch.Tensor,
        k_norm_weight: torch.Tensor,
        eps: float,
        rope_theta: float,
        norm_style: str,
        rope_position_factor: float = 1.0,
        sm_scale: float,
        window_left: int,
    ) -> torch.Tensor:
        """:meth:`prepare` then attention over the pool with the same plan — the prep has already written this
        step's K/V, so nothing is appended twice. Inputs as :meth:`prepare`; returns ``[T, Hq, D]`` like
        :meth:`attend`."""
        fed = self._feed("prepare_and_attend", layer, q_proj, k_proj, v_proj)
        if fed is None:
            return q_proj.new_empty(q_proj.shape)
        layer, group, plan, local = fed
        # The attention's checks before the prep writes: q_proj stands for the prepared q (the prep refuses a
        # q_proj of another shape, dtype or device than the q it returns, and the returned q is a fresh tensor).
        check_batch_prefill_paged_window(
            q_proj,
            group.pool,
            group.layout,
            local,
            plan,
            sm_scale=sm_scale,
            window_left=window_left,
            backend=self.backend,
        )
        q = self._prepare(
            fed,
            q_proj,
            k_proj,
            v_proj,
            q_norm_weight=q_norm_weight,
            k_norm_weight=k_norm_weight,
            eps=eps,
            rope_theta=rope_theta,
            norm_style=norm_style,
            rope_position_factor=rope_position_factor,
        )  # [T, Hq, D]
        out = batch_prefill_paged_window(
            q, group.pool, group.layout, local, plan, sm_scale=sm_scale, window_left=window_left, backend=self.backend
        )
        self._fed(layer)
        return out

    def read_kv(self, layer: int, request: int, lo: int = 0, hi: int | None = None) -> tuple:
        """Copies of the K and V ``layer`` holds for ``request`` at positions ``lo .. hi - 1`` (``hi`` None: all
        it holds), each ``[hi - lo, Hkv, D]``, read from the pool slots (a slot nobody wrote reads NaN)."""
        layer = self._layer("read_kv", layer)
        request = checked_int("read_kv: request", request)
        if not 0 <= request < self.batch_size:
            raise PagedWindowError(f"read_kv: request {request} out of range [0, {self.batch_size})")
        held = self.kv_lens[request]
        lo = checked_int("read_kv: lo", lo)
        hi = held if hi is None else checked_int("read_kv: hi", hi)
        if not 0 <= lo <= hi <= held:
            raise PagedWindowError(f"read_kv: positions [{lo}, {hi}) are not within the {held} request {request} holds")
        group = self._group_of[layer]
        if group.pool is None:
            raise PagedWindowError("read_kv: no K/V was written yet")
        pos = torch.arange(lo, hi)  # [n]
        pages = torch.tensor(self.pages[request], dtype=torch.long)[pos // self.page_size]  # [n]
        slots = pos % self.page_size  # [n]
        local = group.local(layer)
        pages, slots = pages.to(group.pool.device), slots.to(group.pool.device)
        k = group.pool[pages, local, 0, slots].clone()  # [n, Hkv, D]
        v = group.pool[pages, local, 1, slots].clone()  # [n, Hkv, D]
        return k, v

    def describe(self) -> dict:
        return {
            "batch_size": self.batch_size,
            "kv_lens": list(self.kv_lens),
            "page_size": self.page_size,
            "num_pages": self.num_pages,
            "pages": [list(p) for p in self.pages],
            "groups": {f"hkv{h}_d{d}": g.layers for (h, d), g in self._groups.items()},
            "steps": self._step_count,
            "plans_built": self.plans_built,
            "attend_calls": self.attend_calls,
            "prep_calls": self.prep_calls,
        }
