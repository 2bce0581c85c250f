"""GPU tests of the fused Gemma prep kernel (``kernels/prepare_qkv.cu``): against a float64 truth and the
reference at every dtype, head_dim and norm style; untouched bytes; far positions; CUDA-graph replay across
plan updates; torch.compile; opcheck; the auto backend's routing."""

import warnings

import pytest
import torch

import pagedwindow as pw
from pagedwindow.testing import random_batch

from .gate_calls import weights

pytestmark = pytest.mark.cuda

EPS, THETA = 1e-6, 10000.0
HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def _batch(seed, *, dtype, head_dim, seq_lens=(37, 0, 1, 130), starts=(0, 50, 4095, 17), hq=8, hkv=4, ps=16):
    gen = torch.Generator().manual_seed(seed)
    return random_batch(
        gen,
        seq_lens=list(seq_lens),
        start_positions=list(starts),
        page_size=ps,
        num_qo_heads=hq,
        num_kv_heads=hkv,
        head_dim=head_dim,
        dtype=dtype,
        device="cuda",
    )


def _prep(b, q, k, v, pool, wq, wk, *, backend, norm_style="gemma4", factor=1.0, out_q=None):
    return pw.prepare_paged_qkv(
        q,
        k,
        v,
        pool,
        b.layout,
        b.layer,
        b.plan,
        q_norm_weight=wq,
        k_norm_weight=wk,
        eps=EPS,
        rope_theta=THETA,
        norm_style=norm_style,
        rope_position_factor=factor,
        out_q=out_q,
        backend=backend,
    )


def _truth(b, wq, wk, **kw):
    """The reference in float64 (angles in fp32, as the math defines them) on upcast copies."""
    pool = b.pool.double()
    out = _prep(b, b.q.double(), b.k.double(), b.v.double(), pool, wq.double(), wk.double(), backend="reference", **kw)
    return out, pool


def _within_rounding(got: torch.Tensor, truth: torch.Tensor, dtype) -> float:
    """max |got - truth| / (half an output ulp of |truth| + 1e-5 max |truth|): <= 1 when the kernel rounds its
    fp32 result once (fp32 math error bounded by 1e-5 of the tensor's scale)."""
    bound = HALF_ULP[dtype] * truth.abs() + 1e-5 * truth.abs().max() + 1e-30
    return ((got.double() - truth).abs() / bound).max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("norm_style", ["gemma4", "gemma3"])
def test_kernel_rounds_the_float64_truth_once(dtype, head_dim, norm_style):
    b = _batch(head_dim + len(norm_style), dtype=dtype, head_dim=head_dim)
    wq, wk = weights(head_dim, dtype, "cuda", head_dim=head_dim)
    want_q, want_pool = _truth(b, wq, wk, norm_style=norm_style)
    pool = b.pool.clone()
    ref_pool = b.pool.clone()
    got = _prep(b, b.q, b.k, b.v, pool, wq, wk, backend="cuda", norm_style=norm_style)
    ref = _prep(b, b.q, b.k, b.v, ref_pool, wq, wk, backend="reference", norm_style=norm_style)
    torch.cuda.synchronize()
    assert _within_rounding(got, want_q, dtype) <= 1.0
    assert _within_rounding(pool, want_pool, dtype) <= 1.0
    # kernel and reference round the same fp32 math: at most one output ulp apart
    ulp = 2 * HALF_ULP[dtype]
    assert ((got.double() - ref.double()).abs() <= ulp * ref.double().abs() + 1e-5 * ref.abs().max()).all()


@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 256), (torch.float32, 512), (torch.float16, 64)])
@pytest.mark.parametrize("norm_style", ["gemma4", "gemma3"])
def test_many_units_per_cta_match_the_truth(dtype, head_dim, norm_style):
    """The persistent grid with many units per CTA (3603 tokens; at fp32, head_dim 512 a unit holds 8 of a
    token's 32 rows, so four units per token), ragged and empty requests: every row is the truth rounded once."""
    b = _batch(11, dtype=dtype, head_dim=head_dim, seq_lens=(1500, 3, 0, 2100), starts=(0, 7, 100, 9000), hq=16, hkv=8)
    wq, wk = weights(11, dtype, "cuda", head_dim=head_dim)
    want_q, want_pool = _truth(b, wq, wk, norm_style=norm_style)
    pool = b.pool.clone()
    got = _prep(b, b.q, b.k, b.v, pool, wq, wk, backend="cuda", norm_style=norm_style)
    torch.cuda.synchronize()
    assert _within_rounding(got, want_q, dtype) <= 1.0
    assert _within_rounding(pool, want_pool, dtype) <= 1.0


