"""The one error family, the checked integer narrowing every int32 value goes through, and the check that a
tensor argument is a dense one."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np
import torch

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
NOT_INT_SEQUENCES = (str, bytes, bytearray, memoryview)
"""Sequences that are never read as sequences of integers: text and byte buffers (raw bytes)."""


class PagedWindowError(ValueError):
    """A contract of pagedwindow was violated. Raised before anything is written or launched."""


def check_dense_tensor(what: str, name: str, t) -> None:
    """``t`` is a torch.Tensor with sizes and strides: not a nested or sparse one, whose shape or contiguity cannot
    be read the usual way. Errors read ``"{what}: {name} must be ..."``."""
    if not isinstance(t, torch.Tensor):
        raise PagedWindowError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_nested or t.layout is not torch.strided:
        kind = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise PagedWindowError(f"{what}: {name} must be a dense (strided) tensor, got {kind}")


def checked_int(what: str, value, *, minimum: int | None = None) -> int:
    """Return ``value`` as a Python int, refusing bools, non-integers and values below ``minimum``."""
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
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


def int_array(what: str, values) -> np.ndarray:
    """A 1-D integer numpy array (its own integer dtype) from an integer torch tensor (any device), a numpy array
    or a sequence of ints. Refuses bools, floats, nested or ragged input, strings, byte buffers (``NOT_INT_SEQUENCES``)
    and values past int64, naming ``what`` and the first offending index. A tensor or array may be shared, not
    copied: callers copy what they keep."""
    if isinstance(values, torch.Tensor):
        try:
            array = values.numpy()  # the common case: a CPU integer tensor that does not require grad
        except (TypeError, RuntimeError):
            array = None
        if array is None or array.ndim != 1 or array.dtype.kind not in "iu":
            if values.dim() != 1:
                raise PagedWindowError(f"{what} must be one-dimensional, got shape {tuple(values.shape)}")
            if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
                raise PagedWindowError(f"{what} must hold integers, got dtype {values.dtype}")
            try:  # another device, a tensor that requires grad, a negative view; sparse and others are refused
                array = values.detach().cpu().resolve_neg().numpy()
            except (RuntimeError, NotImplementedError, TypeError) as exc:
                raise PagedWindowError(
                    f"{what}: cannot read a {values.device} tensor of dtype {values.dtype} and layout {values.layout} "
                    f"({type(exc).__name__})"
                ) from None
        values = array  # checked as an array below (uint64 past int64 included)
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise PagedWindowError(f"{what} must be one-dimensional, got shape {values.shape}")
        if values.dtype.kind not in "iu":
            raise PagedWindowError(f"{what} must hold integers, got dtype {values.dtype}")
        if values.dtype == np.uint64 and len(values) and int(values.max()) > INT64_MAX:
            raise PagedWindowError(f"{what} holds integers past int64 (bound {INT64_MAX})")
        return values
    if isinstance(values, NOT_INT_SEQUENCES) or not isinstance(values, Sequence):
        raise PagedWindowError(f"{what} must be a sequence of integers, got {type(values).__name__}")
    if len(values) == 0:
        return np.zeros(0, dtype=np.int64)
    kinds = set(map(type, values))
    if not kinds <= {int}:  # bools, floats, nested sequences, numpy scalars...
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise PagedWindowError(f"{what}[{i}] must be an integer, got {v!r} ({type(v).__name__})")
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError:
        raise PagedWindowError(f"{what} holds integers past int64 (bound {INT64_MAX})") from None


def checked_i32_array(what: str, values: np.ndarray, *, minimum: int | None = None) -> np.ndarray:
    """Vectorised twin of :func:`checked_i32`: every entry of an integer array fits int32 and is >= ``minimum``.

    Returns the array as int32; the error names the first offending index and value.
    """
    lowest = -INT32_MAX - 1 if minimum is None else minimum
    if len(values) and (values.min() < lowest or values.max() > INT32_MAX):
        i = int(np.flatnonzero((values < lowest) | (values > INT32_MAX))[0])
        v = int(values[i])
        if v < lowest:
            raise PagedWindowError(f"{what}[{i}] = {v} is below its minimum {lowest}")
        raise PagedWindowError(f"{what}[{i}] = {v} does not fit in int32 (bound {INT32_MAX})")
    return values.astype(np.int32)
