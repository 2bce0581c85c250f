"""The wrappers' calls the call-gate tests make, on any device: a batch, its calls with ``backend="cuda"`` (tensors
overridden by keyword), and per wrapper the bad tensors each gets with the checked path's error text. Shared by
``test_cuda_launch_gate.py`` (a GPU, the kernels) and ``test_launch_gate_api.py`` (a CPU, the launchers
stubbed); ``test_cuda_prepare.py`` takes its norm weights from :func:`weights`."""

import pytest
import torch

import pagedwindow as pw
from pagedwindow.testing import random_batch

EPS, THETA, SCALE, WINDOW = 1e-6, 10000.0, 0.0625, 1023
HQ, HKV = 8, 4


def batch(seed, device, *, dtype=torch.bfloat16, head_dim=256, seq_lens=(37, 0, 1, 130), starts=(0, 50, 4095, 17)):
    return random_batch(
        torch.Generator().manual_seed(seed),
        seq_lens=list(seq_lens),
        start_positions=list(starts),
        page_size=16,
        num_qo_heads=HQ,
        num_kv_heads=HKV,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
    )


def weights(seed, dtype, device, head_dim=256):
    gen = torch.Generator().manual_seed(seed)
    wq = (1.0 + 0.5 * torch.randn(head_dim, generator=gen)).to(device=device, dtype=dtype)
    wk = (1.0 + 0.5 * torch.randn(head_dim, generator=gen)).to(device=device, dtype=dtype)
    return wq, wk


def attend(b, *, q=None, pool=None, out=None, lse=None):
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
    )


def append(b, *, k=None, v=None, pool=None):
    pw.append_paged_kv(
        b.k if k is None else k,
        b.v if v is None else v,
        b.pool if pool is None else pool,
        b.layout,
        b.layer,
        b.plan,
        backend="cuda",
    )


def prep(b, pool=None, *, q=None, k=None, v=None, q_norm_weight, k_norm_weight, out_q=None, **kw):
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


def shifted(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` one element past a 16-byte boundary."""
    return torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape).copy_(t)


def elsewhere(t: torch.Tensor) -> torch.Tensor:
    """``t`` on a device other than its own (the CPU for a GPU tensor, the meta device for a CPU one)."""
    return t.to("meta" if t.device.type == "cpu" else "cpu")


def not_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def attention_cases(b, out, lse):
    """(what, tensor overrides, the checked error's text) for ``attend``."""
    q, pool = b.q, b.pool
    lse_in_out = out.view(-1).view(torch.float32)[: lse.numel()].view(lse.shape)
    return [
        ("q with a head short", dict(q=q[:, :-1].contiguous()), "q shape"),
        ("q in fp16", dict(q=q.half()), "q dtype"),
        ("q on another device", dict(q=elsewhere(q)), "q is on"),
        ("q not a tensor", dict(q=q.tolist()), "q must be a torch.Tensor"),
        ("q not 16-byte aligned", dict(q=shifted(q)), "16-byte aligned"),
        ("out not contiguous", dict(out=not_contiguous(out)), "out must be contiguous"),
        ("out that requires grad", dict(out=out.clone().requires_grad_()), "out requires grad"),
        ("out sharing q's bytes", dict(out=q), "out overlaps q"),
        ("out sharing the pool's bytes", dict(out=pool.view(-1)[: q.numel()].view(q.shape)), "out overlaps pool"),
        ("lse in bf16", dict(lse=lse.bfloat16()), "lse dtype"),
        ("lse with a head short", dict(lse=lse[:, :-1].contiguous()), "lse shape"),
        ("lse sharing out's bytes", dict(lse=lse_in_out), "out overlaps lse"),
    ]


def append_cases(b):
    """(what, tensor overrides, the checked error's text) for ``append``."""
    k, v, pool = b.k, b.v, b.pool
    return [
        ("k with a head short", dict(k=k[:, :-1].contiguous()), "k shape"),
        ("v in fp16", dict(v=v.half()), "v dtype"),
        ("k on another device", dict(k=elsewhere(k)), "k is on"),
        ("v not contiguous", dict(v=not_contiguous(v)), "v must be contiguous"),
        ("k not 16-byte aligned", dict(k=shifted(k)), "16-byte aligned"),
        ("k sharing the pool's bytes", dict(k=pool.view(-1)[: k.numel()].view(k.shape)), "pool overlaps k"),
        ("v not a tensor", dict(v=v.tolist()), "v must be a torch.Tensor"),
        ("a pool that requires grad", dict(pool=pool.clone().requires_grad_()), "pool requires grad"),
    ]


def prep_cases(b, wq, wk, out_q):
    """(what, tensor overrides, the checked error's text) for ``prep``."""
    q, k, v, pool = b.q, b.k, b.v, b.pool
    return [
        ("q with too few heads", dict(q=q[:, :-1].contiguous()), "q shape"),
        ("k in fp16", dict(k=k.half()), "k dtype"),
        ("v not contiguous", dict(v=not_contiguous(v)), "v must be contiguous"),
        ("q with too few rows", dict(q=q[:-1]), "q has"),
        ("k on another device", dict(k=elsewhere(k)), "k is on"),
        ("q_norm_weight of the wrong size", dict(q_norm_weight=wq[:-2]), "q_norm_weight shape"),
        ("k_norm_weight in fp16", dict(k_norm_weight=wk.half()), "k_norm_weight dtype"),
        ("weights of two dtypes", dict(k_norm_weight=wk.float()), "must share a dtype"),
        ("out_q that requires grad", dict(out_q=out_q.clone().requires_grad_()), "out_q requires grad"),
        ("out_q sharing q's bytes", dict(out_q=q), "out_q overlaps q"),
        ("a pool sharing k's bytes", dict(k=pool.view(-1)[: k.numel()].view(k.shape)), "pool overlaps k"),
        ("q not 16-byte aligned", dict(q=shifted(q)), "16-byte aligned"),
        ("q not a tensor", dict(q=q.tolist()), "q must be a torch.Tensor"),
    ]


def expect_refused(what: str, message: str, call, written: dict) -> None:
    """``call()`` raises the checked path's ``message`` and leaves every tensor of ``written`` as it was."""
    before = {name: t.detach().clone() for name, t in written.items()}
    with pytest.raises(pw.PagedWindowError, match=message):
        call()
    if any(t.device.type == "cuda" for t in before.values()):
        torch.cuda.synchronize()
    for name, t in written.items():
        assert torch.equal(t.detach(), before[name]), f"{what}: {name} was written"
