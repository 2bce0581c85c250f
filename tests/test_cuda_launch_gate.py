"""GPU tests of the compiled call gate (``kernels/launch_gate.cpp``) through the API, per wrapper: an eager call
launches through the gate (the checked launch path is never reached) and gives that path's bits; each bad tensor
is refused by the gate and then named by the checked path's error, with nothing written. (The gate's refusals
one by one, on a CPU: ``test_launch_gate.py``.)"""

import pytest
import torch

import pagedwindow as pw
from pagedwindow.cuda import launch_gate, ops
from pagedwindow.testing import random_batch

pytestmark = pytest.mark.cuda

EPS, THETA, SCALE, WINDOW = 1e-6, 10000.0, 0.0625, 1023


@pytest.fixture
def gate():
    module = launch_gate.module()
    assert module is not None, f"the call gate did not build here: {launch_gate.unavailable_reason()}"
    return module


def _no_checked_launch(*args, **kwargs):
    raise AssertionError("the checked launch path ran: the call gate should have launched this call")


def _batch(seed, *, dtype=torch.bfloat16, head_dim=256, seq_lens=(37, 0, 1, 130), starts=(0, 50, 4095, 17)):
    return random_batch(
        torch.Generator().manual_seed(seed),
        seq_lens=list(seq_lens),
        start_positions=list(starts),
        page_size=16,
        num_qo_heads=8,
        num_kv_heads=4,
        head_dim=head_dim,
        dtype=dtype,
        device="cuda",
    )


