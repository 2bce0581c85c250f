"""Every bad input to the wrappers fails with PagedWindowError naming the value — and writes nothing."""

import math
import warnings

import numpy as np
import pytest
import torch

import pagedwindow as pw
from pagedwindow import reference
from pagedwindow.semantics import check_sm_scale
from pagedwindow.testing import dense_attention, random_batch

HQ, HKV, D, PS = 4, 2, 8, 4


@pytest.fixture
def case():
    gen = torch.Generator().manual_seed(7)
    return random_batch(
        gen,
        seq_lens=[5, 3],
        start_positions=[2, 0],
        page_size=PS,
        num_qo_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        dtype=torch.float32,
    )


def expect_refusal(fn, fragment, *watched):
    before = [t.clone() for t in watched]
    with pytest.raises(pw.PagedWindowError) as err:
        fn()
    assert fragment in str(err.value), str(err.value)
    for t, b in zip(watched, before):
        assert torch.equal(t, b), "a refused call wrote to its output or pool"
    return str(err.value)


def prefill_call(case, **overrides):
    out = overrides.pop("out_tensor", None)
    args = dict(
        q=case.q,
        pool=case.pool,
        layout=case.layout,
        layer=case.layer,
        plan=case.plan,
        sm_scale=0.5,
        window_left=3,
        out=out,
        backend="reference",
    )
    args.update(overrides)
    return lambda: pw.batch_prefill_paged_window(
        args.pop("q"), args.pop("pool"), args.pop("layout"), args.pop("layer"), args.pop("plan"), **args
    )


def other_plan(case, **changes):
    p = case.plan
    args = dict(num_qo_heads=p.num_qo_heads, num_kv_heads=p.num_kv_heads, head_dim=p.head_dim, page_size=p.page_size)
    args.update(changes)
    return args


def full(shape, value=7.0, dtype=torch.float32):
    return torch.full(shape, value, dtype=dtype)


@pytest.mark.parametrize(
    "sm_scale, fragment",
    [
        (None, "sm_scale must be a real number"),
        (0.0, "sm_scale = 0.0"),
        (-1.0, "sm_scale = -1.0"),
        (math.nan, "sm_scale = nan"),
        (math.inf, "sm_scale = inf"),
        (True, "sm_scale must be a real"),
        ("1", "sm_scale must be a real number"),
        # finite in float64 but not a usable fp32 scale: the message
        # names the value and the fp32 bounds it is checked against
        (1e39, ("sm_scale = 1e+39 is too large for fp32", "(bound 2.35866e+38)")),
        (3e38, "sm_scale = 3e+38 is too large for fp32: sm_scale * log2(e) must stay finite"),
        (1e-46, ("sm_scale = 1e-46 is below fp32's smallest normal number", "would round to a subnormal or 0")),
        (1e-39, "sm_scale = 1e-39 is below fp32's smallest normal"),
        (-1e-46, "sm_scale = -1e-46"),
        (-math.inf, "sm_scale = -inf"),
        (10**400, "batch_prefill_paged_window: sm_scale = 1000000"),  # past a float: refused like infinity
    ],
)
def test_bad_sm_scale(case, sm_scale, fragment):
    out = full(case.q.shape)
    first, *rest = (fragment,) if isinstance(fragment, str) else fragment
    message = expect_refusal(prefill_call(case, sm_scale=sm_scale, out_tensor=out), first, out, case.pool)
    for part in rest:
        assert part in message, message


@pytest.mark.parametrize(
    "window_left, fragment",
    [
        (-2, "batch_prefill_paged_window: window_left = -2 is below its minimum -1"),
        (2**31, "window_left = 2147483648 does not fit in int32"),
        (1.5, "window_left must be an integer"),
        (False, "window_left must be an integer"),
    ],
)
def test_bad_window_left(case, window_left, fragment):
    out = full(case.q.shape)
    expect_refusal(prefill_call(case, window_left=window_left, out_tensor=out), fragment, out, case.pool)


