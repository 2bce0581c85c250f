"""The PyTorch reference against an independent dense float64 attention; append-then-attend round trips."""

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedwindow as pw
from pagedwindow.testing import dense_attention, error_bound, max_abs_err, random_batch

CONFIGS = [
    # (page_size, seq_lens, start_positions, heads (qo, kv))
    (1, [5, 1], [0, 3], (2, 2)),
    (3, [7, 0, 4], [2, 5, 0], (4, 2)),
    (16, [37, 9], [0, 21], (8, 2)),
    (3, [13], [17], (16, 1)),
    (16, [3, 17, 1], [40, 0, 0], (8, 1)),
    (1, [6, 2], [1, 1], (4, 4)),
]
WINDOWS = [-1, 0, 1, 7, 200]


def fp32(scale: float) -> float:
    """The scale every backend computes with: ``sm_scale`` rounded to fp32 (``semantics.check_sm_scale``)."""
    return float(np.float32(scale))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"ps{c[0]}-seq{c[1]}-start{c[2]}-h{c[3][0]}x{c[3][1]}")
@pytest.mark.parametrize("window_left", WINDOWS)
def test_reference_matches_dense_float64(config, window_left):
    page_size, seqs, starts, (hq, hkv) = config
    gen = torch.Generator().manual_seed(zlib.crc32(f"ps{page_size}-seq{seqs}-w{window_left}".encode()))
    case = random_batch(
        gen, seq_lens=seqs, start_positions=starts, page_size=page_size, num_qo_heads=hq, num_kv_heads=hkv, head_dim=16
    )
    pw.append_paged_kv(case.k, case.v, case.pool, case.layout, case.layer, case.plan)
    out = torch.full((case.plan.total_tokens + 2, hq, 16), float("nan"), dtype=torch.float64)
    lse = torch.full((case.plan.total_tokens + 2, hq), float("nan"), dtype=torch.float32)
    got = pw.batch_prefill_paged_window(
        case.q,
        case.pool,
        case.layout,
        case.layer,
        case.plan,
        sm_scale=0.37,
        window_left=window_left,
        out=out,
        lse=lse,
        backend="reference",
    )
    want = dense_attention(case, sm_scale=fp32(0.37), window_left=window_left)
    assert got.shape == (case.plan.total_tokens, hq, 16)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert torch.isnan(out[case.plan.total_tokens :]).all(), "rows past total_tokens were written"
    assert not torch.isnan(lse[: case.plan.total_tokens]).any() and torch.isnan(lse[case.plan.total_tokens :]).all()


def test_window_at_least_kv_len_equals_full_causal():
    gen = torch.Generator().manual_seed(3)
    case = random_batch(
        gen, seq_lens=[9, 4], start_positions=[6, 0], page_size=5, num_qo_heads=4, num_kv_heads=2, head_dim=16
    )
    pw.append_paged_kv(case.k, case.v, case.pool, case.layout, case.layer, case.plan)
    run = [
        pw.batch_prefill_paged_window(
            case.q, case.pool, case.layout, case.layer, case.plan, sm_scale=1.0, window_left=w, backend="reference"
        )
        for w in (-1, 14, 10**6)
    ]
    assert torch.equal(run[0], run[1]) and torch.equal(run[0], run[2])


