"""Error metrics and the calibrated gates the oracle uses. Tolerances are measured, not guessed.

Metrics (against a reference ``ref``, both cast to float64):
- ``max_abs = max |x - ref|``; ``max_rel = max_abs / max |ref|`` (relative to the reference's largest magnitude,
  so a near-zero element does not blow up the ratio).

Gates:
- fp32: ``max_rel <= 1e-4`` (:data:`FP32_REL_TOL`) — ours against HF eager, per layer and on logits.
- bf16 and fp16: ``max_abs <= max(2 * floor, small_abs)``, where ``floor`` is HF's own sdpa-vs-eager ``max_abs``
  on the same inputs (the backend floor) and ``small_abs`` is one unit in the last place of the reference's
  largest element in that dtype (``eps(dtype) * max |ref|``, with eps = 2**-7 for bf16). ``small_abs`` is the
  size of a single rounding of the output: without it a case where both HF backends happen to agree bit for bit
  (one key visible, attention = V) would demand ours be exact too.
- A greedy token must match HF's wherever HF's top1 - top2 logit margin is *clear*: ``margin > 2 * tol``, with
  ``tol`` the logits gate of that step. Rationale: any logits within ``tol`` of HF's move top1 - top2 by at
  most ``2 * tol``, so a clear margin cannot flip; a token flip there is a real error, not noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP32_REL_TOL = 1e-4
FLOOR_FACTOR = 2.0


def dtype_eps(dtype: torch.dtype) -> float:
    """Unit roundoff step (distance from 1 to the next representable number) of ``dtype``."""
    return float(torch.finfo(dtype).eps)


@dataclass(frozen=True)
class ErrorStats:
    max_abs: float
    max_rel: float
    ref_max: float


def error_stats(x: torch.Tensor, ref: torch.Tensor) -> ErrorStats:
    """max |x - ref| and that over max |ref| (float64 arithmetic). Shapes must match."""
    if x.shape != ref.shape:
        raise ValueError(f"error_stats: shapes differ: {tuple(x.shape)} vs {tuple(ref.shape)}")
    if x.numel() == 0:
        return ErrorStats(0.0, 0.0, 0.0)
    x64, r64 = x.detach().double(), ref.detach().double()
    diff = (x64 - r64).abs()
    max_abs = float(diff.max()) if torch.isfinite(diff).all() else float("inf")
    ref_max = float(r64.abs().max())
    max_rel = max_abs / ref_max if ref_max > 0 else (0.0 if max_abs == 0 else float("inf"))
    return ErrorStats(max_abs, max_rel, ref_max)


@dataclass(frozen=True)
class GateResult:
    """Outcome of one gate: ``value`` (what was measured) against ``limit`` (what it must not exceed)."""

    passed: bool
    value: float
    limit: float
    rule: str


def gate(ours: ErrorStats, floor: ErrorStats | None, dtype: torch.dtype) -> GateResult:
    """Apply the dtype's rule (see module docstring) to ours-vs-HF-eager, given HF's floor on the same inputs."""
    if dtype in (torch.float32, torch.float64):
        return GateResult(ours.max_rel <= FP32_REL_TOL, ours.max_rel, FP32_REL_TOL, "max_rel <= 1e-4")
    small_abs = dtype_eps(dtype) * ours.ref_max
    floor_abs = floor.max_abs if floor is not None else 0.0
    limit = max(FLOOR_FACTOR * floor_abs, small_abs)
    return GateResult(ours.max_abs <= limit, ours.max_abs, limit, "max_abs <= max(2*floor, eps*max|ref|)")


def tolerance(ref_max: float, floor_abs: float, dtype: torch.dtype) -> float:
    """The absolute tolerance :func:`gate` allows for a reference of magnitude ``ref_max``."""
    if dtype in (torch.float32, torch.float64):
        return FP32_REL_TOL * ref_max
    return max(FLOOR_FACTOR * floor_abs, dtype_eps(dtype) * ref_max)


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """top1 - top2 of the last dimension (float64)."""
    top = torch.topk(logits.detach().double(), 2, dim=-1).values
    return top[..., 0] - top[..., 1]


def margin_is_clear(margin: float, tol: float) -> bool:
    """A greedy pick is robust to any logits perturbation within ``tol`` iff ``margin > 2 * tol``."""
    return margin > 2.0 * tol