def test_plan_page_id_past_the_pool(case):
    small_pool = case.pool[: case.plan.max_page_index].clone()  # the largest page id is one past the end
    out = full(case.q.shape)
    expect_refusal(
        prefill_call(case, pool=small_pool, out_tensor=out),
        f"plan page id {case.plan.max_page_index} is past the pool's {case.plan.max_page_index} pages",
        out,
        small_pool,
    )
    expect_refusal(
        lambda: pw.append_paged_kv(case.k, case.v, small_pool, case.layout, case.layer, case.plan),
        "is past the pool's",
        small_pool,
    )


def test_oversized_last_page(case):
    # A plan laid out for 8-token pages read against a pool of 4-token pages: the last page cannot fit.
    plan = pw.PrefillPagedPlan.single([0], 6, 0, 6, **other_plan(case, page_size=8))
    out = full((6, HQ, D))
    q = torch.randn(6, HQ, D)
    # the page sizes are compared first: a last page and page ids only mean something in the pool's pages
    expect_refusal(
        prefill_call(case, plan=plan, q=q, out_tensor=out),
        "plan.page_size 8 disagrees with the pool's 4",
        out,
        case.pool,
    )
    expect_refusal(
        lambda: pw.append_paged_kv(
            torch.randn(6, HKV, D), torch.randn(6, HKV, D), case.pool, case.layout, case.layer, plan
        ),
        "plan.page_size 8 disagrees with the pool's 4",
        case.pool,
    )


def test_plan_page_size_disagrees(case):
    plan = pw.PrefillPagedPlan.single([0, 1], 1, 0, 3, **other_plan(case, page_size=2))
    out = full((3, HQ, D))
    expect_refusal(
        prefill_call(case, plan=plan, q=torch.randn(3, HQ, D), out_tensor=out),
        "plan.page_size 2 disagrees with the pool's 4",
        out,
        case.pool,
    )


@pytest.mark.parametrize(
    "change, fragment",
    [
        (dict(head_dim=16), "head_dim 16 disagrees with layout.head_dim 8"),
        (dict(num_kv_heads=4), "num_kv_heads 4 disagrees"),
        (dict(num_qo_heads=8), "q shape (8, 4, 8) must be [rows, 8, 8]"),
    ],
)
def test_plan_heads_disagree_with_layout_or_q(case, change, fragment):
    plan = pw.PrefillPagedPlan.batch(
        [case.plan.pages[0], case.plan.pages[1]],
        list(case.plan.last_page_len.tolist()),
        list(case.plan.start_positions),
        list(case.plan.seq_lens),
        **other_plan(case, **change),
    )
    out = full(case.q.shape)
    expect_refusal(prefill_call(case, plan=plan, out_tensor=out), fragment, out, case.pool)


def test_unfilled_plan_and_non_plan(case):
    empty = pw.PrefillPagedPlan.preallocated(max_total_tokens=8, max_total_pages=8, max_batch=2, max_tiles=2)
    out = full(case.q.shape)
    expect_refusal(prefill_call(case, plan=empty, out_tensor=out), "never filled", out, case.pool)
    expect_refusal(
        lambda: pw.append_paged_kv(case.k, case.v, case.pool, case.layout, case.layer, empty), "never filled", case.pool
    )
    expect_refusal(prefill_call(case, plan={"batch": 1}, out_tensor=out), "plan must be a PrefillPagedPlan", out)


def test_bad_layer(case):
    out = full(case.q.shape)
    expect_refusal(prefill_call(case, layer=2, out_tensor=out), "layer 2 is out of range [0, 2)", out, case.pool)