def test_far_positions_rotate_like_the_truth():
    """Angles up to 2^20 * inv_freq[0] rad: the kernel's reduction of the fp32 angle must stay exact."""
    b = _batch(5, dtype=torch.float32, head_dim=64, seq_lens=(9, 3), starts=(1 << 20, 131_000), hq=2, hkv=1, ps=256)
    wq, wk = weights(5, torch.float32, "cuda", head_dim=64)
    want_q, want_pool = _truth(b, wq, wk)
    pool = b.pool.clone()
    got = _prep(b, b.q, b.k, b.v, pool, wq, wk, backend="cuda")
    assert _within_rounding(got, want_q, torch.float32) <= 1.0
    assert _within_rounding(pool, want_pool, torch.float32) <= 1.0


def test_fp32_weights_on_a_bf16_pool_and_a_position_factor():
    b = _batch(6, dtype=torch.bfloat16, head_dim=256)
    wq, wk = weights(6, torch.float32, "cuda", head_dim=256)
    want_q, want_pool = _truth(b, wq, wk, factor=8.0)
    pool = b.pool.clone()
    got = _prep(b, b.q, b.k, b.v, pool, wq, wk, backend="cuda", factor=8.0)
    assert _within_rounding(got, want_q, torch.bfloat16) <= 1.0
    assert _within_rounding(pool, want_pool, torch.bfloat16) <= 1.0