def test_lse_is_the_logsumexp_of_scaled_logits():
    gen = torch.Generator().manual_seed(4)
    case = random_batch(gen, seq_lens=[3], start_positions=[0], page_size=2, num_qo_heads=2, num_kv_heads=1, head_dim=8)
    pw.append_paged_kv(case.k, case.v, case.pool, case.layout, case.layer, case.plan)
    lse = torch.empty(3, 2)
    pw.batch_prefill_paged_window(
        case.q, case.pool, case.layout, case.layer, case.plan, sm_scale=0.5, window_left=1, lse=lse, backend="reference"
    )
    k = case.full_k[0][:, 0]  # [3, d]
    logits = 0.5 * case.q[2] @ k.T  # [2 heads, 3 keys]; query 2 sees keys 1 and 2
    torch.testing.assert_close(lse[2].double(), torch.logsumexp(logits[:, 1:], dim=-1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_within_the_plain_torch_error(dtype):
    """flash-attn's rule: |ours - fp64| <= 2 * |plain torch at dtype - fp64| + 1e-3 (the reference computes fp32)."""
    gen = torch.Generator().manual_seed(5)
    case = random_batch(
        gen,
        seq_lens=[37, 11],
        start_positions=[0, 29],
        page_size=16,
        num_qo_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=dtype,
    )
    pw.append_paged_kv(case.k, case.v, case.pool, case.layout, case.layer, case.plan)
    got = pw.batch_prefill_paged_window(
        case.q, case.pool, case.layout, case.layer, case.plan, sm_scale=0.125, window_left=13, backend="reference"
    )
    assert got.dtype == dtype
    exact = dense_attention(case, sm_scale=0.125, window_left=13)
    plain = dense_attention(case, sm_scale=0.125, window_left=13, dtype=dtype)  # softmax(q k^T) v all in `dtype`
    plain_err, ours_err = max_abs_err(plain, exact), max_abs_err(got, exact)
    assert ours_err <= error_bound(plain_err), (ours_err, plain_err)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_append_writes_exactly_the_new_slots(page_size):
    gen = torch.Generator().manual_seed(page_size)
    case = random_batch(
        gen,
        seq_lens=[5, 0, 19],
        start_positions=[3, 4, 14],
        page_size=page_size,
        num_qo_heads=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
    )
    before = case.pool.clone()
    pw.append_paged_kv(case.k, case.v, case.pool, case.layout, case.layer, case.plan)
    expected = before.clone()
    for i, (start, seq) in enumerate(zip(case.plan.start_positions, case.plan.seq_lens)):
        for pos in range(start, start + seq):
            page, slot = case.plan.pages[i][pos // page_size], pos % page_size
            expected[page, case.layer, 0, slot] = case.full_k[i][pos]
            expected[page, case.layer, 1, slot] = case.full_v[i][pos]
    assert torch.equal(case.pool, expected)
    changed = (case.pool != before).any(dim=(4, 5)).nonzero().tolist()
    new_slots = {
        (case.plan.pages[i][p // page_size], case.layer, kv, p % page_size)
        for i, (s, n) in enumerate(zip(case.plan.start_positions, case.plan.seq_lens))
        for p in range(s, s + n)
        for kv in (0, 1)
    }
    assert {tuple(c) for c in changed} == new_slots


def test_chunked_prefill_equals_one_shot():
    """Prefill 11 tokens then a 9-token chunk on top: the chunk's rows equal the one-shot prefill's last 9."""
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d, ps = 4, 2, 16, 3
    layout = pw.PagedKvLayout(1, hkv, d, ps)
    pool = layout.allocate(12, torch.float64)
    pool.normal_(generator=gen)
    q = torch.randn(20, hq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(20, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(20, hkv, d, generator=gen, dtype=torch.float64)
    pages = [7, 2, 9, 0, 4, 11, 5]
    args = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps)
    one = pw.PrefillPagedPlan.single(pages, 2, 0, 20, **args)
    pw.append_paged_kv(k, v, pool, layout, 0, one)
    full = pw.batch_prefill_paged_window(q, pool, layout, 0, one, sm_scale=0.3, window_left=5)
    pool2 = layout.allocate(12, torch.float64)
    pool2.normal_(generator=gen)
    first = pw.PrefillPagedPlan.single(pages[:4], 2, 0, 11, **args)
    second = pw.PrefillPagedPlan.single(pages, 2, 11, 9, **args)
    pw.append_paged_kv(k[:11], v[:11], pool2, layout, 0, first)
    head = pw.batch_prefill_paged_window(q[:11], pool2, layout, 0, first, sm_scale=0.3, window_left=5)
    pw.append_paged_kv(k[11:], v[11:], pool2, layout, 0, second)
    tail = pw.batch_prefill_paged_window(q[11:], pool2, layout, 0, second, sm_scale=0.3, window_left=5)
    torch.testing.assert_close(torch.cat([head, tail]), full, rtol=0, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 3, 16]),
    group=st.sampled_from([1, 2, 4, 8, 16]),
    hkv=st.sampled_from([1, 2]),
    seqs=st.lists(st.integers(0, 24), min_size=1, max_size=4),
    data=st.data(),
    window_left=st.sampled_from([-1, 0, 1, 7, 10**4]),
)
def test_reference_random_ragged_batches(page_size, group, hkv, seqs, data, window_left):
    starts = [data.draw(st.integers(0 if s else 1, 30)) for s in seqs]
    seed = data.draw(st.integers(0, 2**31 - 1))
    case = random_batch(
        torch.Generator().manual_seed(seed),
        seq_lens=seqs,
        start_positions=starts,
        page_size=page_size,
        num_qo_heads=hkv * group,
        num_kv_heads=hkv,
        head_dim=8,
    )
    pw.append_paged_kv(case.k, case.v, case.pool, case.layout, case.layer, case.plan)
    got = pw.batch_prefill_paged_window(
        case.q, case.pool, case.layout, case.layer, case.plan, sm_scale=0.7, window_left=window_left
    )
    torch.testing.assert_close(
        got, dense_attention(case, sm_scale=fp32(0.7), window_left=window_left), rtol=0, atol=1e-12
    )


@pytest.mark.parametrize("window_left", [-1, 2, 9])
def test_shared_read_only_prefix_equals_private_copies(window_left):
    """Two requests reading the same cached prefix pages attend exactly as if each had its own copy."""
    gen = torch.Generator().manual_seed(23 + window_left)
    hq, hkv, d, ps = 4, 2, 8, 4
    layout = pw.PagedKvLayout(1, hkv, d, ps)
    pool = layout.allocate(9, torch.float64)
    pool.normal_(generator=gen)
    prefix_k = torch.randn(8, hkv, d, generator=gen, dtype=torch.float64)  # positions 0..7 on pages 5, 2
    prefix_v = torch.randn(8, hkv, d, generator=gen, dtype=torch.float64)
    for pos in range(8):
        pool[(5, 2)[pos // ps], 0, 0, pos % ps] = prefix_k[pos]
        pool[(5, 2)[pos // ps], 0, 1, pos % ps] = prefix_v[pos]
    seqs = [6, 3]
    k = torch.randn(sum(seqs), hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(sum(seqs), hkv, d, generator=gen, dtype=torch.float64)
    q = torch.randn(sum(seqs), hq, d, generator=gen, dtype=torch.float64)
    heads = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps)
    shared = pw.PrefillPagedPlan.batch([[5, 2, 0, 7], [5, 2, 4]], [2, 3], [8, 8], seqs, **heads)
    pw.append_paged_kv(k, v, pool, layout, 0, shared)
    got = pw.batch_prefill_paged_window(
        q, pool, layout, 0, shared, sm_scale=0.25, window_left=window_left, backend="reference"
    )
    # the same two requests with private copies of the prefix, one at a time
    for r, (lo, hi) in enumerate([(0, 6), (6, 9)]):
        private = layout.allocate(4, torch.float64)
        private.normal_(generator=gen)
        one = pw.PrefillPagedPlan.single(
            list(range(-(-(8 + seqs[r]) // ps))), (8 + seqs[r] - 1) % ps + 1, 0, 8 + seqs[r], **heads
        )
        pw.append_paged_kv(torch.cat([prefix_k, k[lo:hi]]), torch.cat([prefix_v, v[lo:hi]]), private, layout, 0, one)
        q_full = torch.cat([torch.randn(8, hq, d, generator=gen, dtype=torch.float64), q[lo:hi]])
        want = pw.batch_prefill_paged_window(
            q_full, private, layout, 0, one, sm_scale=0.25, window_left=window_left, backend="reference"
        )[8:]
        torch.testing.assert_close(got[lo:hi], want, rtol=0, atol=1e-12)
    assert not torch.equal(got[:3], got[6:9])


@pytest.mark.parametrize("window_left", [-1, 0, 1, 5, 100])
def test_the_visibility_rule_is_the_same_for_ints_and_tensors(window_left):
    """``semantics.key_visible`` is the one visibility rule: a broadcast bool mask equals the rule key by key."""
    from pagedwindow.semantics import key_visible

    q_pos = torch.arange(3, 12)[:, None]  # [9, 1]
    k_pos = torch.arange(0, 14)[None, :]  # [1, 14]
    mask = key_visible(q_pos, k_pos, window_left)  # [9, 14]
    assert mask.dtype == torch.bool and mask.shape == (9, 14)
    for i, q in enumerate(range(3, 12)):
        for k in range(14):
            want = k <= q and (window_left < 0 or q - k <= window_left)
            assert key_visible(q, k, window_left) is want and bool(mask[i, k]) is want


def test_the_reference_backend_runs_under_torch_compile():
    """A step compiled with torch.compile on the CPU (append then attend; the prep) runs the reference eagerly
    inside the graph and gives what the eager step gives, the pool included."""
    gen = torch.Generator().manual_seed(3)
    case = random_batch(
        gen, seq_lens=[5, 3], start_positions=[2, 0], page_size=4, num_qo_heads=4, num_kv_heads=2, head_dim=8
    )

    def step(pool):
        pw.append_paged_kv(case.k, case.v, pool, case.layout, case.layer, case.plan, backend="reference")
        return pw.batch_prefill_paged_window(
            case.q, pool, case.layout, case.layer, case.plan, sm_scale=0.5, window_left=3, backend="reference"
        )

    def prep(pool):
        ones = torch.ones(8)
        return pw.prepare_paged_qkv(
            case.q,
            case.k,
            case.v,
            pool,
            case.layout,
            case.layer,
            case.plan,
            q_norm_weight=ones,
            k_norm_weight=ones,
            eps=1e-6,
            rope_theta=10000.0,
            norm_style="gemma4",
            backend="reference",
        )

    for fn in (step, prep):
        eager_pool, compiled_pool = case.pool.clone(), case.pool.clone()
        want = fn(eager_pool)
        got = torch.compile(fn, backend="eager")(compiled_pool)
        assert torch.equal(got, want) and torch.equal(compiled_pool, eager_pool)
