"""The Python host cost of a call on a machine without a GPU: the CUDA backend's path with the launcher stubbed.

Each wrapper runs on CPU tensors as it would on a GPU: ``backend="cuda"`` resolves through the backend's own
checks (``cuda.unsupported``, ``cuda.require``), the parameter block is filled per call, and the launcher is a C
function that returns 0 (built here with the system C compiler). What it leaves out is the launch itself (the
ctypes call's ``cudaLaunchKernel``, about 3-4 µs on the GPU machines' hosts) and the current-stream lookup. It
measures what a change to the Python changes, before a GPU is lent; the GPU's host has the final word
(``benchmarks/host_cost.py``, ``benchmarks/prep_host_profile.py``).

Usage: ``python3 benchmarks/host_cost_cpu.py [--calls N] [--rounds R]``, with the source tree to measure first on
``PYTHONPATH`` (e.g. a checkout of the previous commit, to compare); prints µs per call, the median of the rounds
(the wrappers interleaved, each round in a new order).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import subprocess
import tempfile
from pathlib import Path

import torch
from host_cost import host_us_per_call  # benchmarks/host_cost.py, beside this script

import pagedwindow as pw
from pagedwindow import api, bench, bench_prep
from pagedwindow import cuda as cuda_backend
from pagedwindow.cuda import ops
from pagedwindow.plan import PrefillPagedPlan

LAUNCHERS = ("pw_prefill_hd256_bf16", "pw_prefill_hd256_bf16_sm90", "pw_append_paged_kv", "pw_prepare_qkv")
STUB_SOURCE = f"int pw_stub_calls[{len(LAUNCHERS)}];\n" + "".join(
    f"int {name}(const void* block, void* stream) {{ ++pw_stub_calls[{i}]; return 0; }}\n"
    for i, name in enumerate(LAUNCHERS)
)
"""Each stub counts its calls in ``pw_stub_calls`` (``stub_calls``) and launches nothing."""
GPU_DEVICE = torch.device("cuda", 0)
DECODE_STEP = bench.Workload("decode_64x128", seq_lens=(1,) * 64, start_positions=(127,) * 64)
"""The attention calls' batch: a decode step of 64 requests (the host path of ``decode_64x4096``, whose 1 GiB
pool a CPU need not fill: the plan's tile and the call's checks are the same)."""


def stub_library(directory: Path) -> ctypes.CDLL:
    """The four launchers as C functions that launch nothing and return 0 (each counts its calls)."""
    source, library = directory / "stub.c", directory / "libstub.so"
    source.write_text(STUB_SOURCE)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    lib = ctypes.CDLL(str(library))
    for name in LAUNCHERS:
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        getattr(lib, name).restype = ctypes.c_int
    lib.prefill = lib.pw_prefill_hd256_bf16_sm90  # the launcher ops.library picks on Hopper
    for name, launcher in (
        ("prefill", lib.prefill),
        ("append", lib.pw_append_paged_kv),
        ("prepare", lib.pw_prepare_qkv),
    ):
        setattr(lib, f"{name}_launcher_address", ctypes.cast(launcher, ctypes.c_void_p).value)  # the call gate's
    return lib


def stub_calls(lib: ctypes.CDLL) -> dict[str, int]:
    """How many times each stub launcher of ``lib`` has been called (by ctypes or by the call gate)."""
    counts = (ctypes.c_int * len(LAUNCHERS)).in_dll(lib, "pw_stub_calls")
    return dict(zip(LAUNCHERS, counts))


@contextlib.contextmanager
def cuda_backend_on_cpu_tensors(lib: ctypes.CDLL):
    """Within the block ``backend="cuda"`` runs on CPU tensors: the backend's checks see a CUDA device, the kernels
    count as loaded, the launchers are ``lib``'s stubs, the current device and stream are the CPU's (None, 0), and
    a plan's buffer on the CPU is built once per plan, as its GPU mirror is (on the CPU it is otherwise a fresh
    copy per call). Tensors report ``is_cuda`` (the test that sends a call to the compiled call gate, which then
    checks the CPU tensors and calls ``lib``'s stub). Everything is put back on exit."""
    resolve, device_buffer, library = api._resolve_backend, PrefillPagedPlan.device_buffer, ops.library
    load_state, libraries = dict(cuda_backend._load_state), dict(ops._by_device)
    current_device, current_stream = ops.current_device, ops.current_raw_stream
    buffers: dict[int, torch.Tensor] = {}

    def resolve_as_on_a_gpu(what, backend, plan, device, *rest):
        return resolve(what, backend, plan, GPU_DEVICE, *rest)

    def mirrored_buffer(plan, device):
        buffer = buffers.get(id(plan))
        if buffer is None:
            buffer = buffers[id(plan)] = device_buffer(plan, device)
        return buffer

    api._resolve_backend = resolve_as_on_a_gpu
    PrefillPagedPlan.device_buffer = mirrored_buffer
    cuda_backend._load_state["error"] = None
    ops._by_device[None] = lib  # the CPU tensors' device index
    ops.current_device = lambda: None
    ops.current_raw_stream = lambda index: 0
    ops.library = lambda device: lib
    torch.Tensor.is_cuda = property(lambda self: True)  # shadows the C property until deleted
    try:
        yield
    finally:
        del torch.Tensor.is_cuda
        api._resolve_backend, PrefillPagedPlan.device_buffer, ops.library = resolve, device_buffer, library
        cuda_backend._load_state.clear()
        cuda_backend._load_state.update(load_state)
        ops._by_device.clear()
        ops._by_device.update(libraries)
        ops.current_device, ops.current_raw_stream = current_device, current_stream


def calls() -> dict:
    """One call of each wrapper as a decode step makes it, on CPU tensors: the prep and attention calls are the
    benches' own (``bench_prep.system_pagedwindow``, ``bench.system_pagedwindow``, ``backend="cuda"``)."""
    cpu = torch.device("cpu")
    prep_step = bench_prep.PREP_WORKLOADS["prep_decode_64x1"]
    prep = bench_prep.make_prep_inputs(prep_step, torch.Generator().manual_seed(0), cpu)
    attn = bench.make_inputs(DECODE_STEP, torch.Generator().manual_seed(0), cpu)
    return {
        "prepare_paged_qkv (64 x 1)": bench_prep.system_pagedwindow(prep_step, prep).call,
        "append_paged_kv (64 x 1)": lambda: pw.append_paged_kv(
            prep.k, prep.v, prep.pool, prep.layout, 0, prep.plan, backend="cuda"
        ),
        "batch_prefill_paged_window (64 x 1 on 127)": bench.system_pagedwindow(DECODE_STEP, attn)[0],
    }


def us_per_call(named: dict, n: int, rounds: int) -> dict:
    """µs per call of each callable, timed as ``host_cost.host_us_per_call`` times it, with no GPU to keep busy."""
    return host_us_per_call(named, n, rounds, busy=_nothing, synchronize=_nothing)


def _nothing() -> None:
    pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    named = calls()  # plans first: planning on the CPU may use the compiled host pass, which the stub replaces
    with tempfile.TemporaryDirectory() as tmp, cuda_backend_on_cpu_tensors(stub_library(Path(tmp))):
        result = us_per_call(named, args.calls, args.rounds)
    print(f"pagedwindow from {Path(pw.__file__).parent}")
    print("| call (launcher stubbed, CPU tensors) | µs per call |\n|---|---|")
    for name, us in result.items():
        print(f"| {name} | {us:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
