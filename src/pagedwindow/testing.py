"""What the test suite, the benchmarks and the notebooks' measurements share: random paged batches, the dense
attention every backend is judged against, the kernels' tolerance rule, and the GPU suite's kernel cases.

- :func:`random_pages` / :func:`pages_in_turn`: each request's KV paged on ids taken in turn from a seeded
  permutation of the pool (a :class:`PageTable`; :meth:`PageTable.csr` gives FlashInfer's CSR arrays).
- :func:`random_batch`: a :class:`PagedBatch`: such a page table and its plan, a pool of noise with each request's
  cached prefix (positions ``< start_i``) written straight into its slots, the new rows' q/k/v (k/v to append),
  and every request's dense K/V.
- :func:`dense_attention` / :func:`dense_attention_of_request`: attention computed densely from the dense K/V, in
  float64 (the truth) or in the inputs' dtype (the "plain torch" baseline of the tolerance rule).
- :func:`error_bound`, :func:`max_abs_err`: the kernels' tolerance rule (docs/design.md §8, flash-attn's):
  ``max |ours − fp64| <= 2 · max |plain − fp64| + 1e-3``.
- :data:`KERNEL_GEOMETRIES`, :data:`KERNEL_WINDOWS`, :func:`run_kernel_case`: the GPU suite's prefill cases
  (``tests/test_cuda_kernels.py``), also tabulated by ``benchmarks/kernel_error_table.py``.

The dense attention states the visibility rule on its own (bottom-right causal alignment, inclusive window;
docs/design.md §2) rather than through ``semantics.key_visible``, which the code it judges uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .api import append_paged_kv, batch_prefill_paged_window
from .layout import PagedKvLayout
from .plan import PrefillPagedPlan

DENSE_LOGITS_BUDGET = 1 << 24  # logits the dense attention materialises at once (query rows go in blocks)
ERR_FACTOR, ERR_SLACK = 2.0, 1e-3  # the tolerance rule: max|ours - fp64| <= ERR_FACTOR * max|plain - fp64| + SLACK


# -- page tables ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PageTable:
    """Each request's page ids in position order (position ``p`` lives on ``pages[i][p // page_size]``, slot
    ``p % page_size``), the slots its last page uses, and the size of the pool the ids come from."""

    pages: list  # per request, its page ids
    last_page_lens: list  # per request, in [1, page_size]
    num_pages: int

    def csr(self, seq_lens) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """FlashInfer's CSR arrays of the batch, CPU int32: ``qo_indptr [batch + 1]`` (``seq_lens`` new rows per
        request), ``kv_indptr [batch + 1]``, ``kv_indices [total_pages]``, ``last_page_len [batch]``."""
        qo_indptr = torch.zeros(len(self.pages) + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.tensor([int(n) for n in seq_lens], dtype=torch.int32).cumsum(0)
        kv_indptr = torch.zeros_like(qo_indptr)
        kv_indptr[1:] = torch.tensor([len(p) for p in self.pages], dtype=torch.int32).cumsum(0)
        kv_indices = torch.tensor([x for p in self.pages for x in p], dtype=torch.int32)
        return qo_indptr, kv_indptr, kv_indices, torch.tensor(self.last_page_lens, dtype=torch.int32)


def pages_needed(kv_len: int, page_size: int) -> int:
    """The pages holding ``kv_len`` keys: ``ceil(kv_len / page_size)``, at least one."""
    return max(1, math.ceil(int(kv_len) / page_size))


def pages_in_turn(kv_lens, page_size: int, order, num_pages: int | None = None) -> PageTable:
    """Each request's :func:`pages_needed` taken in turn from the page ids ``order``; ``num_pages`` (default
    ``len(order)``) is the pool's size."""
    kv_lens = [int(kv) for kv in kv_lens]
    need = [pages_needed(kv, page_size) for kv in kv_lens]
    order = list(order)
    if sum(need) > len(order):
        raise ValueError(f"{sum(need)} pages needed, {len(order)} page ids given")
    pages, at = [], 0
    for n in need:
        pages.append(order[at : at + n])
        at += n
    lasts = [kv - (n - 1) * page_size for kv, n in zip(kv_lens, need)]
    return PageTable(pages, lasts, len(order) if num_pages is None else int(num_pages))