def _shifted(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` one element past a 16-byte boundary."""
    shifted = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    return shifted.copy_(t)


def _expect_refused(what: str, message: str, call, written: dict) -> None:
    """``call()`` raises the checked path's ``message`` and leaves every tensor of ``written`` as it was."""
    before = {name: t.detach().clone() for name, t in written.items()}
    with pytest.raises(pw.PagedWindowError, match=message):
        call()
    torch.cuda.synchronize()
    for name, t in written.items():
        assert torch.equal(t.detach(), before[name]), f"{what}: {name} was written"


# -- batch_prefill_paged_window -----------------------------------------------------------------------------------
def _attend(b, q=None, pool=None, out=None, lse=None, **kw):
    return pw.batch_prefill_paged_window(
        b.q if q is None else q,
        b.pool if pool is None else pool,
        b.layout,
        b.layer,
        b.plan,
        sm_scale=SCALE,
        window_left=WINDOW,
        out=out,
        lse=lse,
        backend="cuda",
        **kw,
    )


def test_attention_launches_through_the_gate_with_the_checked_paths_bits(gate, monkeypatch):
    b = _batch(1)
    b.append(backend="cuda")
    rows = b.plan.total_tokens
    checked_lse = torch.empty(rows, 8, dtype=torch.float32, device="cuda")
    monkeypatch.setattr(launch_gate, "module", lambda: None)
    checked = _attend(b, lse=checked_lse)
    monkeypatch.undo()
    monkeypatch.setattr(ops, "launch_prefill", _no_checked_launch)
    for out, lse in ((None, None), (torch.zeros(rows + 2, 8, 256, dtype=torch.bfloat16, device="cuda"), None)):
        got = _attend(b, out=out, lse=lse)
        assert torch.equal(got, checked)
        if out is not None:
            assert got.data_ptr() == out.data_ptr() and not out[rows:].any()
    lse = torch.full((rows + 1, 8), 5.0, device="cuda")
    assert torch.equal(_attend(b, lse=lse), checked)
    assert torch.equal(lse[:rows], checked_lse) and (lse[rows:] == 5.0).all()


def test_each_bad_attention_tensor_is_refused_with_the_checked_message_and_nothing_written(gate, monkeypatch):
    b = _batch(2)
    b.append(backend="cuda")
    q, rows = b.q, b.plan.total_tokens
    out = torch.full_like(q, 7.0)
    lse = torch.full((rows, 8), 3.0, device="cuda")
    monkeypatch.setattr(ops, "launch_prefill", _no_checked_launch)
    cases = [
        ("q with a head short", dict(q=q[:, :-1].contiguous()), "q shape"),
        ("q in fp16", dict(q=q.half()), "q dtype"),
        ("q on the CPU", dict(q=q.cpu()), "q is on cpu"),
        ("q not a tensor", dict(q=q.tolist()), "q must be a torch.Tensor"),
        ("q not 16-byte aligned", dict(q=_shifted(q)), "16-byte aligned"),
        ("out not contiguous", dict(out=out.transpose(0, 1).contiguous().transpose(0, 1)), "out must be contiguous"),
        ("out that requires grad", dict(out=out.clone().requires_grad_()), "out requires grad"),
        ("out sharing q's bytes", dict(out=q), "out overlaps q"),
        ("out sharing the pool's bytes", dict(out=b.pool.view(-1)[: q.numel()].view(q.shape)), "out overlaps pool"),
        ("lse in bf16", dict(lse=lse.bfloat16()), "lse dtype"),
        ("lse with a head short", dict(lse=lse[:, :-1].contiguous()), "lse shape"),
        (
            "lse sharing out's bytes",
            dict(lse=out.view(-1).view(torch.float32)[: lse.numel()].view(lse.shape)),
            "overlaps",
        ),
    ]
    for what, overrides, message in cases:
        call = dict(out=out, lse=lse) | overrides
        written = {"out": call["out"], "lse": call["lse"], "pool": b.pool}
        _expect_refused(what, message, lambda c=call: _attend(b, **c), written)


# -- append_paged_kv -------------------------------------------------------------------------------------------------
def _append(b, k=None, v=None, pool=None):
    pw.append_paged_kv(
        b.k if k is None else k,
        b.v if v is None else v,
        b.pool if pool is None else pool,
        b.layout,
        b.layer,
        b.plan,
        backend="cuda",
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_pool_write_launches_through_the_gate_with_the_checked_paths_bits(gate, monkeypatch, dtype):
    b = _batch(3, dtype=dtype, head_dim=128)
    checked_pool = b.pool.clone()
    monkeypatch.setattr(launch_gate, "module", lambda: None)
    _append(b, pool=checked_pool)
    monkeypatch.undo()
    monkeypatch.setattr(ops, "launch_append", _no_checked_launch)
    _append(b)
    assert torch.equal(b.pool, checked_pool)


def test_each_bad_pool_write_tensor_is_refused_with_the_checked_message_and_nothing_written(gate, monkeypatch):
    b = _batch(4)
    k, v, pool = b.k, b.v, b.pool
    monkeypatch.setattr(ops, "launch_append", _no_checked_launch)
    cases = [
        ("k with a head short", dict(k=k[:, :-1].contiguous()), "k shape"),
        ("v in fp16", dict(v=v.half()), "v dtype"),
        ("k on the CPU", dict(k=k.cpu()), "k is on cpu"),
        ("v not contiguous", dict(v=v.transpose(0, 1).contiguous().transpose(0, 1)), "v must be contiguous"),
        ("k not 16-byte aligned", dict(k=_shifted(k)), "16-byte aligned"),
        ("k sharing the pool's bytes", dict(k=pool.view(-1)[: k.numel()].view(k.shape)), "pool overlaps k"),
        ("v not a tensor", dict(v=v.tolist()), "v must be a torch.Tensor"),
    ]
    for what, overrides, message in cases:
        _expect_refused(what, message, lambda o=overrides: _append(b, **o), {"pool": pool})


# -- prepare_paged_qkv -----------------------------------------------------------------------------------------------
def _weights(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    wq = (1.0 + 0.5 * torch.randn(256, generator=gen)).to(device="cuda", dtype=dtype)
    wk = (1.0 + 0.5 * torch.randn(256, generator=gen)).to(device="cuda", dtype=dtype)
    return wq, wk


def _prep(b, pool=None, *, q=None, k=None, v=None, q_norm_weight, k_norm_weight, out_q=None, **kw):
    return pw.prepare_paged_qkv(
        b.q if q is None else q,
        b.k if k is None else k,
        b.v if v is None else v,
        b.pool if pool is None else pool,
        b.layout,
        b.layer,
        b.plan,
        q_norm_weight=q_norm_weight,
        k_norm_weight=k_norm_weight,
        eps=EPS,
        rope_theta=THETA,
        out_q=out_q,
        backend="cuda",
        **({"norm_style": "gemma4"} | kw),
    )


def test_the_prep_launches_through_the_gate_with_the_checked_paths_bits(gate, monkeypatch):
    """With or without out_q; fp32 weights on a bf16 pool, gemma3's norm, a RoPE position factor."""
    b = _batch(12)
    wq, wk = _weights(12, torch.float32)
    style = dict(norm_style="gemma3", rope_position_factor=2.0, q_norm_weight=wq, k_norm_weight=wk)
    checked_pool = b.pool.clone()
    monkeypatch.setattr(launch_gate, "module", lambda: None)
    checked = _prep(b, checked_pool, **style)
    monkeypatch.undo()
    monkeypatch.setattr(ops, "launch_prepare", _no_checked_launch)
    for out_q in (None, torch.zeros(b.q.shape[0] + 3, *b.q.shape[1:], dtype=b.q.dtype, device="cuda")):
        pool = b.pool.clone()
        got = _prep(b, pool, out_q=out_q, **style)
        assert torch.equal(got, checked) and torch.equal(pool, checked_pool)
        if out_q is not None:
            assert got.data_ptr() == out_q.data_ptr() and not out_q[b.q.shape[0] :].any()


def test_each_bad_prep_tensor_is_refused_with_the_checked_message_and_nothing_written(gate, monkeypatch):
    b = _batch(13)
    wq, wk = _weights(13, torch.bfloat16)
    q, k, v, pool = b.q, b.k, b.v, b.pool
    out_q = torch.full_like(q, 7.0)
    monkeypatch.setattr(ops, "launch_prepare", _no_checked_launch)
    cases = [
        ("q with too few heads", dict(q=q[:, :-1].contiguous()), "q shape"),
        ("k in fp16", dict(k=k.half()), "k dtype"),
        ("v not contiguous", dict(v=v.transpose(0, 1).contiguous().transpose(0, 1)), "v must be contiguous"),
        ("q with too few rows", dict(q=q[:-1]), "q has"),
        ("k on the CPU", dict(k=k.cpu()), "k is on cpu"),
        ("q_norm_weight of the wrong size", dict(q_norm_weight=wq[:-2]), "q_norm_weight shape"),
        ("k_norm_weight in fp16", dict(k_norm_weight=wk.half()), "k_norm_weight dtype"),
        ("weights of two dtypes", dict(k_norm_weight=wk.float()), "must share a dtype"),
        ("out_q that requires grad", dict(out_q=out_q.clone().requires_grad_()), "out_q requires grad"),
        ("out_q sharing q's bytes", dict(out_q=q), "out_q overlaps q"),
        ("a pool sharing k's bytes", dict(k=pool.view(-1)[: k.numel()].view(k.shape)), "pool overlaps k"),
        ("q not 16-byte aligned", dict(q=_shifted(q)), "16-byte aligned"),
        ("q not a tensor", dict(q=q.tolist()), "q must be a torch.Tensor"),
    ]
    for what, overrides, message in cases:
        call = dict(q_norm_weight=wq, k_norm_weight=wk, out_q=out_q) | overrides
        written = {"pool": pool, "out_q": call["out_q"]}
        _expect_refused(what, message, lambda c=call: _prep(b, **c), written)
