"""GPU tests of the compiled call gate (``kernels/launch_gate.cpp``) through the API, per wrapper: an eager call
launches through the gate (the checked launch path is never reached) and gives that path's bits; each bad tensor
is refused by the gate and then named by the checked path's error, with nothing written. (The gate's refusals
one by one, on a CPU: ``test_launch_gate.py``; the same API calls with the launchers stubbed, on a CPU:
``test_launch_gate_api.py``.)"""

import pytest
import torch

from pagedwindow.cuda import launch_gate, ops

from .gate_calls import (
    HQ,
    append,
    append_cases,
    attend,
    attention_cases,
    batch,
    expect_refused,
    prep,
    prep_cases,
    weights,
)

pytestmark = pytest.mark.cuda


@pytest.fixture
def gate():
    module = launch_gate.module()
    assert module is not None, f"the call gate did not build here: {launch_gate.unavailable_reason()}"
    return module


def _no_checked_launch(*args, **kwargs):
    raise AssertionError("the checked launch path ran: the call gate should have launched this call")


def test_attention_launches_through_the_gate_with_the_checked_paths_bits(gate, monkeypatch):
    b = batch(1, "cuda")
    b.append(backend="cuda")
    rows = b.plan.total_tokens
    checked_lse = torch.empty(rows, HQ, dtype=torch.float32, device="cuda")
    monkeypatch.setattr(launch_gate, "module", lambda: None)
    checked = attend(b, lse=checked_lse)
    monkeypatch.undo()
    monkeypatch.setattr(ops, "launch_prefill", _no_checked_launch)
    for out in (None, torch.zeros(rows + 2, HQ, 256, dtype=torch.bfloat16, device="cuda")):
        got = attend(b, out=out)
        assert torch.equal(got, checked)
        if out is not None:
            assert got.data_ptr() == out.data_ptr() and not out[rows:].any()
    lse = torch.full((rows + 1, HQ), 5.0, device="cuda")
    assert torch.equal(attend(b, lse=lse), checked)
    assert torch.equal(lse[:rows], checked_lse) and (lse[rows:] == 5.0).all()


def test_each_bad_attention_tensor_is_refused_with_the_checked_message_and_nothing_written(gate, monkeypatch):
    b = batch(2, "cuda")
    b.append(backend="cuda")
    out = torch.full_like(b.q, 7.0)
    lse = torch.full((b.plan.total_tokens, HQ), 3.0, device="cuda")
    monkeypatch.setattr(ops, "launch_prefill", _no_checked_launch)
    for what, overrides, message in attention_cases(b, out, lse):
        call = dict(out=out, lse=lse) | overrides
        written = {"out": call["out"], "lse": call["lse"], "pool": b.pool}
        expect_refused(what, message, lambda c=call: attend(b, **c), written)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_pool_write_launches_through_the_gate_with_the_checked_paths_bits(gate, monkeypatch, dtype):
    b = batch(3, "cuda", dtype=dtype, head_dim=128)
    checked_pool = b.pool.clone()
    monkeypatch.setattr(launch_gate, "module", lambda: None)
    append(b, pool=checked_pool)
    monkeypatch.undo()
    monkeypatch.setattr(ops, "launch_append", _no_checked_launch)
    append(b)
    assert torch.equal(b.pool, checked_pool)


def test_each_bad_pool_write_tensor_is_refused_with_the_checked_message_and_nothing_written(gate, monkeypatch):
    b = batch(4, "cuda")
    monkeypatch.setattr(ops, "launch_append", _no_checked_launch)
    for what, overrides, message in append_cases(b):
        expect_refused(what, message, lambda o=overrides: append(b, **o), {"pool": b.pool})


def test_the_prep_launches_through_the_gate_with_the_checked_paths_bits(gate, monkeypatch):
    """With or without out_q; fp32 weights on a bf16 pool, gemma3's norm, a RoPE position factor."""
    b = batch(12, "cuda")
    wq, wk = weights(12, torch.float32, "cuda")
    style = dict(norm_style="gemma3", rope_position_factor=2.0, q_norm_weight=wq, k_norm_weight=wk)
    checked_pool = b.pool.clone()
    monkeypatch.setattr(launch_gate, "module", lambda: None)
    checked = prep(b, checked_pool, **style)
    monkeypatch.undo()
    monkeypatch.setattr(ops, "launch_prepare", _no_checked_launch)
    for out_q in (None, torch.zeros(b.q.shape[0] + 3, *b.q.shape[1:], dtype=b.q.dtype, device="cuda")):
        pool = b.pool.clone()
        got = prep(b, pool, out_q=out_q, **style)
        assert torch.equal(got, checked) and torch.equal(pool, checked_pool)
        if out_q is not None:
            assert got.data_ptr() == out_q.data_ptr() and not out_q[b.q.shape[0] :].any()


def test_each_bad_prep_tensor_is_refused_with_the_checked_message_and_nothing_written(gate, monkeypatch):
    b = batch(13, "cuda")
    wq, wk = weights(13, torch.bfloat16, "cuda")
    out_q = torch.full_like(b.q, 7.0)
    monkeypatch.setattr(ops, "launch_prepare", _no_checked_launch)
    for what, overrides, message in prep_cases(b, wq, wk, out_q):
        call = dict(q_norm_weight=wq, k_norm_weight=wk, out_q=out_q) | overrides
        expect_refused(what, message, lambda c=call: prep(b, **c), {"pool": b.pool, "out_q": call["out_q"]})