@pytest.mark.parametrize(
    "make_q, fragment",
    [
        (lambda c: c.q[:-1], "q has 7 rows; the plan needs 8"),
        (lambda c: c.q[:, :2], "q shape (8, 2, 8) must be [rows, 4, 8]"),
        (lambda c: c.q.double(), "q dtype torch.float64 must be torch.float32"),
        (lambda c: c.q.transpose(0, 1).contiguous().transpose(0, 1), "q must be contiguous"),
        (lambda c: c.q.to("meta"), "q is on meta but the pool is on cpu"),
        (lambda c: c.q.tolist(), "q must be a torch.Tensor"),
    ],
)
def test_bad_q(case, make_q, fragment):
    out = full(case.q.shape)
    expect_refusal(prefill_call(case, q=make_q(case), out_tensor=out), fragment, out, case.pool)


@pytest.mark.parametrize(
    "make_out, fragment",
    [
        (lambda c: full((7, HQ, D)), "out has 7 rows; the plan needs 8"),
        (lambda c: full((8, HQ, D), dtype=torch.float16), "out dtype torch.float16 must be torch.float32"),
        (lambda c: full((8, D, HQ)).transpose(1, 2), "out must be contiguous"),
        (lambda c: c.q, "out overlaps q"),
        (lambda c: c.pool.view(-1)[: 8 * HQ * D].view(8, HQ, D), "out overlaps pool"),
    ],
)
def test_bad_out(case, make_out, fragment):
    out = make_out(case)
    expect_refusal(prefill_call(case, out_tensor=out), fragment, out, case.pool, case.q)


def test_bad_lse(case):
    out = full(case.q.shape)
    lse = full((8, HQ), dtype=torch.float64)
    expect_refusal(
        prefill_call(case, out_tensor=out, lse=lse),
        "lse dtype torch.float64 must be torch.float32",
        out,
        lse,
        case.pool,
    )
    lse = full((8, HQ + 1))
    expect_refusal(prefill_call(case, out_tensor=out, lse=lse), "lse shape (8, 5) must be [rows, 4]", out, lse)


@pytest.mark.parametrize(
    "make_lse, fragment",
    [
        (lambda c, out: out.view(-1)[: 8 * HQ].view(8, HQ), "out overlaps lse"),
        (lambda c, out: c.q.view(-1)[: 8 * HQ].view(8, HQ), "lse overlaps q"),
        (lambda c, out: c.pool.view(-1)[: 8 * HQ].view(8, HQ), "lse overlaps pool"),
    ],
)
def test_lse_overlapping_another_tensor_is_refused(case, make_lse, fragment):
    """lse is written like out: sharing a byte with out, q or the pool is refused before anything is written."""
    out = full(case.q.shape)
    lse = make_lse(case, out)
    expect_refusal(prefill_call(case, out_tensor=out, lse=lse), fragment, out, lse, case.pool, case.q)


def test_bad_backend(case):
    out = full(case.q.shape)
    expect_refusal(prefill_call(case, backend="triton", out_tensor=out), "backend 'triton' is not one of", out)
    expect_refusal(prefill_call(case, backend="cuda", out_tensor=out), "backend 'cuda' needs tensors on a CUDA", out)
    expect_refusal(
        lambda: pw.append_paged_kv(case.k, case.v, case.pool, case.layout, case.layer, case.plan, backend="cuda"),
        "needs tensors on a CUDA device",
        case.pool,
    )


# -- pool write ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "which, make, fragment",
    [
        ("k", lambda c: c.k[:-1], "k has 7 rows; the plan needs 8"),
        ("v", lambda c: c.v[:, :1], "v shape (8, 1, 8) must be [rows, 2, 8]"),
        ("k", lambda c: c.k.half(), "k dtype torch.float16 must be torch.float32"),
        ("v", lambda c: c.v.transpose(0, 1).contiguous().transpose(0, 1), "v must be contiguous"),
        ("k", lambda c: c.pool.view(-1)[: 8 * HKV * D].view(8, HKV, D), "pool overlaps k"),
        ("v", lambda c: c.pool.view(-1)[-8 * HKV * D :].view(8, HKV, D), "pool overlaps v"),
    ],
)
def test_bad_append_inputs(case, which, make, fragment):
    k, v = case.k, case.v
    if which == "k":
        k = make(case)
    else:
        v = make(case)
    expect_refusal(lambda: pw.append_paged_kv(k, v, case.pool, case.layout, case.layer, case.plan), fragment, case.pool)