def random_pages(
    gen: torch.Generator, kv_lens, page_size: int, *, spare_pages: int = 0, num_pages: int | None = None
) -> PageTable:
    """:func:`pages_in_turn` from a random permutation (drawn from ``gen``) of a pool of ``num_pages`` pages
    (default: the pages needed plus ``spare_pages``)."""
    if num_pages is None:
        num_pages = sum(pages_needed(kv, page_size) for kv in kv_lens) + spare_pages
    return pages_in_turn(kv_lens, page_size, torch.randperm(num_pages, generator=gen).tolist())


# -- random batches -------------------------------------------------------------------------------------------------


@dataclass
class PagedBatch:
    """A random batch: the plan over a pool whose cached prefixes are written, the new rows' q/k/v, and each
    request's dense K/V (prefix and new rows), from which :func:`dense_attention` computes the truth."""

    layout: PagedKvLayout
    pool: torch.Tensor  # [num_pages, num_layers, 2, page_size, hkv, d]
    layer: int
    plan: PrefillPagedPlan
    q: torch.Tensor  # [total_tokens, hq, d]
    k: torch.Tensor  # [total_tokens, hkv, d] the new rows, in request order (not yet appended)
    v: torch.Tensor  # [total_tokens, hkv, d]
    full_k: list  # per request [kv_len, hkv, d], prefix and new rows
    full_v: list

    def append(self, *, backend: str = "auto") -> None:
        """Append the new rows' K/V to the pool (``pagedwindow.append_paged_kv``: "append, then attend")."""
        append_paged_kv(self.k, self.v, self.pool, self.layout, self.layer, self.plan, backend=backend)


