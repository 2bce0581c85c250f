"""prepare_paged_qkv on the reference backend: its math against an independent Hugging-Face-style formula written
here, and every contract: each bad input fails with PagedWindowError naming it and writes nothing.

What is asserted, and why:

- The norm (``x * (mean(x^2) + eps) ** -0.5`` times ``w`` / ``1 + w``, fp32, or fp64 for fp64 inputs) and V are
  bit-equal to the formula: the same elementwise torch ops on same-shaped tensors, no transcendental function.
  Rows at position 0 (cos 1, sin 0 exactly) are bit-equal too.
- Rotated q/K: within 4 fp32 ulps of the rotation's terms, ``|got - want| <= 4 eps32 (|x cos| + |rot(x) sin|)``.
  The op and the formula both take cos/sin of the same fp32 angle, but torch's CPU cos/sin may take a SIMD or a
  scalar path depending on where an element falls in its tensor (the op has ``[rows, D/2]`` angles, the formula
  ``[rows, D]``), which may differ by an ulp; then two products and a sum. (On the machine this was written on
  they are bit-equal.) A wrong position, frequency, sign or half is O(1) off.
- bf16 / fp16: within half an output ulp of the fp32 formula plus the slack above: the op computes in fp32 and
  rounds once (a per-step rounding like Hugging Face's bf16 path fails this bound; a test shows it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import pagedwindow as pw
from pagedwindow import reference
from pagedwindow.gemma_prep import check_positive_fp32, check_prep_scalars, rope_inv_freq
from pagedwindow.testing import PagedBatch, random_batch

EPS, THETA = 1e-6, 10000.0
F32_EPS = torch.finfo(torch.float32).eps
LOW = (torch.bfloat16, torch.float16)


# -- the independent formula (Hugging Face's Gemma RMSNorm and default / linear RoPE) ---------------------------


def hf_norm(x, weight, eps, style, compute):
    """Gemma4RMSNorm (``* w``) / Gemma3RMSNorm (``* (1 + w)``); weight None: the unweighted norm (Gemma 4's v)."""
    x = x.to(compute)
    normed = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is None:
        return normed
    w = weight.detach().to(compute)
    return normed * (w if style == "gemma4" else 1 + w)


def hf_inv_freq(head_dim, theta, factor=1.0):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return inv_freq / factor if factor != 1.0 else inv_freq  # "linear" scaling: positions divided by the factor


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_cos_sin(positions, inv_freq, compute):
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [rows, D/2] fp32
    emb = torch.cat((freqs, freqs), dim=-1)  # [rows, D]
    return emb.cos().to(compute)[:, None, :], emb.sin().to(compute)[:, None, :]  # [rows, 1, D]


@dataclass
class Want:
    q: torch.Tensor  # [rows, hq, D] compute dtype
    k: torch.Tensor
    v: torch.Tensor  # gemma4: compute dtype; gemma3: the input's dtype (v as given)
    qn: torch.Tensor  # the normed, weighted q / k before RoPE
    kn: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor


def positions_of(starts, seqs):
    pieces = [torch.arange(s, s + n) for s, n in zip(starts, seqs) if n]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


# -- cases ------------------------------------------------------------------------------------------------------


@dataclass
class Case:
    b: PagedBatch
    wq: torch.Tensor
    wk: torch.Tensor
    starts: list
    seqs: list

    @property
    def rows(self):
        return sum(self.seqs)


def make_case(
    seed,
    *,
    seqs,
    starts,
    page_size=16,
    head_dim=64,
    dtype=torch.float32,
    heads=(4, 2),
    weight_dtype=None,
    style="gemma4",
    **kwargs,
):
    gen = torch.Generator().manual_seed(seed)
    b = random_batch(
        gen,
        seq_lens=seqs,
        start_positions=starts,
        page_size=page_size,
        num_qo_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        dtype=dtype,
        **kwargs,
    )
    wdt = dtype if weight_dtype is None else weight_dtype
    spread = 1.0 if style == "gemma4" else 0.3  # gemma3 weights sit around 0 (the factor is 1 + w)
    wq = (torch.randn(head_dim, generator=gen, dtype=torch.float64) * spread).to(wdt)
    wk = (torch.randn(head_dim, generator=gen, dtype=torch.float64) * spread).to(wdt)
    return Case(b, wq, wk, list(starts), list(seqs))


def formula(c: Case, *, eps=EPS, theta=THETA, style="gemma4", factor=1.0) -> Want:
    b, rows = c.b, c.rows
    compute = torch.float64 if b.pool.dtype == torch.float64 else torch.float32
    # fp32: eps as Hugging Face passes it (a Python float added to an fp32 tensor). fp64: the op documents eps
    # "used in fp32", so the formula takes eps rounded to fp32 there.
    eps_used = eps if compute == torch.float32 else float(np.float32(eps))
    positions = positions_of(c.starts, c.seqs)
    cos, sin = hf_cos_sin(positions, hf_inv_freq(b.layout.head_dim, theta, factor), compute)
    qn = hf_norm(b.q[:rows], c.wq, eps_used, style, compute)
    kn = hf_norm(b.k[:rows], c.wk, eps_used, style, compute)
    v = hf_norm(b.v[:rows], None, eps_used, style, compute) if style == "gemma4" else b.v[:rows]
    q = qn * cos + rotate_half(qn) * sin
    k = kn * cos + rotate_half(kn) * sin
    return Want(q, k, v, qn, kn, cos, sin, positions)


def run_prep(c: Case, **overrides):
    b = c.b
    args = dict(
        q=b.q,
        k=b.k,
        v=b.v,
        pool=b.pool,
        layout=b.layout,
        layer=b.layer,
        plan=b.plan,
        q_norm_weight=c.wq,
        k_norm_weight=c.wk,
        eps=EPS,
        rope_theta=THETA,
        norm_style="gemma4",
        rope_position_factor=1.0,
        out_q=None,
        backend="reference",
    )
    args.update(overrides)
    positional = [args.pop(n) for n in ("q", "k", "v", "pool", "layout", "layer", "plan")]
    return pw.prepare_paged_qkv(*positional, **args)


def prep_call(c: Case, **overrides):
    return lambda: run_prep(c, **overrides)


# -- comparisons ------------------------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers (NaN-safe, -0.0 != 0.0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a.contiguous()), bits(b.contiguous()))


def half_ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of ``dtype`` at ``|x|`` (its binade; subnormal spacing below the normal range)."""
    finfo = torch.finfo(dtype)
    _, exponent = torch.frexp(x.double())  # x = m 2^e, 0.5 <= |m| < 1: the binade's ulp is 2^(e-1) * eps
    ulp = torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent - 1) * finfo.eps
    return ulp.clamp_min(finfo.smallest_normal * finfo.eps) / 2


def rotation_bound(want_normed, cos, sin, out_dtype, want):
    scale = (
        want_normed.double().abs() * cos.double().abs() + rotate_half(want_normed).double().abs() * sin.double().abs()
    )
    bound = 4 * F32_EPS * scale
    if out_dtype in LOW:
        bound = bound + half_ulp(want, out_dtype)
    return bound


def assert_rotated_close(got, want, normed, cos, sin):
    err = (got.double() - want.double()).abs()
    bound = rotation_bound(normed, cos, sin, got.dtype, want)
    excess = err - bound
    assert bool((excess <= 0).all()), f"max error past the bound: {float(excess.max())} (max error {float(err.max())})"


def slot_mask(c: Case, which: int | None = None) -> torch.Tensor:
    """``[num_pages, num_layers, 2, page_size]``: the layer's new slots (K: which=0, V: 1, both: None)."""
    b = c.b
    ps = b.layout.page_size
    mask = torch.zeros(b.pool.shape[:4], dtype=torch.bool)
    for pages, start, seq in zip(b.plan.pages, c.starts, c.seqs):
        for pos in range(start, start + seq):
            if which is None:
                mask[pages[pos // ps], b.layer, :, pos % ps] = True
            else:
                mask[pages[pos // ps], b.layer, which, pos % ps] = True
    return mask


def gather_new(pool: torch.Tensor, c: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The new rows' K and V read back from ``pool`` by position (page ``pages[pos // ps]``, slot ``pos % ps``)."""
    b = c.b
    ps = b.layout.page_size
    k_rows, v_rows = [], []
    for pages, start, seq in zip(b.plan.pages, c.starts, c.seqs):
        for pos in range(start, start + seq):
            k_rows.append(pool[pages[pos // ps], b.layer, 0, pos % ps])
            v_rows.append(pool[pages[pos // ps], b.layer, 1, pos % ps])
    empty = pool.new_zeros((0, b.layout.num_kv_heads, b.layout.head_dim))
    return (torch.stack(k_rows) if k_rows else empty), (torch.stack(v_rows) if v_rows else empty)


def check_everything(c: Case, got_q, pool_before, want: Want, style):
    """q, K and V against the formula; the pool against append_paged_kv of the formula's K/V into a copy of it."""
    b = c.b
    dt = b.pool.dtype
    assert got_q.dtype == dt and got_q.shape == (c.rows, b.plan.num_qo_heads, b.layout.head_dim)
    assert_rotated_close(got_q, want.q, want.qn, want.cos, want.sin)
    at_zero = want.positions == 0  # cos 1, sin 0 exactly: the normed q itself
    assert bit_equal(got_q[at_zero], want.qn[at_zero].to(dt))
    expected = pool_before.clone()
    pw.append_paged_kv(want.k.to(dt), want.v.to(dt), expected, b.layout, b.layer, b.plan, backend="reference")
    k_slots = slot_mask(c, 0)
    # every byte but the new K slots: V exactly as the formula's, and every other slot, layer and page unchanged
    assert torch.equal(bits(b.pool)[~k_slots], bits(expected)[~k_slots])
    got_k, got_v = gather_new(b.pool, c)
    assert_rotated_close(got_k, want.k, want.kn, want.cos, want.sin)
    assert bit_equal(got_k[at_zero], want.kn[at_zero].to(dt))
    assert bit_equal(got_v, want.v.to(dt))
    if style == "gemma3":
        assert bit_equal(got_v, b.v[: c.rows])  # v as given
    untouched = ~slot_mask(c)
    assert torch.equal(bits(b.pool)[untouched], bits(pool_before)[untouched])


# -- the math ---------------------------------------------------------------------------------------------------

RAGGED = dict(seqs=[5, 0, 9, 1], starts=[3, 7, 0, 20])  # cached prefixes, an empty request, a request from 0


@pytest.mark.parametrize("style", ["gemma4", "gemma3"])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_matches_the_hf_formula(dtype, head_dim, style):
    c = make_case(head_dim + len(style), head_dim=head_dim, dtype=dtype, style=style, **RAGGED)
    before = c.b.pool.clone()
    out_q = torch.full((c.rows + 3, 4, head_dim), float("nan"), dtype=dtype)
    out_before = out_q.clone()
    got = run_prep(c, norm_style=style, out_q=out_q)
    assert got.data_ptr() == out_q.data_ptr() and got.shape[0] == c.rows
    check_everything(c, got, before, formula(c, style=style), style)
    assert bit_equal(out_q[c.rows :], out_before[c.rows :]), "rows past total_tokens were written"


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("factor", [1.0, 8.0, 0.25])
@pytest.mark.parametrize("theta", [10000.0, 1e6, 10000.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_page_sizes_thetas_and_position_factors(page_size, factor, theta, dtype):
    c = make_case(page_size, page_size=page_size, head_dim=64, dtype=dtype, heads=(2, 2), **RAGGED)
    before = c.b.pool.clone()
    got = run_prep(c, rope_theta=theta, rope_position_factor=factor)
    check_everything(c, got, before, formula(c, theta=theta, factor=factor), "gemma4")


def test_the_position_factor_changes_the_angles():
    c = make_case(1, **RAGGED)
    plain = run_prep(c, out_q=torch.empty(c.rows, 4, 64))
    scaled = run_prep(make_case(1, **RAGGED), rope_position_factor=8.0)
    at_zero = positions_of(c.starts, c.seqs) == 0
    assert torch.equal(plain[at_zero], scaled[at_zero]) and (plain[~at_zero] - scaled[~at_zero]).abs().max() > 0.1


@pytest.mark.parametrize("head_dim", [2, 8, 96, 510])
def test_any_even_head_dim_up_to_512(head_dim):
    # the reference takes every even head_dim <= 512; the CUDA kernel only 64/128/256/512 (auto falls back)
    c = make_case(head_dim, head_dim=head_dim, **RAGGED)
    before = c.b.pool.clone()
    check_everything(c, run_prep(c), before, formula(c), "gemma4")


@pytest.mark.parametrize("heads", [(8, 1), (3, 3), (6, 2)])
def test_gqa_head_counts(heads):
    c = make_case(sum(heads), head_dim=64, heads=heads, **RAGGED)
    before = c.b.pool.clone()
    check_everything(c, run_prep(c, norm_style="gemma3"), before, formula(c, style="gemma3"), "gemma3")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("style", ["gemma4", "gemma3"])
def test_fp32_weights_on_any_pool(dtype, style):
    c = make_case(3, dtype=dtype, weight_dtype=torch.float32, style=style, **RAGGED)
    assert c.wq.dtype == torch.float32 and c.b.pool.dtype == dtype
    before = c.b.pool.clone()
    check_everything(c, run_prep(c, norm_style=style), before, formula(c, style=style), style)


def test_weights_of_mixed_dtypes_are_refused():
    # q weight fp32, k weight in the pool's bf16: refused (the kernel reads both weights with one dtype flag)
    c = make_case(4, dtype=torch.bfloat16, **RAGGED)
    c.wq = c.wq.float() + 1e-3
    out_q = out_for(c)
    expect_refusal(prep_call(c, out_q=out_q), "must share a dtype", out_q, c.b.pool)


def test_large_positions():
    # positions past 30000 (fp32 angles of order 3e4 radians): still within the bound
    c = make_case(5, seqs=[3, 2], starts=[30000, 0], page_size=1024, head_dim=64, heads=(2, 1), num_layers=1, layer=0)
    before = c.b.pool.clone()
    got = run_prep(c, rope_theta=1e6)
    check_everything(c, got, before, formula(c, theta=1e6), "gemma4")


def test_gemma3_v_is_copied_bit_for_bit_even_when_not_finite():
    c = make_case(6, seqs=[3], starts=[1], head_dim=64)
    c.b.v[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    run_prep(c, norm_style="gemma3")
    _, got_v = gather_new(c.b.pool, c)
    assert bit_equal(got_v, c.b.v)


def test_the_op_rounds_once_which_a_per_step_bf16_path_does_not():
    """The bound of the bf16 tests discriminates: Hugging Face's own bf16 path (the norm rounded to bf16, cos/sin
    in bf16, each product rounded) breaks the half-ulp bound, the op meets it."""
    c = make_case(7, dtype=torch.bfloat16, head_dim=128, **RAGGED)
    want = formula(c)
    got = run_prep(c)
    bound = rotation_bound(want.qn, want.cos, want.sin, torch.bfloat16, want.q)
    assert bool(((got.double() - want.q.double()).abs() <= bound).all())
    qn = hf_norm(c.b.q[: c.rows], c.wq, EPS, "gemma4", torch.float32).to(torch.bfloat16)
    cos, sin = want.cos.to(torch.bfloat16), want.sin.to(torch.bfloat16)
    stepwise = qn * cos + rotate_half(qn) * sin
    assert bool(((stepwise.double() - want.q.double()).abs() > bound).any())


def test_eps_is_used_in_fp32():
    # fp64 inputs small enough that eps dominates: eps 0.1 acts as fp32(0.1), visibly not as the double 0.1
    c = make_case(8, dtype=torch.float64, **RAGGED)
    c.b.q.mul_(1e-2)
    c.b.k.mul_(1e-2)
    c.b.v.mul_(1e-2)
    rounded = float(np.float32(0.1))
    assert rounded != 0.1
    got = run_prep(c, eps=0.1, out_q=torch.empty(c.rows, 4, 64, dtype=torch.float64))
    assert torch.equal(got, run_prep(c, eps=rounded, out_q=torch.empty(c.rows, 4, 64, dtype=torch.float64)))
    unrounded = torch.empty_like(got)
    geometry = pw.checked_paged_geometry("test", c.b.layout, c.b.pool, c.b.layer, 64, 2)
    reference.prepare_paged_qkv(
        c.b.q,
        c.b.k,
        c.b.v,
        c.b.pool.clone(),
        geometry,
        c.b.plan,
        q_norm_weight=c.wq,
        k_norm_weight=c.wk,
        eps=0.1,
        inv_freq=rope_inv_freq(64, THETA),
        norm_style="gemma4",
        out_q=unrounded,
    )
    assert (unrounded - got).abs().max() > 1e-12, "the rounding is visible in float64"


@pytest.mark.parametrize(
    "head_dim, theta, factor", [(64, 10000.0, 1.0), (256, 1e6, 1.0), (128, 10000.0, 8.0), (512, 10000.3, 0.5)]
)
def test_inverse_frequencies_are_hugging_faces(head_dim, theta, factor):
    assert rope_inv_freq(head_dim, theta, factor) == tuple(hf_inv_freq(head_dim, theta, factor).tolist())


def test_extra_input_rows_are_not_read():
    c = make_case(9, **RAGGED)
    rows = c.rows
    before = c.b.pool.clone()
    want = formula(c)
    poison = float("nan")
    q = torch.cat([c.b.q, torch.full((2, 4, 64), poison)])
    k = torch.cat([c.b.k, torch.full((2, 2, 64), poison)])
    v = torch.cat([c.b.v, torch.full((2, 2, 64), poison)])
    got = run_prep(c, q=q, k=k, v=v)
    assert got.shape[0] == rows and not got.isnan().any()
    check_everything(c, got, before, want, "gemma4")


def test_returns_a_fresh_tensor_or_out_q_itself():
    c = make_case(10, **RAGGED)
    fresh = run_prep(c)
    assert fresh.shape == (c.rows, 4, 64) and fresh.dtype == torch.float32
    out_q = torch.empty(c.rows, 4, 64)
    assert run_prep(make_case(10, **RAGGED), out_q=out_q) is out_q and torch.equal(out_q, fresh)


# -- plans: preallocated, empty ---------------------------------------------------------------------------------


def plan_kwargs(c: Case):
    p = c.b.plan
    return dict(num_qo_heads=p.num_qo_heads, num_kv_heads=p.num_kv_heads, head_dim=p.head_dim, page_size=p.page_size)


def test_preallocated_plan_after_update():
    c = make_case(11, **RAGGED)
    exact = c.b.plan
    plan = pw.PrefillPagedPlan.preallocated(max_total_tokens=64, max_total_pages=32, max_batch=8, max_tiles=16)
    plan.update(list(exact.pages), exact.last_page_len.tolist(), c.starts, c.seqs, **plan_kwargs(c))
    before = c.b.pool.clone()
    got = run_prep(c, plan=plan)
    check_everything(c, got, before, formula(c), "gemma4")
    # re-planned in place for another batch: the next call follows the new plan
    pages = [[6, 7]]
    plan.update(pages, [4], [18], [2], **plan_kwargs(c))
    other = Case(PagedBatch(c.b.layout, c.b.pool, c.b.layer, plan, c.b.q, c.b.k, c.b.v, [], []), c.wq, c.wk, [18], [2])
    pool = c.b.pool.clone()
    got = run_prep(other)  # q, k, v have more rows than the plan's 2: the rest are ignored
    assert got.shape == (2, 4, 64)
    check_everything(other, got, pool, formula(other), "gemma4")


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_a_plan_with_no_new_rows_writes_nothing(backend):
    c = make_case(12, seqs=[0, 0], starts=[5, 17], page_size=4, head_dim=8)
    assert c.b.plan.total_tokens == 0
    pool, out_q = c.b.pool.clone(), torch.randn(3, 4, 8)
    out_before = out_q.clone()
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)  # extra rows: ignored
    got = run_prep(c, q=q, k=k, v=v, out_q=out_q, backend=backend)
    assert got.shape == (0, 4, 8) and got.untyped_storage().data_ptr() == out_q.untyped_storage().data_ptr()
    assert bit_equal(out_q, out_before) and bit_equal(c.b.pool, pool)
    assert run_prep(c, backend=backend).shape == (0, 4, 8) and bit_equal(c.b.pool, pool)
    # the checks still run first
    expect_refusal(prep_call(c, eps=0.0, out_q=out_q, backend=backend), "eps = 0.0", out_q, c.b.pool)
    expect_refusal(
        prep_call(c, q=torch.randn(0, 5, 8), out_q=out_q, backend=backend), "q shape (0, 5, 8)", out_q, c.b.pool
    )
    expect_refusal(prep_call(c, backend="triton"), "backend 'triton' is not one of", c.b.pool)
    expect_refusal(prep_call(c, rope_position_factor=1e-300), "outside fp32's normal range", c.b.pool)


# -- autograd and inference mode --------------------------------------------------------------------------------


def test_inputs_that_require_grad_are_read_detached():
    c = make_case(13, **RAGGED)
    want = run_prep(make_case(13, **RAGGED))
    want_pool = make_case(13, **RAGGED)
    run_prep(want_pool)
    q, k, v = (t.clone().requires_grad_() for t in (c.b.q, c.b.k, c.b.v))
    wq, wk = torch.nn.Parameter(c.wq.clone()), torch.nn.Parameter(c.wk.clone())
    got = run_prep(c, q=q, k=k, v=v, q_norm_weight=wq, k_norm_weight=wk)
    assert not got.requires_grad and got.grad_fn is None and torch.equal(got, want)
    assert torch.equal(c.b.pool, want_pool.b.pool) and not c.b.pool.requires_grad
    out_q = torch.empty_like(want)
    got = run_prep(c, q=q, k=k, v=v, q_norm_weight=wq, k_norm_weight=wk, out_q=out_q, norm_style="gemma3")
    assert got is out_q and not out_q.requires_grad
    assert all(t.grad is None for t in (q, k, v, wq, wk))


def test_out_q_or_pool_that_requires_grad_is_refused():
    c = make_case(14, **RAGGED)
    out_q = torch.randn(c.rows, 4, 64, requires_grad=True)
    expect_refusal(
        prep_call(c, out_q=out_q),
        "prepare_paged_qkv: out_q requires grad; the op writes it in place and is not differentiable",
        out_q,
        c.b.pool,
    )
    leaf = torch.randn(c.rows, 4, 64, requires_grad=True)
    view = leaf[:]  # a non-leaf tracked by autograd
    expect_refusal(prep_call(c, out_q=view), "out_q requires grad", view, c.b.pool)
    pool = c.b.pool.clone().requires_grad_()
    expect_refusal(prep_call(c, pool=pool), "prepare_paged_qkv: pool requires grad", pool)


def test_inference_tensors_are_written_only_inside_inference_mode():
    c = make_case(15, **RAGGED)
    want = run_prep(make_case(15, **RAGGED))
    with torch.inference_mode():
        out_q = torch.randn(c.rows, 4, 64)
        pool = c.b.pool.clone()
    expect_refusal(
        prep_call(c, out_q=out_q),
        "prepare_paged_qkv: out_q was made under torch.inference_mode() and may only be written inside inference mode",
        out_q,
        c.b.pool,
    )
    expect_refusal(prep_call(c, pool=pool), "pool was made under torch.inference_mode()", pool)
    with torch.inference_mode():
        got = run_prep(c, out_q=out_q, pool=pool)
        assert got is out_q and torch.equal(out_q, want)
    # inference-mode inputs are only read: accepted outside inference mode
    with torch.inference_mode():
        q, k, v, wq, wk = (t.clone() for t in (c.b.q, c.b.k, c.b.v, c.wq, c.wk))
    got = run_prep(c, q=q, k=k, v=v, q_norm_weight=wq, k_norm_weight=wk)
    assert torch.equal(got, want) and not got.is_inference()
    assert torch.equal(pool, c.b.pool)


# -- refusals ---------------------------------------------------------------------------------------------------

HQ, HKV, D, PS = 4, 2, 8, 4


@pytest.fixture
def case():
    return make_case(7, seqs=[5, 3], starts=[2, 0], page_size=PS, head_dim=D, heads=(HQ, HKV))


def expect_refusal(fn, fragment, *watched):
    before = [bits(t.detach()).clone() for t in watched]
    with pytest.raises(pw.PagedWindowError) as err:
        fn()
    assert fragment in str(err.value), str(err.value)
    for t, b in zip(watched, before):
        assert torch.equal(bits(t.detach()), b), "a refused call wrote to its output, its pool or an input"
    return str(err.value)


def out_for(c):
    return torch.full((c.rows, HQ, D), 7.0)


BAD_REALS = [
    (0, "= 0.0 must be finite and > 0"),
    (0.0, "= 0.0 must be finite and > 0"),
    (-1.0, "= -1.0 must be finite and > 0"),
    (-0.0, "= -0.0 must be finite and > 0"),
    (math.nan, "= nan must be finite and > 0"),
    (math.inf, "= inf must be finite and > 0"),
    (-math.inf, "= -inf must be finite and > 0"),
    (True, "must be a real number, got True"),
    (False, "must be a real number, got False"),
    ("1e-6", "must be a real number, got '1e-6'"),
    (None, "must be a real number, got None"),
    (torch.tensor(1.0), "must be a real number"),
    (1j, "must be a real number"),
]


@pytest.mark.parametrize("value, fragment", BAD_REALS + [(1e-45, "is outside fp32's normal range")], ids=repr)
def test_bad_eps(case, value, fragment):
    out_q = out_for(case)
    message = expect_refusal(prep_call(case, eps=value, out_q=out_q), fragment, out_q, case.b.pool)
    assert message.startswith("prepare_paged_qkv: eps"), message


@pytest.mark.parametrize("value", [1e-39, 1e-45, 5e-324, 1e39, 3.4028236e38], ids=repr)
def test_eps_outside_fp32s_normal_range(case, value):
    out_q = out_for(case)
    expect_refusal(prep_call(case, eps=value, out_q=out_q), f"eps = {value!r} is outside fp32's normal range", out_q)


def test_eps_at_fp32s_bounds_is_accepted(case):
    tiny = float(np.finfo(np.float32).tiny)
    got = run_prep(case, eps=tiny)
    assert torch.isfinite(got).all()
    got = run_prep(case, eps=float(np.finfo(np.float32).max))
    assert torch.isfinite(got).all() and got.abs().max() < 1e-15  # x / sqrt(3.4e38)


@pytest.mark.parametrize("name", ["rope_theta", "rope_position_factor"])
@pytest.mark.parametrize("value, fragment", BAD_REALS, ids=repr)
def test_bad_rope_scalars(case, name, value, fragment):
    out_q = out_for(case)
    message = expect_refusal(prep_call(case, **{name: value}, out_q=out_q), fragment, out_q, case.b.pool)
    assert message.startswith(f"prepare_paged_qkv: {name}"), message


@pytest.mark.parametrize(
    "theta, factor, fragment",
    [
        (1e-50, 1.0, "(1.0 .. inf)"),  # theta 0 in fp32: 1 / 0 ** x
        (1e-300, 1.0, "(1.0 .. inf)"),
        (1e39, 1.0, "(0.0 .. 1.0)"),  # theta inf in fp32: every frequency but the first is 0
        (1e300, 1.0, "(0.0 .. 1.0)"),
        (THETA, 1e-300, "(inf .. inf)"),
        (THETA, 1e300, "(0.0 .. 0.0)"),
        (THETA, 1e-39, "inf"),
    ],
)
def test_inverse_frequencies_outside_fp32(case, theta, factor, fragment):
    out_q = out_for(case)
    message = expect_refusal(
        prep_call(case, rope_theta=theta, rope_position_factor=factor, out_q=out_q),
        "gives inverse frequencies outside fp32's normal range",
        out_q,
        case.b.pool,
    )
    assert (
        message.startswith(f"prepare_paged_qkv: rope_theta = {theta!r} with position factor {factor!r}")
        and fragment in message
    )


def test_a_small_theta_overflows_the_highest_inverse_frequency():
    # head_dim 64, theta 1e-40 (an fp32 subnormal): theta ** (-62/64) ~ 1e38.7 is past fp32's range; at head_dim 8
    # the highest frequency is theta ** (-6/8) ~ 1e30, accepted
    c = make_case(2, seqs=[3], starts=[1], page_size=PS, head_dim=64, heads=(2, 1))
    out_q = torch.zeros(3, 2, 64)
    message = expect_refusal(
        prep_call(c, rope_theta=1e-40, out_q=out_q), "outside fp32's normal range", out_q, c.b.pool
    )
    assert message.endswith("(1.0 .. inf)"), message
    small = make_case(2, seqs=[3], starts=[1], page_size=PS, head_dim=D, heads=(HQ, HKV))
    assert torch.isfinite(run_prep(small, rope_theta=1e-40)).all()


def test_rope_angle_overflow(case):
    # factor 2e-38: inverse frequency 5e37 (a normal fp32), but 5e37 * 12 (3 pages of 4) overflows fp32
    out_q = out_for(case)
    expect_refusal(
        prep_call(case, rope_position_factor=2e-38, out_q=out_q),
        "RoPE angle at position 12 overflows fp32 (inverse frequency up to 4.99",
        out_q,
        case.b.pool,
    )
    # the same factor on a plan whose positions stay below the bound: accepted, finite
    small = make_case(1, seqs=[4], starts=[0], page_size=4, head_dim=D, heads=(HQ, HKV))
    got = run_prep(small, rope_position_factor=2e-38)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("style", ["gemma2", "Gemma4", "gemma4 ", "", None, 4, b"gemma4", ("gemma4",), ["gemma3"]])
def test_bad_norm_style(case, style):
    out_q = out_for(case)
    expect_refusal(
        prep_call(case, norm_style=style, out_q=out_q),
        f"norm_style {style!r} is not one of ('gemma4', 'gemma3')",
        out_q,
        case.b.pool,
    )


@pytest.mark.parametrize("name", ["eps", "rope_theta", "rope_position_factor"])
def test_a_huge_integer_scalar_is_refused(case, name):
    out_q = out_for(case)
    expect_refusal(prep_call(case, **{name: 10**400}, out_q=out_q), name, out_q, case.b.pool)


@pytest.mark.parametrize("style", [np.array(["gemma4"]), np.array(["gemma4", "gemma3"])], ids=["one", "two"])
def test_a_norm_style_array_is_refused(case, style):
    out_q = out_for(case)
    expect_refusal(prep_call(case, norm_style=style, out_q=out_q), "norm_style", out_q, case.b.pool)


def test_the_scalars_are_checked_before_the_plan(case):
    expect_refusal(prep_call(case, eps=-1.0, plan=None), "eps = -1.0", case.b.pool)


# -- plan and pool ----------------------------------------------------------------------------------------------


def test_not_a_plan_or_an_unfilled_plan(case):
    out_q = out_for(case)
    for bad in ({"batch": 1}, None, case.b.plan.state):
        expect_refusal(
            prep_call(case, plan=bad, out_q=out_q), "plan must be a PrefillPagedPlan, got", out_q, case.b.pool
        )
    empty = pw.PrefillPagedPlan.preallocated(max_total_tokens=8, max_total_pages=8, max_batch=2, max_tiles=2)
    expect_refusal(
        prep_call(case, plan=empty, out_q=out_q),
        "prepare_paged_qkv: the plan was preallocated but never filled",
        out_q,
        case.b.pool,
    )


def test_plan_page_id_past_the_pool(case):
    top = case.b.plan.max_page_index
    small_pool = case.b.pool[:top].clone()  # the largest page id is one past the end
    out_q = out_for(case)
    expect_refusal(
        prep_call(case, pool=small_pool, out_q=out_q),
        f"prepare_paged_qkv: plan page id {top} is past the pool's {top} pages (bound {top - 1})",
        out_q,
        small_pool,
    )


def test_plan_page_size_disagrees_with_the_pool(case):
    out_q = torch.zeros(3, HQ, D)
    plan = pw.PrefillPagedPlan.single([0, 1], 1, 0, 3, **{**plan_kwargs(case), "page_size": 2})
    expect_refusal(
        prep_call(
            case, plan=plan, out_q=out_q, q=torch.randn(3, HQ, D), k=torch.randn(3, HKV, D), v=torch.randn(3, HKV, D)
        ),
        "plan.page_size 2 disagrees with the pool's 4",
        out_q,
        case.b.pool,
    )
    plan = pw.PrefillPagedPlan.single([0], 6, 0, 6, **{**plan_kwargs(case), "page_size": 8})
    out_q = torch.zeros(6, HQ, D)
    expect_refusal(
        prep_call(
            case, plan=plan, out_q=out_q, q=torch.randn(6, HQ, D), k=torch.randn(6, HKV, D), v=torch.randn(6, HKV, D)
        ),
        "plan.page_size 8 disagrees with the pool's 4",  # compared before the last page's length
        out_q,
        case.b.pool,
    )


@pytest.mark.parametrize(
    "change, fragment",
    [
        (dict(head_dim=16), "head_dim 16 disagrees with layout.head_dim 8"),
        (dict(num_kv_heads=4), "num_kv_heads 4 disagrees with layout.num_kv_heads 2"),
        (dict(num_qo_heads=8), "q shape (8, 4, 8) must be [rows, 8, 8]"),
    ],
)
def test_plan_heads_disagree_with_the_layout_or_q(case, change, fragment):
    p = case.b.plan
    plan = pw.PrefillPagedPlan.batch(
        list(p.pages), p.last_page_len.tolist(), case.starts, case.seqs, **{**plan_kwargs(case), **change}
    )
    out_q = out_for(case)
    expect_refusal(prep_call(case, plan=plan, out_q=out_q), fragment, out_q, case.b.pool)


def test_bad_layer_or_layout(case):
    out_q = out_for(case)
    expect_refusal(prep_call(case, layer=2, out_q=out_q), "layer 2 is out of range [0, 2)", out_q, case.b.pool)
    expect_refusal(prep_call(case, layer=True, out_q=out_q), "layer must be an integer", out_q, case.b.pool)
    expect_refusal(
        prep_call(case, layout=pw.PagedKvLayout(3, HKV, D, PS), out_q=out_q),
        "prepare_paged_qkv: pool shape",
        out_q,
        case.b.pool,
    )
    expect_refusal(prep_call(case, layout=(2, HKV, D, PS)), "layout must be a PagedKvLayout", case.b.pool)
    expect_refusal(prep_call(case, pool=case.b.pool.tolist()), "pool must be a torch.Tensor", case.b.pool)
    wide = torch.zeros(*case.b.pool.shape[:-1], 2 * D)[..., ::2]
    expect_refusal(prep_call(case, pool=wide), "pool must be contiguous", wide)


@pytest.mark.parametrize("head_dim", [1, 7, 514, 1024])
def test_head_dim_odd_or_past_512_is_refused(head_dim):
    # PrefillPagedPlan and PagedKvLayout take any positive head_dim; the prep refuses it
    plan = pw.PrefillPagedPlan.single([0], 3, 0, 3, num_qo_heads=1, num_kv_heads=1, head_dim=head_dim, page_size=4)
    layout = pw.PagedKvLayout(1, 1, head_dim, 4)
    pool = layout.allocate(1, torch.float32).normal_()
    q, k, v = (torch.randn(3, 1, head_dim) for _ in range(3))
    out_q = torch.zeros(3, 1, head_dim)
    w = torch.ones(head_dim)
    expect_refusal(
        lambda: pw.prepare_paged_qkv(
            q,
            k,
            v,
            pool,
            layout,
            0,
            plan,
            q_norm_weight=w,
            k_norm_weight=w,
            eps=EPS,
            rope_theta=THETA,
            norm_style="gemma4",
            out_q=out_q,
            backend="reference",
        ),
        f"prepare_paged_qkv: head_dim {head_dim} must be even and at most 512 (rotate-half RoPE)",
        out_q,
        pool,
    )


def test_colliding_new_rows_are_refused_when_the_plan_is_built(case):
    # prepare_paged_qkv writes where the plan says with no check of its own: plans whose new rows collide or
    # land in another request's cached prefix never exist, whichever way they are built
    kw = plan_kwargs(case)
    collide = "requests 0 and 1 both write page 0 slot 0"
    with pytest.raises(pw.PagedWindowError, match=collide):
        pw.PrefillPagedPlan.batch([[0], [0]], [2, 2], [0, 0], [2, 2], **kw)
    # a shared read-only prefix (slots 0..1 of page 3), then both write from slot 2
    with pytest.raises(pw.PagedWindowError, match="requests 0 and 1 both write page 3 slot 2"):
        pw.PrefillPagedPlan.batch([[3], [3]], [3, 4], [2, 2], [1, 2], **kw)
    with pytest.raises(pw.PagedWindowError, match=collide):
        pw.PrefillPagedPlan.from_csr([0, 2, 4], [0, 1, 2], [0, 0], [2, 2], **kw)


def test_new_rows_in_another_requests_prefix_are_refused_when_the_plan_is_built(case):
    kw = plan_kwargs(case)
    prefix = "request 1 writes new rows into page 0 slot 0, which request 0 reads as cached prefix (slots 0..3)"
    with pytest.raises(pw.PagedWindowError) as err:
        pw.PrefillPagedPlan.batch([[0, 1], [0]], [1, 2], [4, 0], [1, 2], **kw)
    assert prefix in str(err.value)
    with pytest.raises(pw.PagedWindowError) as err:
        pw.PrefillPagedPlan.from_csr([0, 1, 3], [0, 2, 3], [0, 1, 0], [1, 2], **kw)
    assert prefix in str(err.value)


def test_a_refused_update_leaves_the_plan_as_it_was(case):
    kw = plan_kwargs(case)
    plan = pw.PrefillPagedPlan.preallocated(max_total_tokens=16, max_total_pages=8, max_batch=4, max_tiles=8)
    p = case.b.plan
    plan.update(list(p.pages), p.last_page_len.tolist(), case.starts, case.seqs, **kw)
    version = plan.version
    with pytest.raises(pw.PagedWindowError, match="both write page 0 slot 0"):
        plan.update([[0], [0]], [2, 2], [0, 0], [2, 2], **kw)
    with pytest.raises(pw.PagedWindowError, match="reads as cached prefix"):
        plan.update([[0, 1], [0]], [1, 2], [4, 0], [1, 2], **kw)
    assert plan.version == version and plan.pages == p.pages and plan.seq_lens == p.seq_lens
    want = run_prep(make_case(7, seqs=[5, 3], starts=[2, 0], page_size=PS, head_dim=D, heads=(HQ, HKV)))
    before = case.b.pool.clone()
    got = run_prep(case, plan=plan)
    assert torch.equal(got, want)
    check_everything(case, got, before, formula(case), "gemma4")


# -- q, k, v, out_q ---------------------------------------------------------------------------------------------

TAILS = {"q": (HQ, D), "k": (HKV, D), "v": (HKV, D), "out_q": (HQ, D)}


def bad_tensor(kind, name, rows=8):
    h, d = TAILS[name]
    return {
        "rank": (torch.randn(rows, h * d), f"{name} shape ({rows}, {h * d}) must be [rows, {h}, {d}]"),
        "rank4": (torch.randn(rows, h, d, 1), f"{name} shape ({rows}, {h}, {d}, 1) must be [rows, {h}, {d}]"),
        "heads": (torch.randn(rows, h + 1, d), f"{name} shape ({rows}, {h + 1}, {d}) must be [rows, {h}, {d}]"),
        "head_dim": (torch.randn(rows, h, d + 2), f"{name} shape ({rows}, {h}, {d + 2}) must be [rows, {h}, {d}]"),
        "rows": (torch.randn(rows - 1, h, d), f"{name} has {rows - 1} rows; the plan needs {rows} (total_tokens)"),
        "dtype": (torch.randn(rows, h, d, dtype=torch.float64), f"{name} dtype torch.float64 must be torch.float32"),
        "bf16": (torch.randn(rows, h, d).bfloat16(), f"{name} dtype torch.bfloat16 must be torch.float32"),
        "meta": (torch.empty(rows, h, d, device="meta"), f"{name} is on meta but the pool is on cpu"),
        "strided": (torch.randn(h, rows, d).transpose(0, 1), f"{name} must be contiguous (strides"),
        "list": (torch.randn(rows, h, d).tolist(), f"{name} must be a torch.Tensor, got list"),
        "numpy": (np.zeros((rows, h, d), dtype=np.float32), f"{name} must be a torch.Tensor, got ndarray"),
    }[kind]


@pytest.mark.parametrize(
    "kind", ["rank", "rank4", "heads", "head_dim", "rows", "dtype", "bf16", "meta", "strided", "list", "numpy"]
)
@pytest.mark.parametrize("name", ["q", "k", "v", "out_q"])
def test_bad_q_k_v_out_q(case, name, kind):
    bad, fragment = bad_tensor(kind, name)
    out_q = out_for(case)
    overrides = {name: bad} if name != "out_q" else {"out_q": bad}
    if name != "out_q":
        overrides["out_q"] = out_q
    watched = [case.b.pool, out_q, case.b.q, case.b.k, case.b.v]
    if isinstance(bad, torch.Tensor) and bad.device.type == "cpu":
        watched.append(bad)
    message = expect_refusal(prep_call(case, **overrides), fragment, *watched)
    assert message.startswith("prepare_paged_qkv: "), message


def bad_weight(kind):
    return {
        "long": (torch.ones(D + 2), f"shape ({D + 2},) must be [{D}] (head_dim)"),
        "short": (torch.ones(D // 2), f"shape ({D // 2},) must be [{D}] (head_dim)"),
        "2d": (torch.ones(1, D), f"shape (1, {D}) must be [{D}] (head_dim)"),
        "scalar": (torch.tensor(1.0), f"shape () must be [{D}] (head_dim)"),
        "fp64": (
            torch.ones(D, dtype=torch.float64),
            "dtype torch.float64 must be the pool's torch.float32",
        ),
        "int": (torch.ones(D, dtype=torch.int64), "dtype torch.int64 must be"),
        "meta": (torch.ones(D, device="meta"), "is on meta but the pool is on cpu"),
        "strided": (torch.ones(2 * D)[::2], "must be contiguous (strides (2,))"),
        "list": ([1.0] * D, "must be a torch.Tensor, got list"),
        "none": (None, "must be a torch.Tensor, got NoneType"),
    }[kind]


@pytest.mark.parametrize("kind", ["long", "short", "2d", "scalar", "fp64", "int", "meta", "strided", "list", "none"])
@pytest.mark.parametrize("name", ["q_norm_weight", "k_norm_weight"])
def test_bad_norm_weights(case, name, kind):
    bad, fragment = bad_weight(kind)
    out_q = out_for(case)
    expect_refusal(
        prep_call(case, **{name: bad}, out_q=out_q), f"prepare_paged_qkv: {name} {fragment}", out_q, case.b.pool
    )


def test_a_weight_dtype_refusal_on_an_fp32_pool_names_fp32_once(case):
    out_q = out_for(case)
    message = expect_refusal(
        prep_call(case, q_norm_weight=torch.ones(D, dtype=torch.float64), out_q=out_q), "q_norm_weight", out_q
    )
    assert message.endswith("q_norm_weight dtype torch.float64 must be the pool's torch.float32"), message


@pytest.mark.parametrize("name", ["q_norm_weight", "k_norm_weight"])
@pytest.mark.parametrize(
    "pool_dtype, weight_dtype",
    [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float64)],
)
def test_weights_in_another_low_precision_dtype_are_refused(name, pool_dtype, weight_dtype):
    c = make_case(16, seqs=[3], starts=[1], page_size=PS, head_dim=D, heads=(HQ, HKV), dtype=pool_dtype)
    out_q = torch.zeros(3, HQ, D, dtype=pool_dtype)
    expect_refusal(
        prep_call(c, **{name: torch.ones(D, dtype=weight_dtype)}, out_q=out_q),
        f"{name} dtype {weight_dtype} must be the pool's {pool_dtype} or torch.float32",
        out_q,
        c.b.pool,
    )


# -- aliasing ---------------------------------------------------------------------------------------------------


def carve(shapes_and_offsets, total):
    """Views into one fp32 storage of ``total`` elements: (shape, first element) each, filled with noise."""
    storage = torch.randn(total)
    return [storage[o : o + math.prod(s)].view(s) for s, o in shapes_and_offsets]


INPUTS = ["q", "k", "v", "q_norm_weight", "k_norm_weight"]


def shape_of(case, name):
    return {
        "q": tuple(case.b.q.shape),
        "k": tuple(case.b.k.shape),
        "v": tuple(case.b.v.shape),
        "q_norm_weight": (D,),
        "k_norm_weight": (D,),
        "pool": tuple(case.b.pool.shape),
        "out_q": (case.rows, HQ, D),
    }[name]


def with_value(case, name):
    return {"q": case.b.q, "k": case.b.k, "v": case.b.v, "q_norm_weight": case.wq, "k_norm_weight": case.wk}.get(name)


@pytest.mark.parametrize("written, other", [("out_q", n) for n in INPUTS + ["pool"]] + [("pool", n) for n in INPUTS])
@pytest.mark.parametrize("gap", [-1, 0], ids=["one-element-overlap", "adjacent"])
def test_written_tensor_overlapping_an_input(case, written, other, gap):
    """``written`` and ``other`` carved from one storage: sharing their last / first element is refused, with
    nothing written; placed end to end they are accepted and give the answer of separate tensors."""
    n_written = math.prod(shape_of(case, written))
    w_view, o_view = carve(
        [(shape_of(case, written), 0), (shape_of(case, other), n_written + gap)],
        n_written + gap + math.prod(shape_of(case, other)),
    )
    if written == "pool" or other == "pool":
        pool_view = w_view if written == "pool" else o_view
        pool_view.copy_(case.b.pool)
    value = with_value(case, other)
    if value is not None:
        o_view.copy_(value)
    overrides = {written: w_view, other: o_view}
    if gap < 0:
        watched = [w_view, o_view] + ([case.b.pool] if "pool" not in overrides else [])
        expect_refusal(
            prep_call(case, **overrides), f"prepare_paged_qkv: {written} overlaps {other} in memory", *watched
        )
        return
    want_case = make_case(7, seqs=[5, 3], starts=[2, 0], page_size=PS, head_dim=D, heads=(HQ, HKV))
    want_q = run_prep(want_case)
    got_q = run_prep(case, **overrides)
    assert torch.equal(got_q, want_q)
    got_pool = overrides.get("pool", case.b.pool)
    assert torch.equal(got_pool, want_case.b.pool)


def test_out_q_as_q_itself_is_refused(case):
    expect_refusal(prep_call(case, out_q=case.b.q), "out_q overlaps q in memory", case.b.q, case.b.pool)
    inner = case.b.pool.view(-1)[: case.rows * HQ * D].view(case.rows, HQ, D)
    expect_refusal(prep_call(case, out_q=inner), "out_q overlaps pool in memory", case.b.pool)


# -- backends ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "CUDA", "", None, 0])
def test_bad_backend_name(case, backend):
    out_q = out_for(case)
    expect_refusal(
        prep_call(case, backend=backend, out_q=out_q),
        f"prepare_paged_qkv: backend {backend!r} is not one of ('auto', 'reference', 'cuda')",
        out_q,
        case.b.pool,
    )


def test_backend_cuda_on_cpu_tensors(case):
    out_q = out_for(case)
    expect_refusal(
        prep_call(case, backend="cuda", out_q=out_q),
        "prepare_paged_qkv: backend 'cuda' needs tensors on a CUDA device, got cpu",
        out_q,
        case.b.pool,
    )


def test_backend_auto_on_cpu_is_the_reference(case):
    want = run_prep(make_case(7, seqs=[5, 3], starts=[2, 0], page_size=PS, head_dim=D, heads=(HQ, HKV)))
    assert torch.equal(run_prep(case, backend="auto"), want)


# -- what the API hands out -------------------------------------------------------------------------------------


def test_mutating_the_returned_tensor(case):
    out_q = torch.full((case.rows + 2, HQ, D), 5.0)
    got = run_prep(case, out_q=out_q)
    pool_after = case.b.pool.clone()
    assert got.untyped_storage().data_ptr() == out_q.untyped_storage().data_ptr()  # a view of out_q, as documented
    got.zero_()
    assert (out_q[: case.rows] == 0).all() and (out_q[case.rows :] == 5.0).all()
    assert torch.equal(case.b.pool, pool_after), "the returned view shares nothing with the pool"
    fresh = run_prep(case)
    again = fresh.clone()
    fresh.fill_(1.0)
    assert torch.equal(run_prep(case), again), "no state survives in what was handed out"


def test_mutating_the_plans_arrays(case):
    plan = case.b.plan
    want = run_prep(make_case(7, seqs=[5, 3], starts=[2, 0], page_size=PS, head_dim=D, heads=(HQ, HKV)))
    pages, indptr, last, qo = plan.page_indices, plan.page_indptr, plan.last_page_len, plan.qo_indptr
    for t in (pages, indptr, last, qo, plan.request_indices, plan.qo_tile_indices):
        t.fill_(99)  # copies: the plan does not change
    buffer = plan.device_buffer("cpu")
    buffer.fill_(-1)
    arrays = plan.device_arrays("cpu")
    arrays.page_indices.fill_(1000)
    assert plan.page_indices.max() < 99 and plan.device_buffer("cpu").min() >= 0
    state = plan.state
    for name in ("page_indices", "page_indptr", "last_page_len", "qo_indptr"):  # views of the read-only block
        with pytest.raises(ValueError, match="WRITEABLE"):
            getattr(state, name).setflags(write=True)
    for name in ("page_indices", "page_indptr", "last_page_len", "qo_indptr", "start_positions", "packed"):
        with pytest.raises(ValueError, match="read-only"):
            getattr(state, name)[0] = 99
    with pytest.raises(AttributeError):
        state.max_page_index = 0  # a NamedTuple
    assert (
        isinstance(plan.pages, tuple) and isinstance(plan.pages[0], tuple) and isinstance(plan.start_positions, tuple)
    )
    assert torch.equal(run_prep(case), want)


def test_remembered_scalars_never_hide_a_bad_one():
    """The last accepted (eps, theta, factor) floats are remembered; a different or non-float value is checked in
    full, so a bad one after a good one is still refused."""
    good = check_prep_scalars("prep", 1e-6, 10000.0, 1.0)
    assert good == (check_positive_fp32("prep", "eps", 1e-6), 10000.0, 1.0)
    assert check_prep_scalars("prep", 1e-6, 10000.0, 1.0) == good
    bad = [
        ((math.nan, 10000.0, 1.0), "eps"),
        ((1e-6, math.inf, 1.0), "rope_theta"),
        ((1e-6, 10000.0, -1.0), "rope_position_factor"),
        ((1e-50, 10000.0, 1.0), "fp32"),
        ((True, 10000.0, 1.0), "real number"),
        ((1e-6, "10000", 1.0), "real number"),
    ]
    for args, text in bad:
        with pytest.raises(pw.PagedWindowError, match=text):
            check_prep_scalars("prep", *args)
        assert check_prep_scalars("prep", 1e-6, 10000.0, 1.0) == good  # and the good call still passes
    assert check_prep_scalars("prep", 1, 10000, 2) == (1.0, 10000.0, 2.0)  # ints: checked, converted