def test_colliding_new_rows_are_refused_when_the_plan_is_built(case):
    # Two requests writing the same slots no longer reach the pool write: the plan itself is refused.
    with pytest.raises(pw.PagedWindowError) as err:
        pw.PrefillPagedPlan.batch([[0], [0]], [2, 2], [0, 0], [2, 2], **other_plan(case))
    assert "requests 0 and 1 both write page 0 slot 0" in str(err.value)
    with pytest.raises(pw.PagedWindowError) as err:  # new rows over another request's cached prefix
        pw.PrefillPagedPlan.batch([[0, 1], [0]], [1, 2], [4, 0], [1, 2], **other_plan(case))
    assert "request 1 writes new rows into page 0 slot 0, which request 0 reads as cached prefix (slots 0..3)" in str(
        err.value
    )


def test_append_with_a_shared_read_only_prefix(case):
    # Requests 0 and 1 read page 0 as cached prefix and each write into a page of its own.
    plan = pw.PrefillPagedPlan.batch([[0, 1], [0, 2]], [2, 1], [4, 4], [2, 1], **other_plan(case))
    k, v = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    before = case.pool.clone()
    pw.append_paged_kv(k, v, case.pool, case.layout, case.layer, plan)
    expected = before.clone()
    for row, (page, slot) in enumerate([(1, 0), (1, 1), (2, 0)]):
        expected[page, case.layer, 0, slot] = k[row]
        expected[page, case.layer, 1, slot] = v[row]
    assert torch.equal(case.pool, expected) and not torch.equal(case.pool, before)


def test_append_pool_geometry_refusal(case):
    expect_refusal(
        lambda: pw.append_paged_kv(case.k, case.v, case.pool, case.layout, 5, case.plan),
        "append_paged_kv: layer 5 is out of range",
        case.pool,
    )
    wrong = pw.PagedKvLayout(2, HKV, D, 8)
    expect_refusal(
        lambda: pw.append_paged_kv(case.k, case.v, case.pool, wrong, 0, case.plan),
        "append_paged_kv: pool shape",
        case.pool,
    )


# -- autograd and inference mode -------------------------------------------------------------------------------


def appended(case):
    pw.append_paged_kv(case.k, case.v, case.pool, case.layout, case.layer, case.plan)
    return case


def test_out_or_lse_that_requires_grad_is_refused(case):
    appended(case)
    out = torch.randn(case.q.shape, requires_grad=True)
    expect_refusal(
        prefill_call(case, out_tensor=out),
        "batch_prefill_paged_window: out requires grad; the op writes it in place and is not differentiable",
        out,
        case.pool,
    )
    leaf = torch.randn(case.q.shape, requires_grad=True)
    view = leaf[:]  # a non-leaf view that autograd tracks
    expect_refusal(prefill_call(case, out_tensor=view), "out requires grad", view, leaf, case.pool)
    out = torch.randn(case.q.shape)
    lse = torch.randn(case.q.shape[:2], requires_grad=True)
    expect_refusal(
        prefill_call(case, out_tensor=out, lse=lse),
        "batch_prefill_paged_window: lse requires grad",
        out,
        lse,
        case.pool,
    )
    expect_refusal(prefill_call(case, lse=lse), "lse requires grad", lse, case.pool)


def test_pool_that_requires_grad_is_refused_by_append(case):
    pool = case.pool.clone().requires_grad_()
    expect_refusal(
        lambda: pw.append_paged_kv(case.k, case.v, pool, case.layout, case.layer, case.plan),
        "append_paged_kv: pool requires grad; the op writes it in place",
        pool,
    )


