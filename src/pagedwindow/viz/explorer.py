"""A random paged batch for any plan a user types in, run through a backend and compared with float64.

Contract of :func:`build_case`: pages are a seeded random permutation of a pool with a few spare pages; every
slot of the pool starts as finite noise; each request's cached prefix (positions ``< start_i``) is written straight
into its slots; the new rows' K/V are appended with ``pagedwindow.append_paged_kv`` through the chosen backend
("append then attend"). q and k are drawn with standard deviation ``head_dim ** -0.25`` so that ``sm_scale = 1``
(Gemma 4) gives O(1) logits.

The gate (docs/design.md §8, flash-attn's rule): ``max |ours − fp64| <= err_factor · max |plain − fp64| + err_slack``,
where *plain* is naive dense attention computed by torch in the inputs' dtype; and ``out`` is poisoned with NaN
before the launch, every row below ``total_tokens`` must come back finite and the spare rows past it untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import PagedKvLayout, PrefillPagedPlan, append_paged_kv, batch_prefill_paged_window
from ..semantics import key_visible
from .plan_geometry import packed_row_values, per_tile_max, tile_spans
from .runtime import backend_label, observe_backends

SPARE_OUT_ROWS = 2  # rows of out past total_tokens that must stay untouched
DENSE_LOGITS_BUDGET = 1 << 24  # logits materialised at once by the dense baselines


@dataclass
class ExplorerCase:
    """One random batch: the plan, the pool (prefix and new K/V written), q, and per-request dense K/V."""

    plan: PrefillPagedPlan
    layout: PagedKvLayout
    pool: torch.Tensor  # [num_pages, 1, 2, page_size, hkv, d]
    q: torch.Tensor  # [total_tokens, hq, d]
    full_k: list  # per request [kv_len, hkv, d]
    full_v: list  # per request [kv_len, hkv, d]
    sm_scale: float
    window_left: int


def build_case(*, page_size: int, seq_lens, start_positions, num_qo_heads: int, num_kv_heads: int,
               head_dim: int, window_left: int, sm_scale: float, cta_tile_q: int | None = None,
               dtype: torch.dtype = torch.bfloat16, device="cpu", backend: str = "auto", seed: int = 0,
               spare_pages: int = 2) -> ExplorerCase:
    """Build the batch (see the module docstring). Raises ``PagedWindowError`` for a plan the API refuses."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens, start_positions = [int(x) for x in seq_lens], [int(x) for x in start_positions]
    kv_lens = [s + n for s, n in zip(start_positions, seq_lens)]
    need = [max(1, math.ceil(kv / page_size)) for kv in kv_lens]
    order = torch.randperm(sum(need) + spare_pages, generator=gen).tolist()
    pages, at = [], 0
    for n in need:
        pages.append(order[at: at + n])
        at += n
    lasts = [kv - (n - 1) * page_size for kv, n in zip(kv_lens, need)]
    plan = PrefillPagedPlan.batch(pages, lasts, start_positions, seq_lens, num_qo_heads=num_qo_heads,
                                  num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                                  cta_tile_q=cta_tile_q)
    layout = PagedKvLayout(1, num_kv_heads, head_dim, page_size)

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).to(dtype).to(device)

    pool = rand(*layout.pool_shape(len(order)))  # finite noise in every slot
    qk_std = head_dim ** -0.25
    full_k = [rand(kv, num_kv_heads, head_dim, std=qk_std) for kv in kv_lens]
    full_v = [rand(kv, num_kv_heads, head_dim) for kv in kv_lens]
    for i, start in enumerate(start_positions):
        pos = torch.arange(start, device=pool.device)
        page_ids = torch.tensor(pages[i], dtype=torch.long, device=pool.device)[pos // page_size]
        pool[page_ids, 0, 0, pos % page_size] = full_k[i][:start]
        pool[page_ids, 0, 1, pos % page_size] = full_v[i][:start]
    k_new = torch.cat([fk[s:] for fk, s in zip(full_k, start_positions)])  # [total_tokens, hkv, d]
    v_new = torch.cat([fv[s:] for fv, s in zip(full_v, start_positions)])
    append_paged_kv(k_new, v_new, pool, layout, 0, plan, backend=backend)
    q = rand(plan.total_tokens, num_qo_heads, head_dim, std=qk_std)
    return ExplorerCase(plan, layout, pool, q, full_k, full_v, float(sm_scale), int(window_left))


def dense_attention(case: ExplorerCase, dtype: torch.dtype) -> torch.Tensor:
    """Naive dense attention of every request computed in ``dtype`` from the dense K/V (not the pool):
    float64 is the truth, the inputs' dtype is the "plain torch" baseline. Query rows go in blocks of at most
    :data:`DENSE_LOGITS_BUDGET` logits. Returns ``[total_tokens, hq, d]``."""
    plan = case.plan
    group = plan.group_size
    rows = []
    at = 0
    for fk, fv, start, seq in zip(case.full_k, case.full_v, plan.start_positions, plan.seq_lens):
        kv_len = start + seq
        keys = fk.to(dtype).repeat_interleave(group, dim=1)  # [kv, hq, d]
        values = fv.to(dtype).repeat_interleave(group, dim=1)
        block = max(1, DENSE_LOGITS_BUDGET // max(1, plan.num_qo_heads * kv_len))
        for j0 in range(0, seq, block):
            j1 = min(seq, j0 + block)
            q = case.q[at + j0: at + j1].to(dtype)  # [n, hq, d]
            q_pos = torch.arange(start + j0, start + j1, device=q.device)[:, None]  # [n, 1]
            k_pos = torch.arange(kv_len, device=q.device)[None, :]  # [1, kv]
            visible = key_visible(q_pos, k_pos, case.window_left)  # [n, kv]
            logits = torch.einsum("shd,khd->hsk", q, keys) * case.sm_scale  # [hq, n, kv]
            probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
            rows.append(torch.einsum("hsk,khd->shd", probs, values))  # [n, hq, d]
        at += seq
    if not rows:  # every request has seq_len 0
        return case.q.new_zeros((0, *case.q.shape[1:]), dtype=dtype)
    return torch.cat(rows)


@dataclass
class ExplorerResult:
    """Errors of one backend run. ``row_err``/``plain_row_err``: ``[total_tokens, hq]`` max over head_dim."""

    backend: str  # the backend that ran ("reference" | "cuda")
    out: torch.Tensor  # [total_tokens, hq, d]
    row_err: torch.Tensor
    plain_row_err: torch.Tensor
    tile_err: torch.Tensor  # [num_tiles, hkv]
    packed_err: list  # per request [hkv, seq_i * group]
    spans: list
    max_abs_err: float
    plain_max_abs_err: float
    limit: float
    rows_written: bool  # every row < total_tokens finite
    spare_rows_untouched: bool  # rows past total_tokens still NaN

    @property
    def passed(self) -> bool:
        return self.max_abs_err <= self.limit and self.rows_written and self.spare_rows_untouched

    def failures(self) -> list[str]:
        out = []
        if not self.max_abs_err <= self.limit:
            out.append(f"max |ours − fp64| = {self.max_abs_err:.3g} exceeds the limit {self.limit:.3g}")
        if not self.rows_written:
            out.append("some output rows below total_tokens were not written (still NaN) or are not finite")
        if not self.spare_rows_untouched:
            out.append("rows of out past total_tokens were written")
        return out


def run_case(case: ExplorerCase, *, backend: str = "auto", err_factor: float = 2.0,
             err_slack: float = 1e-3) -> ExplorerResult:
    """Run ``batch_prefill_paged_window`` on ``case`` (out poisoned with NaN) and measure it (module docstring)."""
    plan = case.plan
    out = torch.full((plan.total_tokens + SPARE_OUT_ROWS, *case.q.shape[1:]), float("nan"), dtype=case.q.dtype,
                     device=case.q.device)
    with observe_backends() as launches:
        batch_prefill_paged_window(case.q, case.pool, case.layout, 0, plan, sm_scale=case.sm_scale,
                                   window_left=case.window_left, out=out, backend=backend)
    truth = dense_attention(case, torch.float64)
    plain = dense_attention(case, case.q.dtype)
    ours = out[: plan.total_tokens]
    row_err = (ours.double() - truth).abs().amax(dim=-1).cpu()  # [total_tokens, hq]
    plain_row_err = (plain.double() - truth).abs().amax(dim=-1).cpu()
    spans = tile_spans(plan, case.window_left)
    max_err = float(row_err.max()) if row_err.numel() else 0.0
    if row_err.numel() and not torch.isfinite(row_err).all():
        max_err = float("inf")
    plain_err = float(plain_row_err.max()) if plain_row_err.numel() else 0.0
    return ExplorerResult(
        backend=backend_label(launches), out=ours, row_err=row_err, plain_row_err=plain_row_err,
        tile_err=per_tile_max(row_err, plan, spans), packed_err=packed_row_values(row_err, plan), spans=spans,
        max_abs_err=max_err, plain_max_abs_err=plain_err, limit=err_factor * plain_err + err_slack,
        rows_written=bool(torch.isfinite(ours).all()),
        spare_rows_untouched=bool(torch.isnan(out[plan.total_tokens:]).all()),
    )


def explorer_metrics(case: ExplorerCase, result: ExplorerResult, *, err_factor: float, err_slack: float) -> dict:
    """The metrics.json of notebook 02 (headline scalars, the plan, per-tile rows)."""
    plan = case.plan
    dtype = str(case.q.dtype).replace("torch.", "")
    summary = (f"max |ours − fp64| = {result.max_abs_err:.3g} against the limit {result.limit:.3g} = "
               f"{err_factor:g} · max|plain − fp64| + {err_slack:g} (plain {dtype} torch: "
               f"{result.plain_max_abs_err:.3g}); rows written: {'yes' if result.rows_written else 'NO'}, spare "
               f"rows untouched: {'yes' if result.spare_rows_untouched else 'NO'}.")
    return {
        "passed": result.passed, "failures": result.failures(), "gate_summary": summary, "backend": result.backend,
        "max_abs_err": result.max_abs_err, "plain_max_abs_err": result.plain_max_abs_err,
        "limit": result.limit, "gate_rule": f"max|ours-fp64| <= {err_factor:g}*max|plain-fp64| + {err_slack:g}",
        "rows_written": result.rows_written, "spare_rows_untouched": result.spare_rows_untouched,
        "total_tokens": plan.total_tokens, "num_tiles": plan.num_tiles, "cta_tile_q": plan.cta_tile_q,
        "window_left": case.window_left, "sm_scale": case.sm_scale, "dtype": dtype,
        "plan": plan.to_dict(),
        "tiles": [dict(s.as_row(), max_abs_err=float(result.tile_err[s.tile].max())) for s in result.spans],
    }
