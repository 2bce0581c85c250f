"""Paged KV state of a batch of requests across every layer of a model, driven through pagedwindow's public API.

One concept: the resident KV of ``batch_size`` requests. Each *step* gives every request ``seq_i >= 0`` new tokens
(prefill chunk, or one token in decode); every layer then calls :meth:`PagedKvState.attend` once with the step's
new q/k/v rows (concatenated in request order): the K/V are appended into the pool with
``pagedwindow.append_paged_kv`` and attention is read with ``pagedwindow.batch_prefill_paged_window`` through a
``PrefillPagedPlan`` whose ``start_i`` is what request i already holds. Positions therefore come from this state,
never from whatever key tensor a caller happens to hold (HF's sliding layers hand over only the last W keys).
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

import math
import random
from dataclasses import dataclass

import torch

from .api import append_paged_kv, batch_prefill_paged_window
from .errors import PagedWindowError
from .layout import PagedKvLayout
from .plan import PrefillPagedPlan


def prompt_chunks(prompt_lens, chunks=None, *, what: str = "") -> tuple[tuple[int, ...], ...]:
    """Per request, the chunk sizes its prompt is fed in, checked: one list per prompt, every chunk at least one
    token, a prompt's chunks summing to its length. ``chunks=None`` feeds each prompt in one chunk. ``what``
    (e.g. ``"case short: "``) starts the error's message."""
    lens = [int(n) for n in prompt_lens]
    if chunks is None:
        return tuple((n,) for n in lens)
    chunks = tuple(tuple(int(x) for x in c) for c in chunks)
    if len(chunks) != len(lens):
        raise PagedWindowError(f"{what}{len(chunks)} chunk lists for {len(lens)} prompts")
    for n, c in zip(lens, chunks):
        if sum(c) != n or any(x < 1 for x in c):
            raise PagedWindowError(f"{what}chunks {c} do not split a prompt of {n} tokens")
    return chunks


def prefix_chunks(prompt_len: int, prefix_len: int) -> tuple[int, ...]:
    """A prompt fed as a prefix then the rest on top of it: ``(prompt_len,)`` for ``prefix_len == 0``, else
    ``(prefix_len, prompt_len - prefix_len)``; ``prefix_len`` must be in ``[0, prompt_len)``."""
    if not 0 <= prefix_len < prompt_len:
        raise PagedWindowError(f"prefix_len = {prefix_len} must be in [0, prompt_len = {prompt_len})")
    return (prompt_len,) if prefix_len == 0 else (prefix_len, prompt_len - prefix_len)


def chunk_steps(chunks) -> list[list[int]]:
    """Per step, per request, its new tokens: step ``s`` feeds chunk ``s`` of every request that has one, 0 to
    the others (``chunks`` as :func:`prompt_chunks` returns them)."""
    steps = max((len(c) for c in chunks), default=0)
    return [[c[s] if s < len(c) else 0 for c in chunks] for s in range(steps)]


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


