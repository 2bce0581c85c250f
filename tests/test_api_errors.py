"""Every bad input to the wrappers fails with PagedWindowError naming the value — and writes nothing."""

import math

import pytest
import torch

import pagedwindow as pw
from tests.cases import make_case

HQ, HKV, D, PS = 4, 2, 8, 4


@pytest.fixture
def case():
    gen = torch.Generator().manual_seed(7)
    return make_case(gen, seq_lens=[5, 3], start_positions=[2, 0], page_size=PS, num_qo_heads=HQ,
                     num_kv_heads=HKV, head_dim=D, dtype=torch.float32)


def expect_refusal(fn, fragment, *watched):
    before = [t.clone() for t in watched]
    with pytest.raises(pw.PagedWindowError) as err:
        fn()
    assert fragment in str(err.value), str(err.value)
    for t, b in zip(watched, before):
        assert torch.equal(t, b), "a refused call wrote to its output or pool"


def prefill_call(case, **overrides):
    out = overrides.pop("out_tensor", None)
    args = dict(q=case.q, pool=case.pool, layout=case.layout, layer=case.layer, plan=case.plan, sm_scale=0.5,
                window_left=3, out=out, backend="reference")
    args.update(overrides)
    return lambda: pw.batch_prefill_paged_window(args.pop("q"), args.pop("pool"), args.pop("layout"),
                                                 args.pop("layer"), args.pop("plan"), **args)


def other_plan(case, **changes):
    p = case.plan
    args = dict(num_qo_heads=p.num_qo_heads, num_kv_heads=p.num_kv_heads, head_dim=p.head_dim,
                page_size=p.page_size)
    args.update(changes)
    return args


def full(shape, value=7.0, dtype=torch.float32):
    return torch.full(shape, value, dtype=dtype)


@pytest.mark.parametrize("sm_scale, fragment", [(None, "sm_scale must be a real number"), (0.0, "sm_scale = 0.0"),
                                                (-1.0, "sm_scale = -1.0"), (math.nan, "sm_scale = nan"),
                                                (math.inf, "sm_scale = inf"), (True, "sm_scale must be a real"),
                                                ("1", "sm_scale must be a real number")])
def test_bad_sm_scale(case, sm_scale, fragment):
    out = full(case.q.shape)
    expect_refusal(prefill_call(case, sm_scale=sm_scale, out_tensor=out), fragment, out, case.pool)


@pytest.mark.parametrize("window_left, fragment", [(-2, "window_left = -2 is below its minimum -1"),
                                                   (2**31, "window_left = 2147483648 does not fit in int32"),
                                                   (1.5, "window_left must be an integer"),
                                                   (False, "window_left must be an integer")])
def test_bad_window_left(case, window_left, fragment):
    out = full(case.q.shape)
    expect_refusal(prefill_call(case, window_left=window_left, out_tensor=out), fragment, out, case.pool)


def test_plan_page_id_past_the_pool(case):
    small_pool = case.pool[: case.plan.max_page_index].clone()  # the largest page id is one past the end
    out = full(case.q.shape)
    expect_refusal(prefill_call(case, pool=small_pool, out_tensor=out),
                   f"plan page id {case.plan.max_page_index} is past the pool's {case.plan.max_page_index} pages",
                   out, small_pool)
    expect_refusal(lambda: pw.append_paged_kv(case.k, case.v, small_pool, case.layout, case.layer, case.plan),
                   "is past the pool's", small_pool)


def test_oversized_last_page(case):
    # A plan laid out for 8-token pages read against a pool of 4-token pages: the last page cannot fit.
    plan = pw.PrefillPagedPlan.single([0], 6, 0, 6, **other_plan(case, page_size=8))
    out = full((6, HQ, D))
    q = torch.randn(6, HQ, D)
    expect_refusal(prefill_call(case, plan=plan, q=q, out_tensor=out), "plan last_page_len 6 exceeds page_size 4",
                   out, case.pool)
    expect_refusal(lambda: pw.append_paged_kv(torch.randn(6, HKV, D), torch.randn(6, HKV, D), case.pool,
                                              case.layout, case.layer, plan), "exceeds page_size 4", case.pool)


def test_plan_page_size_disagrees(case):
    plan = pw.PrefillPagedPlan.single([0, 1], 1, 0, 3, **other_plan(case, page_size=2))
    out = full((3, HQ, D))
    expect_refusal(prefill_call(case, plan=plan, q=torch.randn(3, HQ, D), out_tensor=out),
                   "plan.page_size 2 disagrees with the pool's 4", out, case.pool)


@pytest.mark.parametrize("change, fragment", [(dict(head_dim=16), "head_dim 16 disagrees with layout.head_dim 8"),
                                              (dict(num_kv_heads=4), "num_kv_heads 4 disagrees"),
                                              (dict(num_qo_heads=8), "q shape (8, 4, 8) must be [rows, 8, 8]")])
def test_plan_heads_disagree_with_layout_or_q(case, change, fragment):
    plan = pw.PrefillPagedPlan.batch([case.plan.pages[0], case.plan.pages[1]], list(case.plan.last_page_len.tolist()),
                                     list(case.plan.start_positions), list(case.plan.seq_lens),
                                     **other_plan(case, **change))
    out = full(case.q.shape)
    expect_refusal(prefill_call(case, plan=plan, out_tensor=out), fragment, out, case.pool)


