"""The plan's host pass in compiled code (``kernels/plan_pack.cpp``, built into the kernels' library): validate
CSR arrays and pack the plan block in one call (``pw_plan_pack``), and upload a packed plan into its device
buffer in one call (``pw_plan_upload``). For CSR arrays already on a GPU, :class:`DevicePageCheck` runs the page-id
part of that pass on the device (``pw_plan_check_pages``, ``kernels/plan_check.cu``).

:func:`library` decides whether the compiled pass runs: with a kernels library already loaded in this process,
or for a plan on a CUDA device (whose launches need the library anyway); otherwise, and wherever the library
cannot be built or loaded, the plan's vectorised numpy pass runs. Both passes accept exactly the same batches
and produce the same block; the numpy pass also names the offending entry of a batch the compiled one refuses.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import shutil
import subprocess
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..errors import PagedWindowError
from ..tiles import device_traits

_p, _i, _ll, _u = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_uint

PACK_OK, PACK_INVALID, PACK_SHARED, PACK_SPARSE, PACK_TOO_SMALL = range(5)
"""``pw_plan_pack``'s statuses (``PwPackStatus``)."""

_failed: set[int] = set()  # CUDA device indices whose library could not be built or loaded
_log = logging.getLogger(__name__)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the host pass's C signatures on ``lib`` (the kernels' library, or a host-only build of
    ``plan_pack.cpp``, which lacks ``pw_plan_upload``)."""
    lib.pw_plan_pack.argtypes = [_p, _i, _p, _i, _p, _i, _ll, _p, _i, _ll, _ll, _ll, _ll, _p, _ll, _p, _p, _i]
    lib.pw_plan_pack.restype = _i
    lib.pw_plan_retile.argtypes = [_p, _ll, _p, _ll, _ll, _p]
    lib.pw_plan_retile.restype = _i
    if hasattr(lib, "pw_plan_upload"):
        lib.pw_plan_upload.argtypes = [_p, _p, _p, _p, _p, _ll, _p, _p, _p]
        lib.pw_plan_upload.restype = _i
        lib.pw_plan_events_destroy.argtypes = [_p, _i]
        lib.pw_plan_events_destroy.restype = None
    if hasattr(lib, "pw_plan_check_pages"):
        lib.pw_plan_check_pages.argtypes = [ctypes.POINTER(PageCheckLaunch), _p]
        lib.pw_plan_check_pages.restype = _i
        lib.pw_plan_check_host_alloc.argtypes = [_ll, ctypes.POINTER(_p)]
        lib.pw_plan_check_host_alloc.restype = _i
        lib.pw_plan_check_host_free.argtypes = [_p]
        lib.pw_plan_check_host_free.restype = _i
        lib.pw_plan_check_report_bytes.argtypes = [_ll]
        lib.pw_plan_check_report_bytes.restype = _ll
        lib.pw_plan_check_scratch_bytes.restype = _i
        lib.pw_page_check_launch_size.restype = _i
        if lib.pw_page_check_launch_size() != ctypes.sizeof(PageCheckLaunch):
            raise OSError(
                f"pw_page_check_launch_size() = {lib.pw_page_check_launch_size()} but the host's PageCheckLaunch "
                f"has {ctypes.sizeof(PageCheckLaunch)} bytes (a stale or foreign library)"
            )
    return lib


def build_host_only(directory: Path) -> ctypes.CDLL:
    """``plan_pack.cpp`` built without its CUDA upload (``-DPW_HOST_ONLY``, warnings as errors) by the host's C++
    compiler into ``directory``, loaded and declared: the compiled pass on a machine without nvcc (the plan tests,
    ``benchmarks/plan_cpu_host.py --compiled``). Raises PagedWindowError without a ``c++`` / ``g++`` on PATH, and
    subprocess.CalledProcessError (the compiler's output captured) when the build fails."""
    from .build import kernels_dir

    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise PagedWindowError("no C++ compiler (c++ / g++) on PATH: the compiled host pass cannot be built")
    out = Path(directory) / "libpw_plan_pack.so"
    flags = ["-O3", "-std=c++17", "-Wall", "-Werror", "-shared", "-fPIC", "-DPW_HOST_ONLY"]
    source = kernels_dir() / "plan_pack.cpp"
    subprocess.run([compiler, *flags, str(source), "-o", str(out)], check=True, capture_output=True, text=True)
    return declare(ctypes.CDLL(str(out)))


class PageCheckLaunch(ctypes.Structure):
    """Mirror of ``PwPageCheckLaunch`` (kernels/plan_check.cu)."""

    _fields_ = [
        ("kv_indices", _p),
        ("kv_indptr", _p),
        ("qo_indptr", _p),
        ("last_page_len", _p),
        ("ids_out", _p),
        ("stamps", _p),
        ("scratch", _p),
        ("report", _p),
        ("num_indices", _ll),
        ("batch", _ll),
        ("table_size", _ll),
        ("generation", _u),
        ("indices_is64", _i),
        ("kv_is64", _i),
        ("qo_is64", _i),
        ("last_is64", _i),
        ("num_sms", _i),
    ]


PAGE_CHECK_CAPTURING = -3
"""``PW_PAGE_CHECK_ERR_CAPTURING``: the stream was capturing a CUDA graph (nothing was launched)."""
BAD_COUNT, OUT_OF_RANGE, OUTSIDE_TABLE, REPEATED = 1, 2, 4, 8
"""``pw_page_check::Flags``: the device pass's findings (any of them sends the batch to the host's pass)."""

_CSR_DTYPES = {torch.int32: 0, torch.int64: 1}


class _Findings(ctypes.Structure):
    """The head of ``PwPageCheckReport``: what the pass found."""

    _fields_ = [("flags", _i), ("max_id", _i), ("count", _ll)]


class DeviceChecked(NamedTuple):
    """What the device pass hands the plan: host copies of the small arrays, and the page ids on the device."""

    arrays: np.ndarray  # [3 * batch + 2] int64: qo_indptr [batch + 1], kv_indptr [batch + 1], last_page_len [batch]
    num_indices: int  # len(kv_indices)
    page_ids: torch.Tensor  # [total_pages] int32 on the device: the ids, checked and copied
    max_page_index: int

    @property
    def batch(self) -> int:
        return (len(self.arrays) - 2) // 3

    @property
    def qo_indptr(self) -> np.ndarray:  # [batch + 1] a view of arrays
        return self.arrays[: self.batch + 1]

    @property
    def kv_indptr(self) -> np.ndarray:  # [batch + 1]
        return self.arrays[self.batch + 1 : 2 * self.batch + 2]

    @property
    def last_page_len(self) -> np.ndarray:  # [batch]
        return self.arrays[2 * self.batch + 2 :]


class DevicePageCheck:
    """The page-id pass on one CUDA device (``pw_plan_check_pages``): its stamp table, the generation of the last
    pass, its device scratch and the mapped host memory it reports through. One pass at a time per device."""

    MIN_TABLE = 1 << 16
    """The stamp table's first size (entries); it grows to the next power of two past the largest id seen."""
    MAX_TABLE = 1 << 22
    """The largest table (16 MiB) grown for any batch; a larger id only grows it up to ``4 * total_pages``."""

    def __init__(self, lib: ctypes.CDLL, index: int):
        self.lib, self.index = lib, index
        self.device = torch.device("cuda", index)
        self.stamps = torch.zeros(self.MIN_TABLE, dtype=torch.int32, device=self.device)  # [table] uint32 stamps
        self.generation = 0
        scratch_words = -(-lib.pw_plan_check_scratch_bytes() // 4)
        self.scratch = torch.zeros(scratch_words, dtype=torch.int32, device=self.device)  # zero between passes
        self.report_address, self.report_batch = 0, 0  # mapped host memory, made by _report_for
        self.report: np.ndarray = np.zeros(0, dtype=np.int64)
        self.findings: _Findings | None = None
        self.block = PageCheckLaunch(scratch=self.scratch.data_ptr(), num_sms=device_traits(self.device)[1])
        self.lock = threading.Lock()

    def _report_for(self, batch: int) -> np.ndarray:
        """The mapped host report, with room for ``batch`` requests, as int64 words (a view, made once per size)."""
        if batch > self.report_batch:
            size = max(batch, 2 * self.report_batch, 64)
            words = self.lib.pw_plan_check_report_bytes(size) // 8
            address = ctypes.c_void_p()
            status = self.lib.pw_plan_check_host_alloc(8 * words, ctypes.byref(address))
            if status != 0:
                raise RuntimeError(f"mapped host memory for the device page-id check: CUDA error {status}")
            if self.report_address:
                self.lib.pw_plan_check_host_free(self.report_address)
            self.report_address, self.report_batch = address.value, size
            self.report = np.ctypeslib.as_array((ctypes.c_int64 * words).from_address(address.value))  # [words]
            self.findings = _Findings.from_address(address.value)  # the report's head, read in place
        return self.report

    def run(self, given: tuple[torch.Tensor, ...], sizes, bound: int | None) -> DeviceChecked | None:
        """Check ``given`` = (qo_indptr, kv_indptr, kv_indices, last_page_len), 1-D contiguous int32/int64 tensors
        on this device (``sizes``: their lengths), with at most ``bound`` page ids (None: no bound). Returns None
        when the host's pass must decide (any flag, or an id too large for the table): it names the error or
        rules on shared pages."""
        qo, kv, indices, last = given
        batch, length = sizes[3], sizes[2]
        num_indices = length if bound is None else min(length, bound)
        ids = torch.empty(max(num_indices, 1), dtype=torch.int32, device=self.device)  # [num_indices]
        with self.lock:
            report = self._report_for(batch)
            block = self.block
            block.kv_indices, block.kv_indptr = indices.data_ptr(), kv.data_ptr()
            block.qo_indptr, block.last_page_len = qo.data_ptr(), last.data_ptr()
            block.ids_out, block.report = ids.data_ptr(), self.report_address
            block.num_indices, block.batch = num_indices, batch
            block.indices_is64, block.kv_is64 = _CSR_DTYPES[indices.dtype], _CSR_DTYPES[kv.dtype]
            block.qo_is64, block.last_is64 = _CSR_DTYPES[qo.dtype], _CSR_DTYPES[last.dtype]
            while True:
                self._next_generation()
                block.stamps, block.table_size = self.stamps.data_ptr(), len(self.stamps)
                block.generation = self.generation
                status = _ops()._launch_on(self.device, self.lib.pw_plan_check_pages, block)  # then waits
                if status == PAGE_CHECK_CAPTURING:
                    raise PagedWindowError(
                        "a plan cannot be built or updated while the current stream captures a CUDA graph (its "
                        "page ids are checked on the GPU, which needs a synchronisation): plan outside the capture "
                        "and capture the launches, which read the plan's device buffer in place"
                    )
                if status != 0:
                    raise RuntimeError(f"the device page-id check on {self.device} failed: status {status}")
                findings = self.findings
                assert findings is not None  # made with the report
                flags, high, count = findings.flags, findings.max_id, findings.count
                if flags != OUTSIDE_TABLE or not self._grow(high, count):
                    break
            if flags:
                return None
            arrays = report[2 : 2 + 3 * batch + 2].copy()  # [3 * batch + 2] int64
        page_ids = ids if count == num_indices else ids[:count]
        if num_indices > 2 * count + 65536:  # do not hold a capacity-sized copy for a small batch
            page_ids = page_ids.clone()
        return DeviceChecked(arrays, length, page_ids, high)

    def _next_generation(self) -> None:
        """A new generation for the next pass; at the wrap, every stamp is cleared first."""
        if self.generation == 0xFFFFFFFF:
            self.stamps.zero_()
            self.generation = 0
        self.generation += 1

    def _grow(self, high: int, count: int) -> bool:
        """Grow the table past ``high`` (True), or leave it when that would pass the bounds (False)."""
        size = 1 << high.bit_length()
        if size > max(self.MAX_TABLE, 4 * count):
            return False
        self.stamps = torch.zeros(size, dtype=torch.int32, device=self.device)
        self.generation = 0
        return True


_checks: dict[int, DevicePageCheck] = {}
_checks_lock = threading.Lock()


def device_check(device: torch.device) -> DevicePageCheck | None:
    """The device page-id pass for CUDA ``device`` (indexed), or None where the kernels' library for it is not
    loaded, cannot be built, or lacks the pass."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    found = _checks.get(device.index)
    if found is not None:
        return found
    if device.index in _failed:
        return None
    try:
        lib = _ops().library(device)  # this device's own build: the pass is a kernel
    except Exception as exc:  # noqa: BLE001 - no kernels here: the host pass runs, and a launch reports why
        _failed.add(device.index)
        _log.warning("the device page-id pass is unavailable on cuda:%d (the host pass runs): %s", device.index, exc)
        return None
    if not hasattr(lib, "pw_plan_check_pages"):
        return None
    with _checks_lock:
        return _checks.setdefault(device.index, DevicePageCheck(lib, device.index))


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
