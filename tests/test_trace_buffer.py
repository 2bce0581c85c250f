"""benchmarks/trace_buffer.py: reading a trace build's buffer through the library's readout (a fake library here:
the readout itself needs a CUDA device)."""

import ctypes

import numpy as np
import pytest

from .benchmark_scripts import load_benchmark_script

trace_buffer = load_benchmark_script("trace_buffer")


class FakeReadout:
    """A readout that copies `data` (or returns `result` instead of the count when given)."""

    def __init__(self, data: np.ndarray, result: int | None = None):
        self.data, self.result, self.calls = data, result, []

    def __call__(self, dst, words):
        self.calls.append(words)
        n = min(words, len(self.data))
        ctypes.memmove(dst, self.data.ctypes.data, n * self.data.itemsize)
        return n if self.result is None else self.result


class FakeLibrary:
    def __init__(self, readout: FakeReadout):
        self.pw_trace = readout


def test_the_buffer_comes_back_whole_with_its_dtype():
    data = np.array([1, 2**40, 3, 4], dtype=np.uint64)
    readout = FakeReadout(data)
    out = trace_buffer.read_buffer(FakeLibrary(readout), "pw_trace", 4, np.uint64)
    assert out.dtype == np.uint64 and out.tolist() == data.tolist()
    assert readout.calls == [4] and readout.argtypes == [ctypes.c_void_p, ctypes.c_longlong]
    assert readout.restype is ctypes.c_longlong


@pytest.mark.parametrize("result", [-1, -700, 3])
def test_a_build_without_the_trace_a_cuda_error_or_a_short_copy_exits(result):
    readout = FakeReadout(np.arange(4, dtype=np.uint32), result=result)
    with pytest.raises(SystemExit, match=f"pw_trace returned {result}: not a trace build, or a CUDA error"):
        trace_buffer.read_buffer(FakeLibrary(readout), "pw_trace", 4, np.uint32)


@pytest.mark.parametrize("before", [None, "", "-DPW_DECODE_STAGES=4"])
def test_the_trace_flag_joins_the_build_flags(monkeypatch, before):
    monkeypatch.setenv("PAGEDWINDOW_NVCC_FLAGS", "")  # the variable as it was comes back after the test
    if before is None:
        monkeypatch.delenv("PAGEDWINDOW_NVCC_FLAGS", raising=False)
    else:
        monkeypatch.setenv("PAGEDWINDOW_NVCC_FLAGS", before)
    trace_buffer.add_build_flag("-DPW_DECODE_TRACE=1")
    expect = "-DPW_DECODE_TRACE=1" if not before else f"{before} -DPW_DECODE_TRACE=1"
    assert trace_buffer.os.environ["PAGEDWINDOW_NVCC_FLAGS"] == expect
