"""The API's calls through the compiled call gate on a CPU, the launchers stubbed (``benchmarks/host_cost_cpu.py``
runs the CUDA backend's host path on CPU tensors, the stubs counting their calls): a valid call of each wrapper
reaches its launcher through the gate, never through the checked launch path; each bad tensor is refused by the
gate and named by the checked path's error, with nothing launched; a call the gate is stricter about than the
checked path (a tensor subclass) is launched the checked way. The same calls on a GPU: ``test_cuda_launch_gate.py``."""

import shutil
import sys
from pathlib import Path

import pytest
import torch

from pagedwindow.cuda import launch_gate, ops

from .gate_calls import append, append_cases, attend, attention_cases, batch, prep, prep_cases, weights

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import host_cost_cpu  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the stub launchers")

CHECKED = {"prefill": "launch_prefill", "append": "launch_append", "prepare": "launch_prepare"}
LAUNCHER = {"prefill": "pw_prefill_hd256_bf16_sm90", "append": "pw_append_paged_kv", "prepare": "pw_prepare_qkv"}


@pytest.fixture(scope="module")
def batches():
    """The tests' batches, planned before the stubs go in (the stub library replaces the compiled plan pass)."""
    return {seed: batch(seed, "cpu") for seed in range(1, 6)}


@pytest.fixture(scope="module")
def stubbed(batches, tmp_path_factory):
    """The CUDA backend on CPU tensors with counting stub launchers, for the module; the stub library."""
    assert launch_gate.module() is not None, f"the call gate did not build: {launch_gate.unavailable_reason()}"
    lib = host_cost_cpu.stub_library(tmp_path_factory.mktemp("stub"))
    with host_cost_cpu.cuda_backend_on_cpu_tensors(lib):
        yield lib


def _checked_path_off(monkeypatch):
    for name in CHECKED.values():
        monkeypatch.setattr(ops, name, lambda *a, name=name, **k: pytest.fail(f"the checked path ran ({name})"))


def _calls_of(lib, wrapper: str) -> int:
    return host_cost_cpu.stub_calls(lib)[LAUNCHER[wrapper]]


def test_valid_calls_reach_their_launcher_through_the_gate(batches, stubbed, monkeypatch):
    b = batches[1]
    wq, wk = weights(1, torch.float32, "cpu")
    _checked_path_off(monkeypatch)
    for wrapper, call in (
        ("prefill", lambda: attend(b)),
        ("prefill", lambda: attend(b, lse=torch.zeros(b.plan.total_tokens, 8))),
        ("append", lambda: append(b)),
        ("prepare", lambda: prep(b, q_norm_weight=wq, k_norm_weight=wk)),
        ("prepare", lambda: prep(b, q_norm_weight=wq, k_norm_weight=wk, out_q=torch.empty_like(b.q))),
    ):
        before = _calls_of(stubbed, wrapper)
        call()
        assert _calls_of(stubbed, wrapper) == before + 1, wrapper


def _refused_everywhere(lib, wrapper, what, message, call):
    before = host_cost_cpu.stub_calls(lib)
    with pytest.raises(Exception, match=message) as info:
        call()
    assert type(info.value).__name__ == "PagedWindowError", f"{what}: {info.value!r}"
    assert host_cost_cpu.stub_calls(lib) == before, f"{what}: a launcher was called"


def test_each_bad_attention_tensor_is_refused_and_named_by_the_checked_path(batches, stubbed):
    b = batches[2]
    out, lse = torch.full_like(b.q, 7.0), torch.full((b.plan.total_tokens, 8), 3.0)
    for what, overrides, message in attention_cases(b, out, lse):
        call = dict(out=out, lse=lse) | overrides
        _refused_everywhere(stubbed, "prefill", what, message, lambda c=call: attend(b, **c))


def test_each_bad_pool_write_tensor_is_refused_and_named_by_the_checked_path(batches, stubbed):
    b = batches[3]
    for what, overrides, message in append_cases(b):
        _refused_everywhere(stubbed, "append", what, message, lambda o=overrides: append(b, **o))


def test_each_bad_prep_tensor_is_refused_and_named_by_the_checked_path(batches, stubbed):
    b = batches[4]
    wq, wk = weights(4, torch.bfloat16, "cpu")
    out_q = torch.full_like(b.q, 7.0)
    for what, overrides, message in prep_cases(b, wq, wk, out_q):
        call = dict(q_norm_weight=wq, k_norm_weight=wk, out_q=out_q) | overrides
        _refused_everywhere(stubbed, "prepare", what, message, lambda c=call: prep(b, **c))


class Sub(torch.Tensor):
    pass


def test_a_tensor_subclass_is_launched_the_checked_way(batches, stubbed, monkeypatch):
    """The gate takes only plain tensors; the checked path accepts a subclass and launches it itself."""
    b = batches[5]
    wq, wk = weights(5, torch.bfloat16, "cpu")
    checked = []
    for wrapper, name in CHECKED.items():
        original = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, f=original, w=wrapper, **k: checked.append(w) or f(*a, **k))
    attend(b, q=b.q.as_subclass(Sub))
    append(b, k=b.k.as_subclass(Sub))
    prep(b, q_norm_weight=wq, k_norm_weight=wk.as_subclass(Sub))
    assert checked == ["prefill", "append", "prepare"]