class PagedKvState:
    """Resident KV of a batch of requests, every layer, in pagedwindow pools.

    layers: per model layer, ``(num_kv_heads, head_dim)``. backend: passed to both pagedwindow calls.
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
        self.page_size = int(page_size)
        if self.page_size < 1:
            raise PagedWindowError(f"page_size = {page_size} must be >= 1")
        self.backend = backend
        self.poison = poison
        self._rng = random.Random(seed)
        self._layer_geom = [(int(h), int(d)) for h, d in layers]
        groups: dict = {}
        for idx, key in enumerate(self._layer_geom):
            groups.setdefault(key, []).append(idx)
        self._groups = {key: _Group(idx, key[0], key[1], self.page_size) for key, idx in groups.items()}
        self._group_of = {idx: self._groups[key] for key, idx_list in groups.items() for idx in idx_list}
        self.num_pages = 0
        self._initial_pages = max(1, int(initial_pages))
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
        self.attend_calls = 0

    # ----------------------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self._layer_geom)

    def layout(self, layer: int) -> PagedKvLayout:
        return self._group_of[layer].layout

    def pool(self, layer: int) -> torch.Tensor | None:
        return self._group_of[layer].pool

    def reset(self, batch_size: int) -> None:
        """Forget every request; start ``batch_size`` empty ones (pages go back to the free list)."""
        if batch_size < 1:
            raise PagedWindowError(f"batch_size = {batch_size} must be >= 1")
        for pages in self.pages:
            self._free.extend(pages)
        self._rng.shuffle(self._free)
        self.batch_size = int(batch_size)
        self.kv_lens = [0] * self.batch_size
        self.pages = [[] for _ in range(self.batch_size)]
        self.step = None
        self._attended = set()
        self._plans = {}

    # ----------------------------------------------------------------------------------------------------------
    def _grow(self, need: int) -> None:
        """Make at least ``need`` free pages available (new ids shuffled into the free list)."""
        if len(self._free) >= need:
            return
        old = self.num_pages
        new = max(self._initial_pages, 2 * old, old + need - len(self._free))
        fresh = list(range(old, new))
        self._rng.shuffle(fresh)
        self._free = fresh + self._free
        self.num_pages = new
        if self.dtype is not None:
            for group in self._groups.values():
                self._resize_pool(group)

    def _resize_pool(self, group: _Group) -> None:
        pool = group.layout.allocate(self.num_pages, self.dtype, self.device)
        if self.poison:
            pool.fill_(float("nan"))
        if group.pool is not None:
            pool[: group.pool.shape[0]].copy_(group.pool)
        group.pool = pool

    def _materialize(self, dtype: torch.dtype, device: torch.device) -> None:
        if self.dtype is None:
            self.dtype, self.device = dtype, device
            for group in self._groups.values():
                self._resize_pool(group)
        elif (dtype, device) != (self.dtype, self.device):
            raise PagedWindowError(f"paged state holds {self.dtype} on {self.device}, got K/V in {dtype} on {device}")

    # ----------------------------------------------------------------------------------------------------------
    def begin_step(self, seq_lens) -> StepInfo:
        """Start a step: request i gets ``seq_lens[i]`` new tokens. Allocates the pages they need.

        Every layer that attended in the previous step must have attended exactly once (no layer skipped).
        """
        seq = [int(n) for n in seq_lens]
        if len(seq) != self.batch_size:
            raise PagedWindowError(f"begin_step: {len(seq)} seq_lens for a batch of {self.batch_size}")
        if any(n < 0 for n in seq):
            raise PagedWindowError(f"begin_step: negative seq_len in {seq}")
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
        if (
            self.step is not None
            and self.step.total_tokens > 0
            and self._attended
            and len(self._attended) != self.num_layers
        ):
            missing = sorted(set(range(self.num_layers)) - self._attended)
            raise PagedWindowError(f"step {self.step.index}: layers {missing} never attended")

    def plan_for(self, num_qo_heads: int, num_kv_heads: int, head_dim: int) -> PrefillPagedPlan:
        """The step's plan for one head geometry (built once per step, shared by the layers using it)."""
        step = self._require_step()
        key = (num_qo_heads, num_kv_heads, head_dim)
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
                num_qo_heads=num_qo_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                page_size=self.page_size,
            )
            self.plans_built += 1
        return self._plans[key]

    def _require_step(self) -> StepInfo:
        if self.step is None:
            raise PagedWindowError("paged state: no step begun (call begin_step)")
        return self.step

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float, window_left: int
    ) -> torch.Tensor:
        """Append this step's new K/V of ``layer`` and attend: q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` with the
        active requests' rows concatenated in request order (T = step total). Returns ``[T, Hq, D]``."""
        step = self._require_step()
        if not 0 <= layer < self.num_layers:
            raise PagedWindowError(f"attend: layer {layer} out of range [0, {self.num_layers})")
        if layer in self._attended:
            raise PagedWindowError(f"attend: layer {layer} already attended in step {step.index} (double feed?)")
        hkv, d = self._layer_geom[layer]
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise PagedWindowError(f"attend: q/k/v must be [T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}")
        if tuple(k.shape[1:]) != (hkv, d) or tuple(v.shape[1:]) != (hkv, d):
            raise PagedWindowError(f"attend: layer {layer} k/v {tuple(k.shape)} must be [T, {hkv}, {d}]")
        if q.shape[0] != step.total_tokens or k.shape[0] != step.total_tokens or v.shape[0] != step.total_tokens:
            raise PagedWindowError(
                f"attend: layer {layer} got {q.shape[0]} q / {k.shape[0]} k rows for a step of {step.total_tokens}"
            )
        self._attended.add(layer)
        self.attend_calls += 1
        if step.total_tokens == 0:
            return q.new_empty(q.shape)
        self._materialize(k.dtype, k.device)
        group = self._group_of[layer]
        plan = self.plan_for(int(q.shape[1]), hkv, d)
        local = group.local(layer)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        append_paged_kv(k, v, group.pool, group.layout, local, plan, backend=self.backend)
        return batch_prefill_paged_window(
            q, group.pool, group.layout, local, plan, sm_scale=sm_scale, window_left=window_left, backend=self.backend
        )

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
        }
