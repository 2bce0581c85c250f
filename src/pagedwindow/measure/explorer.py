"""A random paged batch for any plan a user types in, run through a backend and compared with float64.

Contract of :func:`build_case`: ``pagedwindow.testing.random_batch`` — pages are a seeded random permutation of a
pool with a few spare pages; every slot of the pool starts as finite noise; each request's cached prefix (positions
``< start_i``) is written straight into its slots — then the new rows' K/V are appended with
``pagedwindow.append_paged_kv`` through the chosen backend ("append then attend"). q and k are drawn with standard
deviation ``head_dim ** -0.25`` so that ``sm_scale = 1`` (Gemma 4) gives O(1) logits.

The gate (docs/design.md §8, flash-attn's rule): ``max |ours − fp64| <= err_factor · max |plain − fp64| + err_slack``,
where *plain* is ``pagedwindow.testing.dense_attention`` computed by torch in the inputs' dtype; and ``out`` is
poisoned with NaN before the launch, every row below ``total_tokens`` must come back finite and the spare rows past
it untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .. import batch_prefill_paged_window
from ..testing import PagedBatch, dense_attention, error_bound, random_batch
from .plan_geometry import packed_row_values, per_tile_max, tile_spans
from .runtime import backend_label, observe_backends

SPARE_OUT_ROWS = 2  # rows of out past total_tokens that must stay untouched


@dataclass
class ExplorerCase(PagedBatch):
    """One random batch (``pagedwindow.testing.PagedBatch``, its new K/V appended) and the scale and window it is
    attended with."""

    sm_scale: float
    window_left: int


def build_case(
    *,
    page_size: int,
    seq_lens,
    start_positions,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    window_left: int,
    sm_scale: float,
    cta_tile_q: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    backend: str = "auto",
    seed: int = 0,
    spare_pages: int = 2,
) -> ExplorerCase:
    """Build the batch (see the module docstring). Raises ``PagedWindowError`` for a plan the API refuses."""
    batch = random_batch(
        torch.Generator().manual_seed(seed),
        seq_lens=seq_lens,
        start_positions=start_positions,
        page_size=page_size,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        num_layers=1,
        layer=0,
        spare_pages=spare_pages,
        cta_tile_q=cta_tile_q,
        qk_std=head_dim**-0.25,
    )
    batch.append(backend=backend)
    return ExplorerCase(
        **{f.name: getattr(batch, f.name) for f in fields(PagedBatch)},
        sm_scale=float(sm_scale),
        window_left=int(window_left),
    )


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


def run_case(
    case: ExplorerCase, *, backend: str = "auto", err_factor: float = 2.0, err_slack: float = 1e-3
) -> ExplorerResult:
    """Run ``batch_prefill_paged_window`` on ``case`` (out poisoned with NaN) and measure it (module docstring)."""
    plan = case.plan
    out = torch.full(
        (plan.total_tokens + SPARE_OUT_ROWS, *case.q.shape[1:]), float("nan"), dtype=case.q.dtype, device=case.q.device
    )
    with observe_backends() as launches:
        batch_prefill_paged_window(
            case.q,
            case.pool,
            case.layout,
            case.layer,
            plan,
            sm_scale=case.sm_scale,
            window_left=case.window_left,
            out=out,
            backend=backend,
        )
    truth = dense_attention(case, sm_scale=case.sm_scale, window_left=case.window_left)
    plain = dense_attention(case, sm_scale=case.sm_scale, window_left=case.window_left, dtype=case.q.dtype)
    ours = out[: plan.total_tokens]
    row_err = (ours.double() - truth).abs().amax(dim=-1).cpu()  # [total_tokens, hq]
    plain_row_err = (plain.double() - truth).abs().amax(dim=-1).cpu()
    spans = tile_spans(plan, case.window_left)
    max_err = float(row_err.max()) if row_err.numel() else 0.0
    if row_err.numel() and not torch.isfinite(row_err).all():
        max_err = float("inf")
    plain_err = float(plain_row_err.max()) if plain_row_err.numel() else 0.0
    return ExplorerResult(
        backend=backend_label(launches),
        out=ours,
        row_err=row_err,
        plain_row_err=plain_row_err,
        tile_err=per_tile_max(row_err, plan, spans),
        packed_err=packed_row_values(row_err, plan),
        spans=spans,
        max_abs_err=max_err,
        plain_max_abs_err=plain_err,
        limit=error_bound(plain_err, factor=err_factor, slack=err_slack),
        rows_written=bool(torch.isfinite(ours).all()),
        spare_rows_untouched=bool(torch.isnan(out[plan.total_tokens :]).all()),
    )


def explorer_metrics(case: ExplorerCase, result: ExplorerResult, *, err_factor: float, err_slack: float) -> dict:
    """The metrics.json of notebook 02 (headline scalars, the plan, per-tile rows)."""
    plan = case.plan
    dtype = str(case.q.dtype).replace("torch.", "")
    summary = (
        f"max |ours − fp64| = {result.max_abs_err:.3g} against the limit {result.limit:.3g} = "
        f"{err_factor:g} · max|plain − fp64| + {err_slack:g} (plain {dtype} torch: "
        f"{result.plain_max_abs_err:.3g}); rows written: {'yes' if result.rows_written else 'NO'}, spare "
        f"rows untouched: {'yes' if result.spare_rows_untouched else 'NO'}."
    )
    return {
        "passed": result.passed,
        "failures": result.failures(),
        "gate_summary": summary,
        "backend": result.backend,
        "max_abs_err": result.max_abs_err,
        "plain_max_abs_err": result.plain_max_abs_err,
        "limit": result.limit,
        "gate_rule": f"max|ours-fp64| <= {err_factor:g}*max|plain-fp64| + {err_slack:g}",
        "rows_written": result.rows_written,
        "spare_rows_untouched": result.spare_rows_untouched,
        "total_tokens": plan.total_tokens,
        "num_tiles": plan.num_tiles,
        "cta_tile_q": plan.cta_tile_q,
        "window_left": case.window_left,
        "sm_scale": case.sm_scale,
        "dtype": dtype,
        "plan": plan.to_dict(),
        "tiles": [dict(s.as_row(), max_abs_err=float(result.tile_err[s.tile].max())) for s in result.spans],
    }
