"""The plan's host pass in compiled code (``kernels/plan_pack.cpp``, built into the kernels' library): validate
CSR arrays and pack the plan block in one call (``pw_plan_pack``), and upload a packed plan into its device
buffer in one call (``pw_plan_upload``).

:func:`library` decides whether the compiled pass runs: with a kernels library already loaded in this process,
or for a plan on a CUDA device (whose launches need the library anyway); otherwise, and wherever the library
cannot be built or loaded, the plan's vectorised numpy pass runs. Both passes accept exactly the same batches
and produce the same block; the numpy pass also names the offending entry of a batch the compiled one refuses.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

_p, _i, _ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong

PACK_OK, PACK_INVALID, PACK_SHARED, PACK_SPARSE, PACK_TOO_SMALL = range(5)
"""``pw_plan_pack``'s statuses (``PwPackStatus``)."""

_failed: set[int] = set()  # CUDA device indices whose library could not be built or loaded
_log = logging.getLogger(__name__)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the host pass's C signatures on ``lib`` (the kernels' library, or a host-only build of
    ``plan_pack.cpp``, which lacks ``pw_plan_upload``)."""
    lib.pw_plan_pack.argtypes = [_p, _i, _p, _i, _p, _i, _ll, _p, _i, _ll, _ll, _ll, _ll, _p, _ll, _p, _p]
    lib.pw_plan_pack.restype = _i
    if hasattr(lib, "pw_plan_upload"):
        lib.pw_plan_upload.argtypes = [_p, _p, _p, _p, _p, _ll, _p, _p]
        lib.pw_plan_upload.restype = _i
        lib.pw_plan_events_destroy.argtypes = [_p, _i]
        lib.pw_plan_events_destroy.restype = None
    return lib


@functools.cache
def _ops():
    """``pagedwindow.cuda.ops``, imported on first use (it imports this module); every plan asks for it."""
    from . import ops

    return ops


def loaded() -> ctypes.CDLL | None:
    """A kernels library already loaded in this process (any one: the host pass is the same in every
    architecture's build), or None."""
    return next(iter(_ops()._by_device.values()), None)


def library(device: torch.device | None) -> ctypes.CDLL | None:
    """The library to run the compiled pass with, or None: any kernels library loaded in this process; else,
    for a plan on a CUDA device, that device's (built on first use; a failure is remembered per device)."""
    lib = loaded()
    if lib is not None or device is None or device.type != "cuda":
        return lib
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _failed:
        return None
    try:
        return _ops().library(torch.device("cuda", index))
    except Exception as exc:  # noqa: BLE001 - no kernels here: the numpy pass runs, and a launch reports why
        _failed.add(index)
        _log.warning("the compiled plan pass is unavailable on cuda:%d (plans use the numpy pass): %s", index, exc)
        return None