def test_inputs_that_require_grad_are_read_detached(case):
    appended(case)
    q = case.q.clone().requires_grad_()
    want_out, want_lse = torch.empty_like(case.q), torch.empty(case.q.shape[:2])
    want = prefill_call(case, out_tensor=want_out, lse=want_lse)()
    got = prefill_call(case, q=q)()
    assert torch.equal(got, want) and not got.requires_grad
    out, lse = torch.randn(case.q.shape), torch.randn(case.q.shape[:2])
    got = prefill_call(case, q=q, out_tensor=out, lse=lse)()
    assert torch.equal(got, want) and torch.equal(lse, want_lse) and not out.requires_grad
    # the pool is only read by the prefill, so one that requires grad is read detached too
    pool = case.pool.clone().requires_grad_()
    got = prefill_call(case, q=q, pool=pool)()
    assert torch.equal(got, want) and not got.requires_grad and pool.grad is None


def test_append_reads_k_and_v_detached(case):
    plain = case.pool.clone()
    pw.append_paged_kv(case.k, case.v, plain, case.layout, case.layer, case.plan)
    assert not torch.equal(plain, case.pool)
    k, v = case.k.clone().requires_grad_(), case.v.clone().requires_grad_()
    pw.append_paged_kv(k, v, case.pool, case.layout, case.layer, case.plan)
    assert torch.equal(case.pool, plain) and not case.pool.requires_grad
    assert k.grad is None and v.grad is None


def test_inference_tensors_are_written_only_inside_inference_mode(case):
    appended(case)
    want = prefill_call(case)()
    with torch.inference_mode():
        out = torch.randn(case.q.shape)
        lse = torch.randn(case.q.shape[:2])
        pool = case.pool.clone()
    expect_refusal(
        prefill_call(case, out_tensor=out),
        "batch_prefill_paged_window: out was made under torch.inference_mode() and may only be written "
        "inside inference mode",
        out,
        case.pool,
    )
    expect_refusal(prefill_call(case, lse=lse), "lse was made under torch.inference_mode()", lse, case.pool)
    k, v = torch.randn(case.k.shape), torch.randn(case.v.shape)
    expect_refusal(
        lambda: pw.append_paged_kv(k, v, pool, case.layout, case.layer, case.plan),
        "append_paged_kv: pool was made under torch.inference_mode() and may only be written inside inference mode",
        pool,
    )
    with torch.inference_mode():
        got = prefill_call(case, out_tensor=out, lse=lse)()
        assert torch.equal(got, want) and torch.equal(out, want)
        got = prefill_call(case)()  # everything fresh inside inference mode
        assert torch.equal(got, want)
        expected = case.pool.clone()
        pw.append_paged_kv(k, v, expected, case.layout, case.layer, case.plan)
        pw.append_paged_kv(k, v, pool, case.layout, case.layer, case.plan)
        assert torch.equal(pool, expected) and not torch.equal(pool, case.pool)
    # an inference-mode pool may be read by the prefill outside inference mode (it is not written)
    assert torch.equal(prefill_call(case, pool=pool)(), prefill_call(case, pool=expected.clone())())


def prep(case, *, q=None, pool=None, q_norm_weight=None, out_q=None):
    """``prepare_paged_qkv`` on the case (gemma4, unit weights unless given)."""
    ones = torch.ones(D)
    return pw.prepare_paged_qkv(
        case.q if q is None else q,
        case.k,
        case.v,
        case.pool if pool is None else pool,
        case.layout,
        case.layer,
        case.plan,
        q_norm_weight=ones if q_norm_weight is None else q_norm_weight,
        k_norm_weight=ones,
        eps=1e-6,
        rope_theta=10000.0,
        norm_style="gemma4",
        out_q=out_q,
    )


def _quiet(make):
    """``make`` with the prototype / beta warnings of nested and sparse CSR tensors silenced."""

    def made(t):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return make(t)

    return made


