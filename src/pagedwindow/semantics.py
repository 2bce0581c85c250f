"""The attention semantics shared by every backend: the inclusive window, the explicit scale, visibility.

A query at KV position ``q_pos`` sees key ``k`` iff ``k <= q_pos`` and (``window_left == -1`` or
``q_pos - k <= window_left``). Request ``i`` with ``kv_len_i = start_i + seq_i`` places its query row ``j`` at
``q_pos = kv_len_i - seq_i + j`` (bottom-right causal alignment).
"""

from __future__ import annotations

import math
import numbers

from .errors import INT32_MAX, PagedWindowError, checked_i32

NO_WINDOW = -1


def window_left_from_sliding_window(sliding_window) -> int:
    """Convert Hugging Face's ``sliding_window = W`` (W keys including the query) to ``window_left = W - 1``.

    ``None`` (a full-attention layer) maps to ``-1``. This is the only place the conversion happens.
    """
    if sliding_window is None:
        return NO_WINDOW
    w = checked_i32("sliding_window", sliding_window, minimum=1)
    return w - 1


def check_window_left(window_left, what: str = "") -> int:
    """``window_left`` is an inclusive distance: ``-1`` (no window) or ``>= 0``; it must fit in int32. Errors start
    with ``what`` (the op) when given."""
    if type(window_left) is int and NO_WINDOW <= window_left <= INT32_MAX:
        return window_left  # the every-call case
    return checked_i32(f"{what}: window_left" if what else "window_left", window_left, minimum=NO_WINDOW)


def finite_positive(what: str, name: str, value) -> float:
    """A real number (not a bool) that is finite and > 0, as a Python float; integers too large for a float are
    refused like infinity. Errors read ``"{what}: {name} = ..."``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise PagedWindowError(f"{what}: {name} must be a real number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or number <= 0.0:
        past_float = isinstance(value, numbers.Integral) and not math.isfinite(number)
        shown = value if past_float else number  # an int too large for a float: as given
        raise PagedWindowError(f"{what}: {name} = {shown!r} must be finite and > 0")
    return number


_FLT_MIN = 1.1754943508222875e-38  # smallest normal fp32
_FLT_MAX_OVER_LOG2E = 3.4028234663852886e38 / 1.4426950408889634  # the kernels scale by sm_scale * log2(e)


def round_to_fp32(value: float) -> float:
    """``value`` rounded to the nearest fp32 mantissa (24 bits, ties to even), for finite values in fp32's normal
    range; plain Python so ``torch.compile`` traces it. Values past that range come back out of range (never
    inf), for the caller's bounds check."""
    mantissa, exponent = math.frexp(value)
    return math.ldexp(round(mantissa * 16777216.0), exponent - 24)


_last_scale = [math.nan, math.nan]  # (the last accepted float, its fp32 rounding); nan never compares equal


def check_sm_scale(sm_scale, what: str = "attention") -> float:
    """``sm_scale`` is required, and after rounding to fp32 (what the kernels use) finite, normal and > 0, with
    ``sm_scale * log2(e)`` finite too (Gemma 4: 1.0; Gemma 3: query_pre_attn_scalar ** -0.5). Returns the fp32
    value as a Python float; errors start with ``what`` (the op)."""
    if type(sm_scale) is float and sm_scale == _last_scale[0]:
        return _last_scale[1]  # the serving loop's case: the same scale every call
    value = finite_positive(what, "sm_scale", sm_scale)
    rounded = round_to_fp32(value)
    if rounded > _FLT_MAX_OVER_LOG2E:
        raise PagedWindowError(
            f"{what}: sm_scale = {value!r} is too large for fp32: sm_scale * log2(e) must stay finite "
            f"(bound {_FLT_MAX_OVER_LOG2E:.6g})"
        )
    if rounded < _FLT_MIN:
        raise PagedWindowError(
            f"{what}: sm_scale = {value!r} is below fp32's smallest normal number {_FLT_MIN!r} (it "
            f"would round to a subnormal or 0)"
        )
    _last_scale[:] = (value, rounded)
    return rounded


def key_visible(q_pos, k, window_left: int):
    """Whether the query at KV position ``q_pos`` sees the key at ``k``: ints give a bool; tensors that broadcast
    (e.g. ``q_pos [n, 1]`` and ``k [1, m]``) give a bool mask. The one place the visibility rule is written."""
    visible = k <= q_pos
    if window_left >= 0:
        visible = visible & (q_pos - k <= window_left)
    return visible


def window_start(q_pos: int, window_left: int) -> int:
    """Leftmost key visible from ``q_pos``."""
    return 0 if window_left < 0 else max(0, q_pos - window_left)
