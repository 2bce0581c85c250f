"""A measurement build of the kernels and its trace buffer, for ``wait_trace.py`` and ``decode_trace.py``: the
build's flag, and the buffer read out of the kernel library (``kernels/trace_readout.cuh``)."""

import ctypes
import os

import numpy as np


def add_build_flag(flag: str) -> None:
    """Append ``flag`` to ``$PAGEDWINDOW_NVCC_FLAGS`` (kept as is otherwise), so that the kernels built after this
    in the process are the trace build (its own kernel-cache entry). Call it before the CUDA side is imported."""
    os.environ["PAGEDWINDOW_NVCC_FLAGS"] = " ".join(filter(None, [os.environ.get("PAGEDWINDOW_NVCC_FLAGS"), flag]))


def read_buffer(lib: ctypes.CDLL, function: str, words: int, dtype: type) -> np.ndarray:
    """``lib.<function>(dst, words)``, the library's readout (it copies the device buffer into ``dst`` and zeroes
    it, returning the elements copied, -1 in a build without the trace, or -(CUDA error)), into a new array of
    ``words`` elements of ``dtype``. Exits with the readout's value unless it copied all ``words``."""
    buf = np.zeros(words, dtype=dtype)
    read = getattr(lib, function)
    read.argtypes, read.restype = [ctypes.c_void_p, ctypes.c_longlong], ctypes.c_longlong
    n = read(buf.ctypes.data, words)
    if n != words:
        raise SystemExit(f"{function} returned {n}: not a trace build, or a CUDA error")
    return buf
