"""The one error family and the checked integer narrowing every int32 value goes through."""

from __future__ import annotations

import numbers

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


class PagedWindowError(ValueError):
    """A contract of pagedwindow was violated. Raised before anything is written or launched."""


def checked_int(what: str, value, *, minimum: int | None = None) -> int:
    """Return ``value`` as a Python int, refusing bools, non-integers and values below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PagedWindowError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise PagedWindowError(f"{what} = {value} is below its minimum {minimum}")
    return value


def checked_i32(what: str, value, *, minimum: int | None = None) -> int:
    """Narrow ``value`` to int32: a value past int32 fails, it never truncates into a legal-looking bound."""
    value = checked_int(what, value, minimum=minimum)
    if value > INT32_MAX or value < -INT32_MAX - 1:
        raise PagedWindowError(f"{what} = {value} does not fit in int32 (bound {INT32_MAX})")
    return value


def checked_i64(what: str, value) -> int:
    """Check that a derived element offset or count fits in int64."""
    value = checked_int(what, value)
    if value > INT64_MAX or value < -INT64_MAX - 1:
        raise PagedWindowError(f"{what} = {value} does not fit in int64 (bound {INT64_MAX})")
    return value