def random_batch(
    gen: torch.Generator,
    *,
    seq_lens,
    start_positions,
    page_size: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float64,
    device="cpu",
    num_layers: int = 2,
    layer: int = 1,
    spare_pages: int = 3,
    num_pages: int | None = None,
    cta_tile_q: int | None = None,
    unused_slots: float | None = None,
    qk_std: float = 1.0,
) -> PagedBatch:
    """A batch whose pages are a random permutation of the pool (:func:`random_pages`), every slot of the pool
    filled with noise, each request's prefix K/V written straight into its slots; the new rows' K/V are returned
    for appending. Values are drawn from ``gen`` in float64 (pool, then every request's K, every request's V,
    then q), cast to ``dtype`` and moved to ``device``; q and K have standard deviation ``qk_std`` (e.g.
    ``head_dim ** -0.25`` keeps ``q·k`` O(1)). ``unused_slots`` (e.g. NaN), when given, fills every slot that
    holds no request position (past each kv_len, spare pages). Raises ``PagedWindowError`` for a plan the
    API refuses."""
    seq_lens, start_positions = [int(n) for n in seq_lens], [int(s) for s in start_positions]
    kv_lens = [s + n for s, n in zip(start_positions, seq_lens)]
    table = random_pages(gen, kv_lens, page_size, spare_pages=spare_pages, num_pages=num_pages)
    plan = PrefillPagedPlan.batch(
        table.pages,
        table.last_page_lens,
        start_positions,
        seq_lens,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        cta_tile_q=cta_tile_q,
    )
    layout = PagedKvLayout(num_layers, num_kv_heads, head_dim, page_size)

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).to(dtype).to(device)

    pool = rand(*layout.pool_shape(table.num_pages))
    if unused_slots is not None:
        used = torch.zeros(table.num_pages, page_size, dtype=torch.bool)  # [page, slot]
        for req_pages, kv in zip(table.pages, kv_lens):
            positions = torch.arange(kv)
            used[torch.tensor(req_pages, dtype=torch.long)[positions // page_size], positions % page_size] = True
        page_idx, slot_idx = (~used).nonzero(as_tuple=True)
        pool[page_idx.to(pool.device), :, :, slot_idx.to(pool.device)] = unused_slots
    full_k = [rand(kv, num_kv_heads, head_dim, std=qk_std) for kv in kv_lens]
    full_v = [rand(kv, num_kv_heads, head_dim) for kv in kv_lens]
    for i, start in enumerate(start_positions):
        pos = torch.arange(start, device=pool.device)
        page_ids = torch.tensor(table.pages[i], dtype=torch.long, device=pool.device)[pos // page_size]
        pool[page_ids, layer, 0, pos % page_size] = full_k[i][:start]
        pool[page_ids, layer, 1, pos % page_size] = full_v[i][:start]
    k = torch.cat([fk[s:] for fk, s in zip(full_k, start_positions)])
    v = torch.cat([fv[s:] for fv, s in zip(full_v, start_positions)])
    q = rand(sum(seq_lens), num_qo_heads, head_dim, std=qk_std)
    return PagedBatch(layout, pool, layer, plan, q, k, v, full_k, full_v)


# -- the dense attention --------------------------------------------------------------------------------------------


def dense_attention_of_request(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    sm_scale: float,
    window_left: int,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Attention of one request computed densely in ``dtype`` on q's device: q ``[S, Hq, D]`` holds its last ``S``
    rows, at KV positions ``L - S .. L - 1`` (bottom-right alignment); k/v ``[L, Hkv, D]`` hold every key at
    positions ``0 .. L - 1``. A query at ``p`` sees the keys ``k <= p`` with ``p - k <= window_left`` (any
    ``k <= p`` for ``window_left = -1``). Query rows go in blocks of at most :data:`DENSE_LOGITS_BUDGET` logits.
    Returns ``[S, Hq, D]`` in ``dtype``."""
    seq, hq, _ = q.shape
    length, hkv, _ = k.shape
    group = hq // hkv
    keys = k.to(q.device, dtype).repeat_interleave(group, dim=1)  # [L, hq, d]
    values = v.to(q.device, dtype).repeat_interleave(group, dim=1)
    key_pos = torch.arange(length, device=q.device)[None, :]  # [1, L]
    block = max(1, DENSE_LOGITS_BUDGET // max(1, hq * length))
    rows = []
    for j0 in range(0, seq, block):
        j1 = min(seq, j0 + block)
        q_pos = torch.arange(length - seq + j0, length - seq + j1, device=q.device)[:, None]  # [n, 1]
        visible = (key_pos <= q_pos) & ((q_pos - key_pos <= window_left) | (window_left == -1))  # [n, L]
        logits = torch.einsum("shd,khd->hsk", q[j0:j1].to(dtype), keys) * sm_scale  # [hq, n, L]
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        rows.append(torch.einsum("hsk,khd->shd", probs, values))  # [n, hq, d]
    return torch.cat(rows) if rows else q.new_zeros(q.shape, dtype=dtype)


def dense_attention(
    batch: PagedBatch, *, sm_scale: float, window_left: int, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """:func:`dense_attention_of_request` of every request of ``batch`` from its dense K/V (not the pool), in
    ``dtype``: float64 is the truth, the inputs' dtype the plain-torch baseline. ``[total_tokens, hq, d]``."""
    rows, at = [], 0
    for fk, fv, seq in zip(batch.full_k, batch.full_v, batch.plan.seq_lens):
        rows.append(
            dense_attention_of_request(
                batch.q[at : at + seq], fk, fv, sm_scale=sm_scale, window_left=window_left, dtype=dtype
            )
        )
        at += seq
    return torch.cat(rows) if rows else batch.q.new_zeros((0, *batch.q.shape[1:]), dtype=dtype)


# -- the tolerance rule ---------------------------------------------------------------------------------------------


def max_abs_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |x - ref|`` in float64 (0 for empty tensors; inf where either holds a NaN or an infinity)."""
    if x.shape != ref.shape:
        raise ValueError(f"max_abs_err: shapes differ: {tuple(x.shape)} vs {tuple(ref.shape)}")
    if x.numel() == 0:
        return 0.0
    diff = (x.double() - ref.to(x.device).double()).abs()
    return float(diff.max()) if bool(torch.isfinite(diff).all()) else math.inf


def error_bound(plain_err: float, *, factor: float = ERR_FACTOR, slack: float = ERR_SLACK) -> float:
    """The largest ``max |ours − fp64|`` the rule allows, given plain torch's ``max |plain − fp64|`` at the
    inputs' dtype: ``factor · plain_err + slack``."""
    return factor * plain_err + slack


# -- the GPU suite's kernel cases -----------------------------------------------------------------------------------

KERNEL_GEOMETRIES = [
    # page_size, seq_lens, start_positions, (hq, hkv), cta_tile_q
    (16, [577], [0], (16, 8), None),
    (1, [37, 1], [0, 40], (8, 8), None),
    (5, [577, 0, 37], [0, 9, 100], (16, 8), 64),
    (64, [200, 129], [1500, 0], (32, 4), 64),
    (16, [37, 3], [0, 5], (16, 1), 16),
    (5, [1], [700], (4, 2), None),
    (16, [300], [13], (2, 1), 16),
    (16, [577, 64], [0, 1000], (16, 8), 128),
    (16, [129, 7], [64, 0], (16, 4), None),
    (8, [300, 45], [0, 77], (16, 8), 128),
    (32, [577], [100], (16, 8), None),
    (128, [200, 70], [1000, 3], (8, 2), 128),
    # group 3 (64 rows are no whole number of tokens): no tensor map of q or out, every row copied on its own
    (16, [300], [40], (6, 2), 128),
    # the bulk-copy producer's last chunk (the first reaching past kv_len) starting exactly at kv_len: every row
    # zero-filled, no page id read (kv_len 1072 and 112: 48 keys into the last 64-key tile, at page 16)
    (16, [72, 100], [1000, 12], (16, 8), 128),
    # tile 16, the split-KV decode kernel: ragged decode (kv_len 1 included), one request's keys split over many
    # CTAs, GQA 1 / 8 / 16, a request of two 16-row tiles, empty requests, page sizes 1 and 5
    (16, [1] * 9, [0, 15, 16, 17, 100, 1023, 1024, 4095, 2500], (16, 8), None),
    (16, [1], [70000], (16, 8), None),
    (1, [1, 3, 0, 1], [0, 999, 50, 2000], (16, 2), 16),
    (5, [2, 1, 0], [4000, 6, 9], (4, 4), 16),
    (32, [1, 1], [3000, 100], (16, 1), None),
]
KERNEL_WINDOWS = [-1, 0, 1, 13, 1023, 10**6]
KERNEL_SM_SCALE = 0.0625
KERNEL_HEAD_DIM = 256
SPARE_OUT_ROWS = 3  # rows of out / lse past total_tokens a kernel case checks stay untouched


def kernel_case_id(geometry) -> str:
    """A short name of one of :data:`KERNEL_GEOMETRIES` (the GPU suite's test id)."""
    page_size, seqs, _, (hq, hkv), tile = geometry
    return f"ps{page_size}-seq{seqs}-h{hq}x{hkv}-t{tile}"


def run_kernel_case(geometry, window_left: int, seed: int):
    """One kernel case on the GPU: a bf16 batch of ``geometry`` (every pool slot no request owns holds NaN: a
    kernel that lets one reach its PV GEMM writes NaN), appended and attended through ``backend="cuda"`` into
    ``out`` / ``lse`` poisoned with NaN, :data:`SPARE_OUT_ROWS` rows longer than the batch. Returns
    ``(batch, out, lse)`` after a synchronize."""
    page_size, seqs, starts, (hq, hkv), tile = geometry
    batch = random_batch(
        torch.Generator().manual_seed(seed),
        seq_lens=seqs,
        start_positions=starts,
        page_size=page_size,
        num_qo_heads=hq,
        num_kv_heads=hkv,
        head_dim=KERNEL_HEAD_DIM,
        dtype=torch.bfloat16,
        device="cuda",
        cta_tile_q=tile,
        unused_slots=float("nan"),
    )
    batch.append(backend="cuda")
    rows = batch.plan.total_tokens
    out = torch.full((rows + SPARE_OUT_ROWS, hq, KERNEL_HEAD_DIM), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((rows + SPARE_OUT_ROWS, hq), float("nan"), dtype=torch.float32, device="cuda")
    batch_prefill_paged_window(
        batch.q,
        batch.pool,
        batch.layout,
        batch.layer,
        batch.plan,
        sm_scale=KERNEL_SM_SCALE,
        window_left=window_left,
        out=out,
        lse=lse,
        backend="cuda",
    )
    torch.cuda.synchronize()
    return batch, out, lse
