"""benchmarks/host_cost_cpu.py: the CUDA backend's host path on CPU tensors with the launchers stubbed."""

import shutil
import sys
from pathlib import Path

import pytest
import torch

import pagedwindow as pw
from pagedwindow import api
from pagedwindow import cuda as cuda_backend
from pagedwindow.cuda import ops
from pagedwindow.plan import PrefillPagedPlan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import host_cost_cpu  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the stub launchers")


def patched_state() -> tuple:
    """Everything ``cuda_backend_on_cpu_tensors`` replaces."""
    return (
        api._resolve_backend,
        PrefillPagedPlan.device_buffer,
        dict(cuda_backend._load_state),
        dict(ops._by_device),
        ops.current_device,
        ops.current_raw_stream,
        ops.library,
        "is_cuda" in torch.Tensor.__dict__,
    )


def test_every_call_reaches_its_stub_launcher_and_everything_is_put_back(tmp_path):
    named = host_cost_cpu.calls()
    lib = host_cost_cpu.stub_library(tmp_path)
    before = patched_state()
    with host_cost_cpu.cuda_backend_on_cpu_tensors(lib):
        for call in named.values():
            call()
        assert host_cost_cpu.stub_calls(lib) == {  # each through the call gate
            "pw_prefill_hd256_bf16": 0,
            "pw_prefill_hd256_bf16_sm90": 1,
            "pw_append_paged_kv": 1,
            "pw_prepare_qkv": 1,
        }
        times = host_cost_cpu.us_per_call(named, n=3, rounds=2)
    assert set(times) == set(named) and all(t > 0 for t in times.values())
    assert patched_state() == before
    # outside the block the CPU tensors go back to their own rules: backend "cuda" is refused
    with pytest.raises(pw.PagedWindowError, match="needs tensors on a CUDA device"):
        next(iter(named.values()))()


def test_main_prints_a_row_per_call(capsys):
    assert host_cost_cpu.main(["--calls", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert all(f"| {name} |" in out for name in host_cost_cpu.calls())