@pytest.mark.parametrize(
    "make, kind",
    [
        (_quiet(lambda t: torch.nested.nested_tensor([t[:1], t[1:]])), "a nested tensor"),
        (_quiet(lambda t: t.to_sparse()), "layout torch.sparse_coo"),
        (_quiet(lambda t: t.reshape(t.shape[0], -1).to_sparse_csr()), "layout torch.sparse_csr"),
    ],
    ids=["nested", "sparse_coo", "sparse_csr"],
)
def test_nested_and_sparse_tensors_are_refused_in_every_slot(case, make, kind):
    fragment = f"must be a dense (strided) tensor, got {kind}"
    appended(case)
    out = full(case.q.shape)
    expect_refusal(prefill_call(case, q=make(case.q), out_tensor=out), f"q {fragment}", out, case.pool)
    expect_refusal(prefill_call(case, out_tensor=make(out.clone())), f"out {fragment}", out, case.pool)
    expect_refusal(prefill_call(case, pool=make(case.pool), out_tensor=out), f"pool {fragment}", out, case.pool)
    pool = case.pool.clone()
    k = make(case.k)
    expect_refusal(lambda: pw.append_paged_kv(k, case.v, pool, case.layout, case.layer, case.plan), "k ", pool)
    weight = make(torch.ones(2, D // 2) if kind.endswith("csr") else torch.ones(D))  # CSR needs two dimensions
    expect_refusal(lambda: prep(case, pool=pool, q_norm_weight=weight), "q_norm_weight ", pool)


def test_a_meta_pool_is_refused_before_any_tensor_check(case):
    meta_pool, meta_q = case.pool.to("meta"), case.q.to("meta")
    k, v = case.k.to("meta"), case.v.to("meta")
    for call in (
        prefill_call(case, q=meta_q, pool=meta_pool),
        lambda: pw.append_paged_kv(k, v, meta_pool, case.layout, case.layer, case.plan),
    ):
        with pytest.raises(pw.PagedWindowError, match="pool is on the meta device"):
            call()


def test_under_torch_compile_the_reference_refuses_overlap_and_inference_outputs(case):
    """torch.compile traces the checks on fake tensors, which have no addresses; the reference backend then runs
    on the real ones, so the overlap and inference-mode checks run on them first, and nothing is written."""
    appended(case)

    def prefill(q, out):
        return pw.batch_prefill_paged_window(
            q, case.pool, case.layout, case.layer, case.plan, sm_scale=0.5, window_left=3, out=out
        )

    def append(k, pool):
        pw.append_paged_kv(k, case.v, pool, case.layout, case.layer, case.plan)

    def prep_into(q, out_q):
        return prep(case, q=q, out_q=out_q)

    compiled = {fn: torch.compile(fn, backend="eager") for fn in (prefill, append, prep_into)}
    q = case.q.clone()
    expect_refusal(lambda: compiled[prefill](q, q), "batch_prefill_paged_window: out overlaps q", q, case.pool)
    pool = case.pool.clone()
    k_in_pool = pool.view(-1)[: case.k.numel()].view(case.k.shape)
    expect_refusal(lambda: compiled[append](k_in_pool, pool), "append_paged_kv: pool overlaps k", pool)
    expect_refusal(lambda: compiled[prep_into](q, q), "prepare_paged_qkv: out_q overlaps q", q, case.pool)
    with torch.inference_mode():
        out = torch.zeros(case.q.shape)
    expect_refusal(lambda: compiled[prefill](case.q, out), "out was made under torch.inference_mode()", out)
    good = torch.zeros(case.q.shape)
    assert torch.equal(compiled[prefill](case.q, good), prefill_call(case)())  # a good call runs as eager


# -- sm_scale is used as fp32 --------------------------------------------------------------------------------


def test_the_scale_is_rounded_to_fp32():
    gen = torch.Generator().manual_seed(13)
    case = random_batch(
        gen, seq_lens=[6, 3], start_positions=[3, 0], page_size=PS, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D
    )  # float64: a scale change of 1e-8 shows
    appended(case)
    rounded = float(np.float32(0.1))
    assert rounded != 0.1 and check_sm_scale(0.1) == rounded
    assert check_sm_scale(np.float32(0.1)) == rounded and check_sm_scale(0.5) == 0.5
    got = prefill_call(case, sm_scale=0.1)()
    assert torch.equal(got, prefill_call(case, sm_scale=rounded)())
    torch.testing.assert_close(got, dense_attention(case, sm_scale=rounded, window_left=3), rtol=0, atol=1e-13)
    unrounded = torch.empty_like(got)
    geometry = pw.checked_paged_geometry("test", case.layout, case.pool, case.layer, D, HKV)
    reference.batch_prefill_paged_window(
        case.q, case.pool, geometry, case.plan, sm_scale=0.1, window_left=3, out=unrounded
    )
    assert (unrounded - got).abs().max() > 1e-10, "the rounding is visible in float64"


def test_scale_bounds_in_fp32():
    flt_min = float(np.finfo(np.float32).tiny)
    assert check_sm_scale(flt_min) == flt_min
    top = np.float32(float(np.finfo(np.float32).max) / math.log2(math.e))
    if float(top) * math.log2(math.e) > float(np.finfo(np.float32).max):
        top = np.nextafter(top, np.float32(0))
    assert check_sm_scale(float(top)) == float(top)
    assert np.isfinite(top * np.float32(math.log2(math.e)))
    below = float(np.nextafter(np.float32(flt_min), np.float32(0)))  # the largest fp32 subnormal
    above = float(np.nextafter(top, np.float32(np.inf)))
    for bad, why in ((below, "is below fp32's smallest normal number"), (above, "is too large for fp32")):
        with pytest.raises(pw.PagedWindowError) as err:
            check_sm_scale(bad)
        assert f"sm_scale = {bad!r} {why}" in str(err.value)


# -- plans with no new rows ----------------------------------------------------------------------------------


@pytest.fixture
def idle_case():
    gen = torch.Generator().manual_seed(17)
    return random_batch(
        gen,
        seq_lens=[0, 0, 0],
        start_positions=[5, 3, 8],
        page_size=PS,
        num_qo_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        dtype=torch.float32,
    )


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_zero_token_prefill_returns_at_once(idle_case, backend):
    c = idle_case
    assert c.plan.total_tokens == 0 and c.plan.num_tiles == 0 and c.q.shape == (0, HQ, D)
    pool = c.pool.clone()
    got = prefill_call(c, backend=backend)()
    assert got.shape == (0, HQ, D) and got.dtype == torch.float32 and torch.equal(c.pool, pool)
    out, lse = torch.randn(4, HQ, D), torch.randn(4, HQ)
    out_before, lse_before = out.clone(), lse.clone()
    q = torch.randn(4, HQ, D)  # extra rows are allowed and ignored
    got = prefill_call(c, backend=backend, q=q, out_tensor=out, lse=lse)()
    assert got.shape == (0, HQ, D) and got.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    assert torch.equal(out, out_before) and torch.equal(lse, lse_before) and torch.equal(c.pool, pool)
    # the checks still run first
    expect_refusal(prefill_call(c, backend=backend, sm_scale=1e39, out_tensor=out), "sm_scale = 1e+39", out, c.pool)
    expect_refusal(
        prefill_call(c, backend=backend, q=torch.randn(0, HQ + 1, D), out_tensor=out),
        "q shape (0, 5, 8) must be [rows, 4, 8]",
        out,
        c.pool,
    )
    expect_refusal(
        prefill_call(c, backend=backend, out_tensor=torch.randn(4, HQ, D, requires_grad=True)),
        "out requires grad",
        out,
        c.pool,
    )


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_zero_token_append_writes_nothing(idle_case, backend):
    c = idle_case
    pool = c.pool.clone()
    assert c.k.shape == (0, HKV, D)
    assert pw.append_paged_kv(c.k, c.v, c.pool, c.layout, c.layer, c.plan, backend=backend) is None
    assert torch.equal(c.pool, pool)
    k, v = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    pw.append_paged_kv(k, v, c.pool, c.layout, c.layer, c.plan, backend=backend)
    assert torch.equal(c.pool, pool)
    expect_refusal(
        lambda: pw.append_paged_kv(k.double(), v, c.pool, c.layout, c.layer, c.plan, backend=backend),
        "k dtype torch.float64 must be torch.float32",
        c.pool,
    )
    grad_pool = c.pool.clone().requires_grad_()
    expect_refusal(
        lambda: pw.append_paged_kv(k, v, grad_pool, c.layout, c.layer, c.plan, backend=backend),
        "pool requires grad",
        grad_pool,
    )


def test_zero_token_plan_through_csr_and_preallocated(idle_case):
    c = idle_case
    csr = pw.PrefillPagedPlan.from_csr([0, 0, 0], [0, 2, 4], [0, 1, 2, 3], [1, 4], **other_plan(c))
    prealloc = pw.PrefillPagedPlan.preallocated(max_total_tokens=4, max_total_pages=8, max_batch=4, max_tiles=4)
    prealloc.update_csr([0, 0, 0], [0, 2, 4], [0, 1, 2, 3], [1, 4], **other_plan(c))
    for plan in (csr, prealloc):
        assert plan.total_tokens == 0 and plan.num_tiles == 0 and plan.kv_lens == (5, 8)
        out = torch.randn(2, HQ, D)
        before = out.clone()
        got = prefill_call(c, plan=plan, out_tensor=out)()
        assert got.shape == (0, HQ, D) and torch.equal(out, before)
        pool = c.pool.clone()
        pw.append_paged_kv(torch.randn(1, HKV, D), torch.randn(1, HKV, D), c.pool, c.layout, c.layer, plan)
        assert torch.equal(c.pool, pool)


_PREFILL_REFUSALS = {
    "sm_scale": dict(sm_scale=0.0),
    "window_left": dict(window_left=-2),
    "q rows": dict(q=lambda c: c.q[:-1]),
    "q dtype": dict(q=lambda c: c.q.double()),
    "out overlaps q": dict(out=lambda c: c.q),
    "lse dtype": dict(lse=lambda c: full((8, HQ), dtype=torch.float64)),
    "backend": dict(backend="triton"),
    "layer": dict(layer=5),
    "plan": dict(plan=lambda c: "not a plan"),
}


@pytest.mark.parametrize("bad", _PREFILL_REFUSALS.values(), ids=_PREFILL_REFUSALS.keys())
def test_the_prefill_checks_alone_refuse_what_the_call_refuses_and_write_nothing(case, bad):
    out = full(case.q.shape)
    args = dict(q=case.q, pool=case.pool, layout=case.layout, layer=case.layer, plan=case.plan)
    args.update(sm_scale=0.5, window_left=3, out=out, backend="reference")
    args.update({name: make(case) if callable(make) else make for name, make in bad.items()})
    watched = [t for t in (out, args["out"], args.get("lse"), case.pool, case.q) if isinstance(t, torch.Tensor)]
    messages = [
        expect_refusal(lambda entry=entry: entry(**args), "", *watched)
        for entry in (pw.batch_prefill_paged_window, pw.check_batch_prefill_paged_window)
    ]
    assert messages[0] == messages[1]


def test_the_prefill_checks_alone_pass_a_good_call_and_write_nothing(case):
    out, lse = full(case.q.shape), full((8, HQ))
    watched = [case.pool, case.q, out, lse]
    before = [t.clone() for t in watched]
    checked = pw.check_batch_prefill_paged_window(
        case.q, case.pool, case.layout, case.layer, case.plan, sm_scale=0.5, window_left=3, out=out, lse=lse
    )
    assert checked is None
    assert all(torch.equal(t, b) for t, b in zip(watched, before))
