"""The Gemma prep's definitions, shared by every backend: the norm styles, RoPE's inverse frequencies and the
checks of the prep's scalars.

Before a sliding layer's attention, Gemma computes from the projections ``q, k, v`` (``[tokens, heads, D]``)::

    q' = rope(norm(q) * wq)   k' = rope(norm(k) * wk)   v' = norm(v)        (norm_style "gemma4")
    q' = rope(norm(q) * (1 + wq))   k' = rope(norm(k) * (1 + wk))   v' = v  (norm_style "gemma3")

with ``norm(x) = x / sqrt(mean(x^2) + eps)`` over the head dimension, in fp32. ``rope`` is the rotate-half
(NeoX) layout over the full head dimension: for ``i < D/2`` and angle ``a_i = pos * inv_freq[i]`` (fp32),
``x'[i] = x[i] cos a_i - x[i + D/2] sin a_i`` and ``x'[i + D/2] = x[i + D/2] cos a_i + x[i] sin a_i``.
``pos`` is the token's KV position (``start + j`` for row ``j`` of a request), the position its K lands at.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .errors import PagedWindowError
from .semantics import finite_positive, round_to_fp32

NORM_STYLES = ("gemma4", "gemma3")
"""``"gemma4"``: weighted norms ``x̂·w`` on q and k, unweighted ``x̂`` on v; ``"gemma3"``: ``x̂·(1 + w)`` on q
and k, v unchanged."""

MAX_HEAD_DIM = 512
"""The widest head the prep takes (Gemma 4's global layers); the launch block carries ``MAX_HEAD_DIM / 2``
inverse frequencies."""

_FLT_MIN = 1.1754943508222875e-38  # smallest normal fp32
_FLT_MAX = 3.4028234663852886e38


def check_norm_style(what: str, norm_style) -> str:
    if not isinstance(norm_style, str) or norm_style not in NORM_STYLES:
        raise PagedWindowError(f"{what}: norm_style {norm_style!r} is not one of {NORM_STYLES}")
    return norm_style


def check_positive_fp32(what: str, name: str, value) -> float:
    """A real number that is finite, > 0 and, rounded to fp32 (what the kernels use), a normal fp32 value;
    returns the fp32 value as a Python float."""
    rounded = round_to_fp32(finite_positive(what, name, value))
    if not _FLT_MIN <= rounded <= _FLT_MAX:
        raise PagedWindowError(f"{what}: {name} = {value!r} is outside fp32's normal range")
    return rounded


_last_scalars: list = [None, None]  # [(eps, theta, factor) last accepted as floats, their checked values]


def check_prep_scalars(what: str, eps, rope_theta, rope_position_factor) -> tuple[float, float, float]:
    """``eps`` by :func:`check_positive_fp32`, ``rope_theta`` and ``rope_position_factor`` finite and > 0
    (:func:`~pagedwindow.semantics.finite_positive`, unrounded); returns the three checked values. The last
    accepted floats are remembered (the serving loop passes the same ones every call); anything else is checked in
    full."""
    given = (eps, rope_theta, rope_position_factor)
    floats = type(eps) is float and type(rope_theta) is float and type(rope_position_factor) is float
    if floats and given == _last_scalars[0]:
        return _last_scalars[1]
    checked = (
        check_positive_fp32(what, "eps", eps),
        finite_positive(what, "rope_theta", rope_theta),  # unrounded: they enter the same torch ops as HF's do
        finite_positive(what, "rope_position_factor", rope_position_factor),
    )
    if floats:  # only finite, positive values get here (and NaN never compares equal)
        _last_scalars[:] = (given, checked)
    return checked


def check_rope(
    what: str, head_dim: int, rope_theta: float, position_factor: float, max_position: int, *, compiling: bool
) -> None:
    """RoPE's inverse frequencies are finite, positive fp32 values and the largest angle
    ``max_position * max(inv_freq)`` is finite in fp32 (else cos/sin are NaN). Eager calls check the fp32 values
    themselves (cached per arguments); under ``torch.compile`` (``compiling``) the same bounds are checked in plain
    Python on the extreme frequencies (the first and the last), which tracing allows."""
    if compiling:
        ends = (1.0 / position_factor, rope_theta ** (-(head_dim - 2) / head_dim) / position_factor)
        low, high = min(ends), max(ends)
    else:
        low, high = _inv_freq_range(head_dim, rope_theta, position_factor)
    if not (_FLT_MIN <= low and high <= _FLT_MAX):
        raise PagedWindowError(
            f"{what}: rope_theta = {rope_theta!r} with position factor {position_factor!r} gives inverse "
            f"frequencies outside fp32's normal range ({low!r} .. {high!r})"
        )
    if max_position > 0 and high * max_position > _FLT_MAX:
        raise PagedWindowError(
            f"{what}: RoPE angle at position {max_position} overflows fp32 (inverse frequency up to {high!r})"
        )


@lru_cache(maxsize=64)
def _inv_freq_range(head_dim: int, rope_theta: float, position_factor: float) -> tuple[float, float]:
    inv_freq = rope_inv_freq(head_dim, rope_theta, position_factor)
    return min(inv_freq), max(inv_freq)


@lru_cache(maxsize=64)
def rope_inv_freq(head_dim: int, rope_theta: float, position_factor: float = 1.0) -> tuple[float, ...]:
    """RoPE's ``D/2`` fp32 inverse frequencies ``theta^(-2i/D) / position_factor``, computed with the torch ops
    Hugging Face uses (so a model built on the CPU gets bit-equal angles). Cached per arguments; the values are
    fp32 numbers held as Python floats. Callers check the arguments with :func:`check_rope` first."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim  # [D/2]
    inv_freq = 1.0 / (rope_theta**exponents)  # [D/2] fp32: Hugging Face's default RoPE, computed the same way
    if position_factor != 1.0:
        inv_freq = inv_freq / position_factor  # HF's "linear" RoPE scaling (Gemma 3's global layers)
    return tuple(inv_freq.tolist())