def test_rows_past_total_tokens_and_bytes_outside_the_slots_are_untouched():
    b = _batch(7, dtype=torch.bfloat16, head_dim=256)
    n = b.plan.total_tokens
    wq, wk = weights(7, torch.bfloat16, "cuda", head_dim=256)
    out_q = torch.full((n + 5, 8, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    pool = b.pool.clone()
    _prep(b, b.q, b.k, b.v, pool, wq, wk, backend="cuda", out_q=out_q)
    torch.cuda.synchronize()
    assert torch.isnan(out_q[n:]).all() and not torch.isnan(out_q[:n]).any()
    changed = pool.view(torch.int16) != b.pool.view(torch.int16)
    slots = torch.zeros_like(changed)
    _mark_new_slots(b, slots)
    assert not (changed & ~slots).any(), "the kernel wrote outside the new rows' slots"


def _mark_new_slots(b, mask):
    """Set ``mask`` True at every element of the layer's K and V slots of the plan's new rows."""
    layer_view = mask[:, b.layer]  # [num_pages, 2, page_size, hkv, d]
    for pages, start, seq in zip(b.plan.pages, b.plan.start_positions, b.plan.seq_lens):
        for pos in range(start, start + seq):
            layer_view[pages[pos // b.plan.page_size], :, pos % b.plan.page_size] = True


UPDATES = [([3, 200], [0, 0]), ([1] * 6, [4000, 10, 0, 77, 4095, 1]), ([0, 0], [9, 9]), ([511], [1])]


def test_cuda_graph_replay_across_plan_updates_equals_eager():
    """Capture prep + attention once on a preallocated plan; after each in-place update the replay equals eager
    bit for bit (q_out and pool) and leaves q_out rows past total_tokens untouched."""
    hq, hkv, d, ps, cap, num_pages = 16, 8, 256, 16, 512, 700
    plan = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=cap, max_total_pages=num_pages, max_batch=8, max_tiles=200, device="cuda"
    )
    layout = pw.PagedKvLayout(1, hkv, d, ps)
    pool = layout.allocate(num_pages, torch.bfloat16, "cuda")
    q = torch.zeros(cap, hq, d, dtype=torch.bfloat16, device="cuda")
    k = torch.zeros(cap, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    out_q = torch.empty_like(q)
    out = torch.empty_like(q)
    wq, wk = weights(8, torch.bfloat16, "cuda", head_dim=d)

    def step():
        pw.prepare_paged_qkv(
            q,
            k,
            v,
            pool,
            layout,
            0,
            plan,
            q_norm_weight=wq,
            k_norm_weight=wk,
            eps=EPS,
            rope_theta=THETA,
            norm_style="gemma4",
            out_q=out_q,
            backend="cuda",
        )
        pw.batch_prefill_paged_window(
            out_q, pool, layout, 0, plan, sm_scale=1.0, window_left=1023, out=out, backend="cuda"
        )

    gen = torch.Generator().manual_seed(8)
    cases = [
        random_batch(
            gen,
            seq_lens=seqs,
            start_positions=starts,
            page_size=ps,
            num_qo_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
            dtype=torch.bfloat16,
            device="cuda",
            num_pages=num_pages,
            num_layers=1,
            layer=0,
        )
        for seqs, starts in UPDATES
    ]

    def load(case):
        p = case.plan
        plan.update_csr(
            p.qo_indptr,
            p.page_indptr,
            p.page_indices,
            p.last_page_len,
            num_qo_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
            page_size=ps,
        )
        pool.copy_(case.pool)
        n = p.total_tokens
        q[:n], k[:n], v[:n] = case.q, case.k, case.v
        out_q.fill_(float("nan"))
        out.fill_(float("nan"))

    load(cases[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for case in cases:
        n = case.plan.total_tokens
        load(case)
        graph.replay()
        torch.cuda.synchronize()
        replayed_q, replayed_out, replayed_pool = out_q.clone(), out.clone(), pool.clone()
        load(case)
        step()
        torch.cuda.synchronize()
        assert torch.equal(replayed_q[:n], out_q[:n]) and torch.equal(replayed_out[:n], out[:n])
        assert torch.equal(replayed_pool, pool)
        assert torch.isnan(replayed_q[n:]).all()
        assert not torch.isnan(out_q[:n]).any()


def test_torch_compile_fullgraph_equals_eager():
    b = _batch(9, dtype=torch.bfloat16, head_dim=256)
    wq, wk = weights(9, torch.bfloat16, "cuda", head_dim=256)
    eager_pool, compiled_pool = b.pool.clone(), b.pool.clone()
    eager = _prep(b, b.q, b.k, b.v, eager_pool, wq, wk, backend="cuda")

    def direct(q, k, v, pool):
        return _prep(b, q, k, v, pool, wq, wk, backend="cuda")

    got = torch.compile(direct, fullgraph=True)(b.q, b.k, b.v, compiled_pool)
    torch.cuda.synchronize()
    assert torch.equal(got, eager) and torch.equal(compiled_pool, eager_pool)


def test_opcheck_prepare_op():
    b = _batch(10, dtype=torch.bfloat16, head_dim=256)
    wq, wk = weights(10, torch.bfloat16, "cuda", head_dim=256)
    plan = b.plan
    geo = pw.checked_paged_geometry("t", b.layout, b.pool, b.layer, 256, plan.num_kv_heads)
    out_q = torch.empty_like(b.q)
    torch.library.opcheck(
        torch.ops.pagedwindow.prepare_qkv.default,
        (
            b.q,
            b.k,
            b.v,
            b.pool,
            out_q,
            wq,
            wk,
            plan.device_buffer("cuda"),
            geo.k_offset,
            geo.v_offset,
            geo.page_stride,
            geo.page_size,
            plan.num_qo_heads,
            plan.num_kv_heads,
            256,
            list(plan.capacity.segment_offsets()),
            plan.capacity.max_batch,
            plan.capacity.max_total_tokens,
            EPS,
            THETA,
            1.0,
            "gemma4",
        ),
    )


def test_auto_runs_the_kernel_and_falls_back_on_misaligned_tensors():
    b = _batch(11, dtype=torch.bfloat16, head_dim=256)
    wq, wk = weights(11, torch.bfloat16, "cuda", head_dim=256)
    auto_pool, cuda_pool = b.pool.clone(), b.pool.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto = _prep(b, b.q, b.k, b.v, auto_pool, wq, wk, backend="auto")
    direct = _prep(b, b.q, b.k, b.v, cuda_pool, wq, wk, backend="cuda")
    assert torch.equal(auto, direct) and torch.equal(auto_pool, cuda_pool)
    shifted = torch.empty(b.q.numel() + 1, dtype=torch.bfloat16, device="cuda")[1:].view(b.q.shape)
    shifted.copy_(b.q)
    with pytest.raises(pw.PagedWindowError, match="16-byte aligned"):
        _prep(b, shifted, b.k, b.v, cuda_pool, wq, wk, backend="cuda")
    with pytest.warns(RuntimeWarning, match="16-byte aligned"):
        fallback = _prep(b, shifted, b.k, b.v, b.pool.clone(), wq, wk, backend="auto")
    ref = _prep(b, b.q, b.k, b.v, b.pool.clone(), wq, wk, backend="reference")
    assert torch.equal(fallback, ref)