def test_unfilled_plan_and_non_plan(case):
    empty = pw.PrefillPagedPlan.preallocated(max_total_tokens=8, max_total_pages=8, max_batch=2, max_tiles=2)
    out = full(case.q.shape)
    expect_refusal(prefill_call(case, plan=empty, out_tensor=out), "never filled", out, case.pool)
    expect_refusal(lambda: pw.append_paged_kv(case.k, case.v, case.pool, case.layout, case.layer, empty),
                   "never filled", case.pool)
    expect_refusal(prefill_call(case, plan={"batch": 1}, out_tensor=out), "plan must be a PrefillPagedPlan", out)


def test_bad_layer(case):
    out = full(case.q.shape)
    expect_refusal(prefill_call(case, layer=2, out_tensor=out), "layer 2 is out of range [0, 2)", out, case.pool)


@pytest.mark.parametrize("make_q, fragment", [
    (lambda c: c.q[:-1], "q has 7 rows; the plan needs 8"),
    (lambda c: c.q[:, :2], "q shape (8, 2, 8) must be [rows, 4, 8]"),
    (lambda c: c.q.double(), "q dtype torch.float64 must be torch.float32"),
    (lambda c: c.q.transpose(0, 1).contiguous().transpose(0, 1), "q must be contiguous"),
    (lambda c: c.q.to("meta"), "q is on meta but the pool is on cpu"),
    (lambda c: c.q.tolist(), "q must be a torch.Tensor"),
])
def test_bad_q(case, make_q, fragment):
    out = full(case.q.shape)
    expect_refusal(prefill_call(case, q=make_q(case), out_tensor=out), fragment, out, case.pool)


@pytest.mark.parametrize("make_out, fragment", [
    (lambda c: full((7, HQ, D)), "out has 7 rows; the plan needs 8"),
    (lambda c: full((8, HQ, D), dtype=torch.float16), "out dtype torch.float16 must be torch.float32"),
    (lambda c: full((8, D, HQ)).transpose(1, 2), "out must be contiguous"),
    (lambda c: c.q, "out overlaps q"),
    (lambda c: c.pool.view(-1)[: 8 * HQ * D].view(8, HQ, D), "out overlaps pool"),
])
def test_bad_out(case, make_out, fragment):
    out = make_out(case)
    expect_refusal(prefill_call(case, out_tensor=out), fragment, out, case.pool, case.q)


def test_bad_lse(case):
    out = full(case.q.shape)
    lse = full((8, HQ), dtype=torch.float64)
    expect_refusal(prefill_call(case, out_tensor=out, lse=lse), "lse dtype torch.float64 must be torch.float32",
                   out, lse, case.pool)
    lse = full((8, HQ + 1))
    expect_refusal(prefill_call(case, out_tensor=out, lse=lse), "lse shape (8, 5) must be [rows, 4]", out, lse)


def test_bad_backend(case):
    out = full(case.q.shape)
    expect_refusal(prefill_call(case, backend="triton", out_tensor=out), "backend 'triton' is not one of", out)
    expect_refusal(prefill_call(case, backend="cuda", out_tensor=out), "backend 'cuda' needs tensors on a CUDA", out)
    expect_refusal(lambda: pw.append_paged_kv(case.k, case.v, case.pool, case.layout, case.layer, case.plan,
                                              backend="cuda"), "needs tensors on a CUDA device", case.pool)


# -- pool write ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which, make, fragment", [
    ("k", lambda c: c.k[:-1], "k has 7 rows; the plan needs 8"),
    ("v", lambda c: c.v[:, :1], "v shape (8, 1, 8) must be [rows, 2, 8]"),
    ("k", lambda c: c.k.half(), "k dtype torch.float16 must be torch.float32"),
    ("v", lambda c: c.v.transpose(0, 1).contiguous().transpose(0, 1), "v must be contiguous"),
    ("k", lambda c: c.pool.view(-1)[: 8 * HKV * D].view(8, HKV, D), "pool overlaps k"),
])
def test_bad_append_inputs(case, which, make, fragment):
    k, v = case.k, case.v
    if which == "k":
        k = make(case)
    else:
        v = make(case)
    expect_refusal(lambda: pw.append_paged_kv(k, v, case.pool, case.layout, case.layer, case.plan), fragment,
                   case.pool)


def test_append_refuses_colliding_new_rows(case):
    clash = pw.PrefillPagedPlan.batch([[0], [0]], [2, 2], [0, 0], [2, 2], **other_plan(case))
    k, v = torch.randn(4, HKV, D), torch.randn(4, HKV, D)
    expect_refusal(lambda: pw.append_paged_kv(k, v, case.pool, case.layout, case.layer, clash),
                   "new rows collide: requests 0 and 1 both write page 0 slot 0", case.pool)


def test_append_pool_geometry_refusal(case):
    expect_refusal(lambda: pw.append_paged_kv(case.k, case.v, case.pool, case.layout, 5, case.plan),
                   "append_paged_kv: layer 5 is out of range", case.pool)
    wrong = pw.PagedKvLayout(2, HKV, D, 8)
    expect_refusal(lambda: pw.append_paged_kv(case.k, case.v, case.pool, wrong, 0, case.plan),
                   "append_paged_kv: pool shape", case.pool)
