"""PrefillPagedPlan.from_csr / update_csr: FlashInfer's CSR vocabulary in, the same plan as ``batch`` out.

Every bad CSR input fails with PagedWindowError naming the value and changes nothing; a brute-force slot-ownership
check decides which randomly shared page layouts are legal; ``from_dict`` takes exactly what ``to_dict`` writes and
refuses malformed dicts; every constructor refuses a bad ``device`` first.
"""

import json
import re
import statistics
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagedwindow as pw
from pagedwindow import plan as plan_module
from pagedwindow import tiles
from pagedwindow.errors import INT32_MAX
from pagedwindow.plan import PLAN_BUFFER_MAX_ENTRIES, SUPPORTED_CTA_TILE_Q, PlanCapacity

from . import host_pass


@pytest.fixture(autouse=True, scope="module", params=host_pass.PASSES)
def plan_pass(request, tmp_path_factory):
    """Every test here runs with the plan's numpy pass, then with the compiled pass (``kernels/plan_pack.cpp``)."""
    yield from host_pass.install(request, tmp_path_factory)


HEADS = dict(num_qo_heads=4, num_kv_heads=2, head_dim=8, page_size=4)
# The batch of test_plan.GOOD as CSR: request 0 holds pages [3, 1], kv_len 6, 4 new rows; request 1 page [0],
# kv_len 3, 3 new rows.
GOOD = dict(qo_indptr=[0, 4, 7], kv_indptr=[0, 2, 3], kv_indices=[3, 1, 0], last_page_len=[2, 3])
GOOD_REQUESTS = dict(page_indices=[[3, 1], [0]], last_page_lens=[2, 3], start_positions=[2, 0], seq_lens=[4, 3])


def from_csr(**overrides):
    args = {**GOOD, **HEADS, **overrides}
    return pw.PrefillPagedPlan.from_csr(
        args.pop("qo_indptr"), args.pop("kv_indptr"), args.pop("kv_indices"), args.pop("last_page_len"), **args
    )


def update_csr(plan, **overrides):
    args = {**GOOD, **HEADS, **overrides}
    return plan.update_csr(
        args.pop("qo_indptr"), args.pop("kv_indptr"), args.pop("kv_indices"), args.pop("last_page_len"), **args
    )


def to_csr(page_indices, last_page_lens, start_positions, seq_lens, page_size):
    """Per-request lists to CSR lists, independently of the package."""
    qo, kv, ids = [0], [0], []
    for pages, seq in zip(page_indices, seq_lens):
        qo.append(qo[-1] + seq)
        kv.append(kv[-1] + len(pages))
        ids.extend(pages)
    return dict(qo_indptr=qo, kv_indptr=kv, kv_indices=ids, last_page_len=list(last_page_lens))


def snapshot(plan):
    return plan.to_dict(), plan.version, plan.device_buffer("cpu")


def assert_unchanged(plan, before):
    data, version, buffer = before
    assert plan.to_dict() == data and plan.version == version
    assert torch.equal(plan.device_buffer("cpu"), buffer)


def filled_plan(**kwargs):
    plan = pw.PrefillPagedPlan.preallocated(max_total_tokens=16, max_total_pages=8, max_batch=4, max_tiles=8, **kwargs)
    update_csr(plan)
    return plan


# -- from_csr is batch ---------------------------------------------------------------------------------------

REQUEST_SETS = [
    # (page_indices, last_page_lens, start_positions, seq_lens, page_size)
    ([[3, 1], [0]], [2, 3], [2, 0], [4, 3], 4),
    ([[5]], [1], [0], [1], 4),
    ([[0, 1, 2], [0, 1, 3], [0]], [3, 1, 2], [8, 8, 2], [3, 1, 0], 4),  # shared read-only prefix
    ([[9], [2], [7], [4]], [1, 1, 1, 1], [0, 0, 1, 0], [1, 1, 0, 1], 1),  # decode-like, one idle request
    ([list(range(10, 30))], [16], [300], [20], 16),
    ([[2**31 - 1], [0]], [3, 1], [1, 0], [2, 1], 3),  # the largest page id
]


@pytest.mark.parametrize("requests", REQUEST_SETS)
@pytest.mark.parametrize("tile", [None, *SUPPORTED_CTA_TILE_Q])
def test_from_csr_equals_batch(requests, tile):
    *lists, page_size = requests
    heads = dict(num_qo_heads=8, num_kv_heads=2, head_dim=16, page_size=page_size, cta_tile_q=tile, device="cpu")
    batch = pw.PrefillPagedPlan.batch(*lists, **heads)
    csr = to_csr(*lists, page_size)
    plan = pw.PrefillPagedPlan.from_csr(
        csr["qo_indptr"], csr["kv_indptr"], csr["kv_indices"], csr["last_page_len"], **heads
    )
    assert plan == batch and plan.to_dict() == batch.to_dict()
    assert (plan.cta_tile_q, plan.tile_reason) == (batch.cta_tile_q, batch.tile_reason)
    assert plan.page_indices.tolist() == csr["kv_indices"] and plan.page_indptr.tolist() == csr["kv_indptr"]
    assert plan.qo_indptr.tolist() == csr["qo_indptr"] and plan.last_page_len.tolist() == csr["last_page_len"]
    assert list(plan.start_positions) == lists[2] and list(plan.seq_lens) == lists[3]
    assert torch.equal(plan.device_buffer("cpu"), batch.device_buffer("cpu"))


def test_good_csr_plan_fields():
    plan = from_csr(device="cpu")
    assert plan.to_dict() == pw.PrefillPagedPlan.batch(**GOOD_REQUESTS, **HEADS).to_dict()
    assert plan.start_positions == (2, 0) and plan.kv_lens == (6, 3) and plan.pages == ((3, 1), (0,))
    assert (plan.max_page_index, plan.max_last_page_len, plan.cta_tile_q, plan.num_tiles) == (3, 3, 16, 2)
    assert plan.device == torch.device("cpu") and plan.filled and plan.version == 1
    cap = plan.capacity
    assert (cap.max_total_tokens, cap.max_total_pages, cap.max_batch, cap.max_tiles) == (7, 3, 2, 2)


def make_inputs(kind):
    arrays = [np.array(GOOD[k]) for k in ("qo_indptr", "kv_indptr", "kv_indices", "last_page_len")]
    if kind == "list":
        return [a.tolist() for a in arrays]
    if kind == "tuple":
        return [tuple(a.tolist()) for a in arrays]
    if kind in ("int32", "int64", "uint8", "int16"):
        return [a.astype(kind) for a in arrays]
    if kind == "torch.int32":
        return [torch.from_numpy(a).to(torch.int32) for a in arrays]
    if kind == "torch.int64":
        return [torch.from_numpy(a).to(torch.int64) for a in arrays]
    if kind == "torch.int16":
        return [torch.from_numpy(a).to(torch.int16) for a in arrays]
    if kind == "mixed":
        return [
            torch.tensor(GOOD["qo_indptr"], dtype=torch.int32),
            np.array(GOOD["kv_indptr"], dtype=np.int64),
            list(GOOD["kv_indices"]),
            torch.tensor(GOOD["last_page_len"]),
        ]
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["list", "tuple", "int32", "int64", "uint8", "int16", "torch.int32", "torch.int64", "torch.int16", "mixed"]
)
def test_every_integer_input_kind_is_accepted_and_equal(kind):
    reference = from_csr()
    inputs = make_inputs(kind)
    plan = pw.PrefillPagedPlan.from_csr(*inputs, **HEADS)
    assert plan == reference and plan.to_dict() == reference.to_dict()
    assert plan.page_indices.dtype == torch.int32
    # mutating the caller's arrays afterwards does not reach the plan
    for a in inputs:
        if isinstance(a, (np.ndarray, torch.Tensor)):
            a[...] = 1
        elif isinstance(a, list):
            a[:] = [1] * len(a)
    assert plan.to_dict() == reference.to_dict()
    assert torch.equal(plan.device_buffer("cpu"), reference.device_buffer("cpu"))
    # update_csr takes the same kinds
    target = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=16, max_total_pages=8, max_batch=4, max_tiles=8, cta_tile_q=16
    )
    target.update_csr(*make_inputs(kind), **HEADS)
    assert target.to_dict()["derived"] == reference.to_dict()["derived"]


def test_kv_indices_longer_than_used_prefix():
    # Only kv_indices[:kv_indptr[-1]] is read: a tail of anything integer (even negative or huge ids) is ignored.
    reference = from_csr()
    for tail in ([7, 7, 7], [-1, -5], [2**40], list(range(1000))):
        plan = from_csr(kv_indices=GOOD["kv_indices"] + tail)
        assert plan == reference and plan.max_page_index == 3 and plan.total_pages == 3
        plan = from_csr(kv_indices=torch.tensor(GOOD["kv_indices"] + tail))
        assert plan == reference


# -- bad CSR input -------------------------------------------------------------------------------------------

BAD_CSR = [
    (dict(qo_indptr=[1, 4, 7]), "qo_indptr[0] = 1 must be 0"),
    (
        dict(qo_indptr=[0, 5, 4]),
        "qo_indptr decreases at request 1: qo_indptr[1] = 5 > qo_indptr[2] = 4 (negative seq_len)",
    ),
    (dict(qo_indptr=[0, 4]), "qo_indptr has 2 entries; last_page_len has 2, so it needs 3"),
    (dict(qo_indptr=[0, 4, 7, 7]), "qo_indptr has 4 entries; last_page_len has 2, so it needs 3"),
    (dict(qo_indptr=[]), "qo_indptr has 0 entries; last_page_len has 2, so it needs 3"),
    (dict(qo_indptr=[0, 4, 2**31]), "qo_indptr[-1] = 2147483648 does not fit in int32"),
    (dict(qo_indptr=[0, 4, 2**64]), "qo_indptr holds integers past int64"),
    (dict(qo_indptr=[0, 4, 9]), "request 1 has seq_len 5 new rows but only kv_len 3 keys"),
    (dict(kv_indptr=[1, 2, 3]), "kv_indptr[0] = 1 must be 0"),
    (
        dict(kv_indptr=[0, 3, 2]),
        "kv_indptr decreases at request 1: kv_indptr[1] = 3 > kv_indptr[2] = 2 (negative page count)",
    ),
    (dict(kv_indptr=[0, 2]), "kv_indptr has 2 entries; last_page_len has 2, so it needs 3"),
    (dict(kv_indptr=[0, 2, 3, 3]), "kv_indptr has 4 entries; last_page_len has 2, so it needs 3"),
    (
        dict(kv_indptr=[0, 2, 2]),
        "request 1 has no pages (kv_indptr[1] = kv_indptr[2] = 2); every request needs at least one page",
    ),
    (dict(kv_indptr=[0, 0, 3]), "request 0 has no pages (kv_indptr[0] = kv_indptr[1] = 0)"),
    (dict(kv_indptr=[0, 2, 4]), "kv_indptr[-1] = 4 but kv_indices has only 3 entries"),
    (dict(kv_indices=[3, 1]), "kv_indptr[-1] = 3 but kv_indices has only 2 entries"),
    (dict(kv_indices=[3, -1, 0]), "page id kv_indices[1] = -1 is below its minimum 0"),
    (dict(kv_indices=[3, 1, 2**31]), "page id kv_indices[2] = 2147483648 does not fit in int32 (bound 2147483647)"),
    (
        dict(kv_indices=[3, 3, 0]),
        "page id 3 appears more than once in request 0's pages (kv_indices[0] and kv_indices[1])",
    ),
    (
        dict(kv_indices=[0, 1, 0]),
        "request 1 writes new rows into page 0 slot 0, which request 0 reads as cached prefix (slots 0..1)",
    ),
    (dict(kv_indices=[3, 0, 0]), "requests 0 and 1 both write page 0 slot 0"),
    (dict(last_page_len=[0, 3]), "last_page_len[0] = 0 is outside 1..4 (page_size 4)"),
    (dict(last_page_len=[2, 5]), "last_page_len[1] = 5 is outside 1..4 (page_size 4)"),
    (dict(last_page_len=[2, -3]), "last_page_len[1] = -3 is outside 1..4"),
    (dict(last_page_len=[2]), "qo_indptr has 3 entries; last_page_len has 1, so it needs 2"),
    (dict(last_page_len=[]), "a plan needs at least one request; last_page_len is empty"),
    (dict(qo_indptr=torch.tensor([0.0, 4.0, 7.0])), "qo_indptr must hold integers, got dtype torch.float32"),
    (
        dict(kv_indptr=torch.tensor([0, 2, 3], dtype=torch.float64)),
        "kv_indptr must hold integers, got dtype torch.float64",
    ),
    (dict(last_page_len=torch.tensor([True, True])), "last_page_len must hold integers, got dtype torch.bool"),
    (
        dict(kv_indices=torch.tensor([3, 1, 0], dtype=torch.complex64)),
        "kv_indices must hold integers, got dtype torch.complex64",
    ),
    (dict(kv_indices=np.array([3.0, 1.0, 0.0])), "kv_indices must hold integers, got dtype float64"),
    (dict(kv_indptr=np.array([False, True, True])), "kv_indptr must hold integers, got dtype bool"),
    (dict(last_page_len=[True, True]), "last_page_len[0] must be an integer, got True (bool)"),
    (dict(last_page_len=[2, True]), "last_page_len[1] must be an integer, got True (bool)"),
    (dict(qo_indptr=[0, 4.5, 7]), "qo_indptr[1] must be an integer, got 4.5 (float)"),
    (dict(kv_indices=[3, np.float64(1.0), 0]), "kv_indices[1] must be an integer, got np.float64(1.0) (float64)"),
    (dict(kv_indices=torch.tensor([[3, 1, 0]])), "kv_indices must be one-dimensional, got shape (1, 3)"),
    (dict(qo_indptr=torch.tensor(7)), "qo_indptr must be one-dimensional, got shape ()"),
    (dict(qo_indptr=[[0, 4, 7]]), "qo_indptr[0] must be an integer, got [0, 4, 7] (list)"),
    (dict(kv_indices=np.zeros((3, 1), dtype=np.int64)), "kv_indices must be one-dimensional, got shape (3, 1)"),
    (dict(qo_indptr=[[0], [4, 7]]), "qo_indptr[0] must be an integer, got [0] (list)"),
    (dict(kv_indptr="023"), "kv_indptr must be a sequence of integers, got str"),
    (dict(kv_indptr=b"\x00\x02\x03"), "kv_indptr must be a sequence of integers, got bytes"),
    (dict(kv_indices=bytearray([3, 1, 0])), "kv_indices must be a sequence of integers, got bytearray"),
    (dict(last_page_len=memoryview(bytes([2, 3]))), "last_page_len must be a sequence of integers, got memoryview"),
    (dict(kv_indices=["3", "1", "0"]), "kv_indices[0] must be an integer, got '3' (str)"),
    (dict(last_page_len=None), "last_page_len must be a sequence of integers, got NoneType"),
    (dict(last_page_len=3), "last_page_len must be a sequence of integers, got int"),
    (dict(qo_indptr={0: 0, 1: 4, 2: 7}), "qo_indptr must be a sequence of integers, got dict"),
    (dict(kv_indices=[3, None, 0]), "kv_indices[1] must be an integer, got None (NoneType)"),
    (dict(num_kv_heads=0), "num_kv_heads = 0 is below its minimum 1"),
    (dict(num_qo_heads=3), "num_qo_heads = 3 is not a multiple of num_kv_heads = 2"),
    (dict(num_kv_heads=0, qo_indptr="junk"), "num_kv_heads = 0"),  # heads are settled before anything else
    (dict(head_dim=0), "head_dim = 0 is below its minimum 1"),
    (dict(page_size=0), "page_size = 0 is below its minimum 1"),
    (dict(page_size=True), "page_size must be an integer, got True (bool)"),
    (dict(page_size=2**31), "page_size = 2147483648 does not fit in int32"),
    (dict(cta_tile_q=32), "cta_tile_q = 32 is not a supported tile (16, 64, 128)"),
    (dict(cta_tile_q="16"), "cta_tile_q must be an integer, got '16' (str)"),
]


@pytest.mark.parametrize("overrides, fragment", BAD_CSR, ids=range(len(BAD_CSR)))
def test_bad_csr_input_fails_with_the_value(overrides, fragment):
    with pytest.raises(pw.PagedWindowError) as err:
        from_csr(**overrides)
    assert fragment in str(err.value), str(err.value)


@pytest.mark.parametrize("overrides, fragment", BAD_CSR, ids=range(len(BAD_CSR)))
def test_bad_csr_update_changes_nothing(overrides, fragment):
    plan = filled_plan(cta_tile_q=16)
    before = snapshot(plan)
    with pytest.raises(pw.PagedWindowError) as err:
        update_csr(plan, **overrides)
    assert fragment in str(err.value), str(err.value)
    assert_unchanged(plan, before)


def test_kv_len_past_int32():
    with pytest.raises(pw.PagedWindowError) as err:
        pw.PrefillPagedPlan.from_csr(
            [0, 1], [0, 3], [0, 1, 2], [1], num_qo_heads=2, num_kv_heads=1, head_dim=8, page_size=2**30
        )
    assert "kv_len of request 0 = 2147483649 does not fit in int32 (bound 2147483647)" in str(err.value)
    # the largest legal kv_len is fine
    plan = pw.PrefillPagedPlan.from_csr(
        [0, 1], [0, 2], [0, 1], [2**30 - 1], num_qo_heads=2, num_kv_heads=1, head_dim=8, page_size=2**30
    )
    assert plan.kv_lens == (INT32_MAX,) and plan.start_positions == (INT32_MAX - 1,)


def test_packed_rows_past_int32():
    n = 1024
    with pytest.raises(pw.PagedWindowError) as err:
        pw.PrefillPagedPlan.from_csr(
            [0, 2**30], [0, n], np.arange(n), [2**20], num_qo_heads=2, num_kv_heads=1, head_dim=8, page_size=2**20
        )
    assert "packed rows (total_tokens * group) = 2147483648 does not fit in int32" in str(err.value)


# -- update_csr ----------------------------------------------------------------------------------------------


def test_update_csr_equals_from_csr_and_commits():
    plan = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=16, max_total_pages=8, max_batch=4, max_tiles=8, cta_tile_q=16
    )
    assert plan.version == 0 and not plan.filled
    assert update_csr(plan) is plan
    assert plan.version == 1 and plan.to_dict()["derived"] == from_csr().to_dict()["derived"]
    shared = to_csr([[0, 1, 2], [0, 1, 3], [0]], [3, 1, 2], [8, 8, 2], [3, 1, 0], 4)
    plan.update_csr(*shared.values(), **HEADS)
    assert plan.version == 2 and plan.pages == ((0, 1, 2), (0, 1, 3), (0,)) and plan.seq_lens == (3, 1, 0)
    arrays = plan.device_arrays("cpu")
    assert arrays.scalars.tolist() == [3, 4, 2]
    assert arrays.page_indices[:7].tolist() == [0, 1, 2, 0, 1, 3, 0] and not arrays.page_indices[7:].any()
    assert arrays.qo_indptr[:4].tolist() == [0, 3, 4, 4] and not arrays.qo_indptr[4:].any()


@pytest.mark.parametrize(
    "csr, fragment",
    [
        (
            dict(qo_indptr=[0, 8, 17], kv_indptr=[0, 3, 8], kv_indices=[0, 1, 2, 3, 4, 5, 6, 7], last_page_len=[4, 4]),
            "update: total_tokens = 17 exceeds the plan's capacity 16",
        ),
        (
            dict(qo_indptr=[0, 1, 2], kv_indptr=[0, 3, 9], kv_indices=list(range(9)), last_page_len=[4, 4]),
            "update: total_pages = 9 exceeds the plan's capacity 8",
        ),
        (
            dict(
                qo_indptr=[0, 1, 2, 3, 4, 5],
                kv_indptr=[0, 1, 2, 3, 4, 5],
                kv_indices=[0, 1, 2, 3, 4],
                last_page_len=[1, 1, 1, 1, 1],
            ),
            "update: batch_size = 5 exceeds the plan's capacity 4",
        ),
        (
            dict(
                qo_indptr=[0, 16],
                kv_indptr=[0, 4],
                kv_indices=[0, 1, 2, 3],
                last_page_len=[4],
                num_qo_heads=16,
                num_kv_heads=1,
            ),
            "update: num_tiles = 16 exceeds the plan's capacity 8",
        ),
    ],
)
def test_update_csr_capacity_overflow_is_refused(csr, fragment):
    plan = filled_plan(cta_tile_q=16)
    before = snapshot(plan)
    with pytest.raises(pw.PagedWindowError) as err:
        update_csr(plan, **csr)
    assert fragment in str(err.value), str(err.value)
    assert_unchanged(plan, before)


def test_update_csr_keeps_the_fixed_tile():
    plan = filled_plan(cta_tile_q=64)
    assert plan.cta_tile_q == 64 and plan.tile_reason == "explicit"
    update_csr(plan, cta_tile_q=None)
    assert plan.cta_tile_q == 64 and plan.num_tiles == 2
    update_csr(plan, cta_tile_q=64)
    before = snapshot(plan)
    for tile in (16, 128):
        with pytest.raises(pw.PagedWindowError) as err:
            update_csr(plan, cta_tile_q=tile)
        assert (
            f"update: cta_tile_q = {tile} differs from the plan's fixed tile 64 (a captured launch uses that "
            f"tile); build a new plan for another tile"
        ) in str(err.value)
        assert_unchanged(plan, before)
    with pytest.raises(pw.PagedWindowError, match="cta_tile_q = 32 is not a supported tile"):
        update_csr(plan, cta_tile_q=32)
    assert_unchanged(plan, before)
    # a policy-fixed tile is just as fixed: a batch that alone would get 128 still lays out with 64
    # (4224 tokens x group 2 = 66 tiles of 128 rows x 2 KV heads = 132 CTAs: one wave at 128, two at 64)
    policy = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=4224, max_total_pages=1056, max_batch=128, max_tiles=132, device="cpu"
    )
    assert policy.cta_tile_q == 64 and policy.tile_reason == "policy sm_90 capacity: 33 tokens per request"
    long = dict(qo_indptr=[0, 4224], kv_indptr=[0, 1056], kv_indices=list(range(1056)), last_page_len=[4])
    alone = from_csr(**long, device="cpu")
    assert (alone.cta_tile_q, alone.num_tiles) == (128, 66) and "1 x 128 = 128 at 128" in alone.tile_reason
    update_csr(policy, **long)
    assert policy.cta_tile_q == 64 and policy.num_tiles == 8448 // 64
    with pytest.raises(pw.PagedWindowError, match="differs from the plan's fixed tile 64"):
        update_csr(policy, **long, cta_tile_q=128)


# -- random shared pages against a brute-force slot-ownership check --------------------------------------------


@st.composite
def csr_batches(draw):
    page_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    n = draw(st.integers(1, 6))
    base = draw(st.sampled_from([0, 2**30, INT32_MAX - 400]))  # dense and sparse page ids
    id_range = draw(st.integers(1, 24))  # ids below base + id_range are drawn by several requests
    fresh_id = base + 24  # ids from here on are used once
    tidy = draw(st.booleans())  # mostly a shared read-only prefix, own pages after it
    pages, starts, seqs = [], [], []
    for _ in range(n):
        kv_len = draw(st.integers(1, 30))
        seq = draw(st.one_of(st.just(kv_len), st.just(0), st.integers(0, kv_len), st.integers(0, min(3, kv_len))))
        need = -(-kv_len // page_size)
        mine = []
        if pages and (tidy or draw(st.booleans())):  # start with a prefix of an earlier request's pages
            d = draw(st.integers(0, len(pages) - 1))
            k = draw(st.integers(0, min(len(pages[d]), need)))
            if tidy and draw(st.integers(0, 9)):  # a read-only prefix: cached in full by both requests
                k = min(k, starts[d] // page_size, kv_len // page_size)
                seq = min(seq, kv_len - k * page_size)
            mine = list(pages[d][:k])
        mode = "fresh" if tidy and draw(st.integers(0, 9)) else draw(st.sampled_from(["fresh", "shared", "repeats"]))
        while len(mine) < need:
            page = base + draw(st.integers(0, id_range - 1))
            if mode == "fresh" or (mode == "shared" and page in mine):
                page, fresh_id = fresh_id, fresh_id + 1
            mine.append(page)
        pages.append(mine)
        starts.append(kv_len - seq)
        seqs.append(seq)
    lasts = [s + q - (len(p) - 1) * page_size for p, s, q in zip(pages, starts, seqs)]
    group = draw(st.sampled_from([1, 2, 8]))
    tile = draw(st.sampled_from([None, *SUPPORTED_CTA_TILE_Q]))
    kind = draw(st.sampled_from(["list", "numpy", "torch32", "torch64"]))
    tail = draw(st.lists(st.integers(-5, 2**31 + 5), max_size=3))
    return dict(
        pages=pages,
        lasts=lasts,
        starts=starts,
        seqs=seqs,
        page_size=page_size,
        group=group,
        tile=tile,
        kind=kind,
        tail=tail,
    )


def slot_conflicts(pages, starts, seqs, page_size):
    """Brute force: who writes and who reads (as cached prefix) each (page, slot); the conflicts found."""
    repeats = [(r, p) for r, ids in enumerate(pages) for p in set(ids) if ids.count(p) > 1]
    writers, readers = {}, {}
    for r, (ids, start, seq) in enumerate(zip(pages, starts, seqs)):
        for pos in range(start + seq):
            key = (ids[pos // page_size], pos % page_size)
            (readers if pos < start else writers).setdefault(key, set()).add(r)
    write_read = {k for k, w in writers.items() if readers.get(k, set()) - w}
    write_write = {k for k, w in writers.items() if len(w) > 1}
    return repeats, write_read, write_write, writers, readers


def per_request_names(message, kv_indptr):
    """``message`` with every flat ``kv_indices[f]`` renamed ``page_indices[r][j]``, the name ``batch`` uses."""

    def rename(m):
        flat = int(m[1])
        r = max(i for i in range(len(kv_indptr) - 1) if kv_indptr[i] <= flat)
        return f"page_indices[{r}][{flat - kv_indptr[r]}]"

    return re.sub(r"kv_indices\[(\d+)\]", rename, message)


def as_kind(values, kind):
    if kind == "numpy":
        return np.array(values, dtype=np.int64)
    if kind == "torch32":
        return torch.tensor(values, dtype=torch.int32)
    if kind == "torch64":
        return torch.tensor(values, dtype=torch.int64)
    return list(values)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(csr_batches())
def test_random_shared_pages_accepted_iff_no_slot_conflict(b):
    pages, starts, seqs, page_size, group = b["pages"], b["starts"], b["seqs"], b["page_size"], b["group"]
    csr = to_csr(pages, b["lasts"], starts, seqs, page_size)
    kind = b["kind"] if b["kind"] != "torch32" or all(x <= INT32_MAX for x in b["tail"]) else "torch64"
    indices = csr["kv_indices"] + b["tail"]
    heads = dict(
        num_qo_heads=2 * group, num_kv_heads=2, head_dim=8, page_size=page_size, cta_tile_q=b["tile"], device="cpu"
    )
    repeats, write_read, write_write, writers, readers = slot_conflicts(pages, starts, seqs, page_size)

    def build():
        return pw.PrefillPagedPlan.from_csr(
            as_kind(csr["qo_indptr"], kind),
            as_kind(csr["kv_indptr"], kind),
            as_kind(indices, kind),
            as_kind(csr["last_page_len"], kind),
            **heads,
        )

    if repeats or write_read or write_write:
        with pytest.raises(pw.PagedWindowError) as err:
            build()
        message = str(err.value)
        if repeats:
            m = re.search(
                r"page id (\d+) appears more than once in request (\d+)'s pages "
                r"\(kv_indices\[(\d+)\] and kv_indices\[(\d+)\]\)",
                message,
            )
            assert m, message
            page, r, first, second = map(int, m.groups())
            assert pages[r].count(page) > 1, message
            # the two named entries are that page id, both inside request r's pages
            lo, hi = csr["kv_indptr"][r], csr["kv_indptr"][r + 1]
            assert lo <= first < second < hi and indices[first] == indices[second] == page, message
        elif write_read:
            m = re.search(
                r"request (\d+) writes new rows into page (\d+) slot (\d+), which request (\d+) reads as "
                r"cached prefix",
                message,
            )
            assert m, message
            key = (int(m[2]), int(m[3]))
            assert int(m[1]) in writers[key] and int(m[4]) in readers[key], (message, key)
        else:
            m = re.search(r"requests (\d+) and (\d+) both write page (\d+) slot (\d+)", message)
            assert m, message
            key = (int(m[3]), int(m[4]))
            assert {int(m[1]), int(m[2])} <= writers[key] and m[1] != m[2], (message, key)
        with pytest.raises(pw.PagedWindowError) as again:  # the per-request form refuses it the same way,
            pw.PrefillPagedPlan.batch(pages, b["lasts"], starts, seqs, **heads)
        assert str(again.value) == per_request_names(message, csr["kv_indptr"])  # naming entries per request
        return

    plan = build()
    assert plan == pw.PrefillPagedPlan.batch(pages, b["lasts"], starts, seqs, **heads)
    assert plan.pages == tuple(map(tuple, pages))
    assert plan.max_page_index == max(max(p) for p in pages)
    assert plan.max_last_page_len == max(b["lasts"])
    assert list(plan.start_positions) == starts and list(plan.seq_lens) == seqs
    if b["tile"] is not None:
        assert plan.cta_tile_q == b["tile"]
    # the tiles cover every packed row exactly once
    tile, qo = plan.cta_tile_q, plan.qo_indptr.tolist()
    covered = {}
    for r, t in zip(plan.request_indices.tolist(), plan.qo_tile_indices.tolist()):
        rows = (qo[r + 1] - qo[r]) * group
        assert t * tile < rows, (r, t)  # no empty tile
        for p in range(t * tile, min((t + 1) * tile, rows)):
            covered[(r, p)] = covered.get((r, p), 0) + 1
    assert covered == {(r, p): 1 for r, s in enumerate(seqs) for p in range(s * group)}

    # longest first: by the end of the tile's keys, largest first, ties in request order and tile order
    def key_end(r, t):
        return starts[r] + -(-min((t + 1) * tile, seqs[r] * group) // group)

    listed = list(zip(plan.request_indices.tolist(), plan.qo_tile_indices.tolist()))
    assert listed == sorted(listed, key=lambda rt: (-key_end(*rt), rt))


# -- from_dict is a trust boundary ---------------------------------------------------------------------------


def good_dict():
    return json.loads(json.dumps(pw.PrefillPagedPlan.batch(**GOOD_REQUESTS, **HEADS).to_dict()))


def changed(path, value=None, *, drop=False):
    data = good_dict()
    *parents, last = path
    node = data
    for key in parents:
        node = node[key]
    if drop:
        del node[last]
    else:
        node[last] = value
    return data


CAPACITY = {"max_total_tokens": 8, "max_total_pages": 4, "max_batch": 2, "max_tiles": 2}

BAD_DICTS = [
    ([], "from_dict: expected a dict, got list"),
    ("plan", "from_dict: expected a dict, got str"),
    (None, "from_dict: expected a dict, got NoneType"),
    ({**good_dict(), "bogus": 1}, "from_dict: unknown key(s) ['bogus']"),
    ({**good_dict(), 7: 1}, "from_dict: unknown key(s) ['7']"),
    (
        changed(["capacity"], drop=True),
        "from_dict: 'capacity' must be a dict with keys ['max_total_tokens', "
        "'max_total_pages', 'max_batch', 'max_tiles'], got NoneType",
    ),
    (changed(["capacity"], [8, 4, 2, 2]), "'capacity' must be a dict with keys"),
    (
        changed(["capacity", "max_tiles"], drop=True),
        "from_dict: 'capacity' has keys ['max_batch', 'max_total_pages', 'max_total_tokens']; expected",
    ),
    (
        changed(["capacity", "spare"], 1),
        "'capacity' has keys ['max_batch', 'max_tiles', 'max_total_pages', 'max_total_tokens', 'spare']",
    ),
    (changed(["capacity", "max_total_tokens"], "8"), "capacity.max_total_tokens must be an integer, got '8' (str)"),
    (changed(["capacity", "max_batch"], 2.0), "capacity.max_batch must be an integer, got 2.0 (float)"),
    (changed(["capacity", "max_tiles"], None), "capacity.max_tiles must be an integer, got None (NoneType)"),
    (changed(["capacity", "max_total_pages"], [4]), "capacity.max_total_pages must be an integer, got [4] (list)"),
    (changed(["capacity", "max_total_pages"], -1), "capacity.max_total_pages = -1 is below its minimum 1"),
    (changed(["capacity", "max_batch"], True), "capacity.max_batch must be an integer, got True (bool)"),
    (changed(["capacity", "max_total_tokens"], 2**31), "capacity.max_total_tokens = 2147483648 does not fit in int32"),
    (changed(["capacity", "max_total_tokens"], 4), "update: total_tokens = 7 exceeds the plan's capacity 4"),
    (changed(["seq_lens"], drop=True), "a filled plan needs every request key; missing ['seq_lens']"),
    (
        {k: v for k, v in good_dict().items() if k not in ("num_qo_heads", "head_dim")},
        "missing ['num_qo_heads', 'head_dim']",
    ),
    (
        {"capacity": CAPACITY, "cta_tile_q": 16, "derived": good_dict()["derived"]},
        "from_dict: 'derived' arrays given for a plan with no requests",
    ),
    (changed(["cta_tile_q"], "16"), "cta_tile_q must be an integer, got '16' (str)"),
    (changed(["cta_tile_q"], 16.0), "cta_tile_q must be an integer, got 16.0 (float)"),
    (changed(["cta_tile_q"], 32), "cta_tile_q = 32 is not a supported tile"),
    (changed(["cta_tile_q"], [16]), "cta_tile_q must be an integer, got [16] (list)"),
    (changed(["cta_tile_q"], drop=True), "from_dict: missing 'cta_tile_q' (the plan's fixed tile)"),
    (changed(["cta_tile_q"], None), "from_dict: cta_tile_q must be an integer, got None (NoneType)"),
    ({"capacity": CAPACITY}, "from_dict: missing 'cta_tile_q'"),
    ({"capacity": CAPACITY, "cta_tile_q": None}, "from_dict: cta_tile_q must be an integer, got None (NoneType)"),
    (changed(["num_qo_heads"], "4"), "num_qo_heads must be an integer, got '4' (str)"),
    (changed(["num_kv_heads"], True), "num_kv_heads must be an integer, got True (bool)"),
    (changed(["head_dim"], None), "head_dim must be an integer, got None (NoneType)"),
    (changed(["page_size"], 4.0), "page_size must be an integer, got 4.0 (float)"),
    (changed(["page_size"], {"value": 4}), "page_size must be an integer, got {'value': 4} (dict)"),
    (changed(["page_indices"], "ab"), "page_indices must be a sequence of per-request page lists, got str"),
    (
        changed(["page_indices"], {"0": [3, 1], "1": [0]}),
        "page_indices must be a sequence of per-request page lists, got dict",
    ),
    (changed(["page_indices"], [[3, {"a": 1}], [0]]), "page_indices[0][1] must be an integer, got {'a': 1} (dict)"),
    (changed(["page_indices"], [[3, 1], [[0]]]), "page_indices[1][0] must be an integer, got [0] (list)"),
    (changed(["page_indices"], [[3, 1], [None]]), "page_indices[1][0] must be an integer, got None (NoneType)"),
    (changed(["page_indices"], [3, 0]), "page_indices[0] must be a sequence of integers, got int"),
    (changed(["page_indices"], [[3, 1]]), "page_indices has 1 entries but seq_lens has 2"),
    (changed(["seq_lens"], None), "seq_lens must be a sequence of integers, got NoneType"),
    (changed(["seq_lens"], [4, None]), "seq_lens[1] must be an integer, got None (NoneType)"),
    (changed(["seq_lens"], [4, -3]), "seq_lens[1] = -3 is below its minimum 0"),
    (changed(["last_page_lens"], {"0": 2, "1": 3}), "last_page_lens must be a sequence of integers, got dict"),
    (changed(["last_page_lens"], [2, 4]), "last_page_lens[1] = 4 disagrees with kv_len 3"),
    (changed(["start_positions"], [2, -1]), "start_positions[1] = -1 is below its minimum 0"),
    (changed(["start_positions"], ["2", "0"]), "start_positions[0] must be an integer"),
    (
        changed(["derived", "request_indices"], [0, 0]),
        "from_dict: the recorded 'derived' arrays disagree with the rebuilt plan",
    ),
    (changed(["derived"], "junk"), "from_dict: 'derived' must be a dict of named arrays, got str"),
    (changed(["derived"], None), "from_dict: 'derived' must be a dict of named arrays, got NoneType"),
    (changed(["derived"], drop=True), "from_dict: a filled plan needs every request key; missing ['derived']"),
    (changed(["derived", 1], 0), "from_dict: 'derived' keys must be array names (str), got 1 (int)"),
    (changed(["derived", None], []), "from_dict: 'derived' keys must be array names (str), got None (NoneType)"),
    (changed(["derived"], np.array([1, 2])), "from_dict: 'derived' must be a dict of named arrays, got ndarray"),
    (
        changed(["derived", "qo_indptr"], np.array(good_dict()["derived"]["qo_indptr"])),
        "from_dict: 'derived' values must be integers or lists of integers, got ndarray",
    ),
    (changed(["derived", "max_page_index"], True), "'derived' values must be integers or lists of integers, got bool"),
    (changed(["derived", "max_page_index"], 9), "the recorded 'derived' arrays disagree"),
    (
        changed(["page_indices"], np.array(5)),
        "page_indices must be a sequence of per-request page lists, got a 0-d array",
    ),
]


@pytest.mark.parametrize("data, fragment", BAD_DICTS, ids=range(len(BAD_DICTS)))
def test_from_dict_refuses_malformed_dicts(data, fragment):
    with pytest.raises(pw.PagedWindowError) as err:
        pw.PrefillPagedPlan.from_dict(data)
    message = str(err.value)
    assert message.startswith("from_dict: ") and fragment in message, message


def test_bad_dict_table_is_distinct_and_large():
    assert len(BAD_DICTS) >= 15
    assert len({repr(d) for d, _ in BAD_DICTS}) == len(BAD_DICTS)
    good = good_dict()
    assert pw.PrefillPagedPlan.from_dict(good) == pw.PrefillPagedPlan.batch(**GOOD_REQUESTS, **HEADS)
    assert all(repr(d) != repr(good) for d, _ in BAD_DICTS)


@pytest.mark.parametrize(
    "capacity, fragment",
    [
        ({k: 2**31 - 1 for k in CAPACITY}, f"past the limit {PLAN_BUFFER_MAX_ENTRIES} (1 GiB)"),
        ({**CAPACITY, "max_total_pages": 2**31 - 1}, "int32 entries (8192 MiB), past the limit"),
        ({**CAPACITY, "max_tiles": PLAN_BUFFER_MAX_ENTRIES}, "past the limit"),
        ({k: 2**31 for k in CAPACITY}, "capacity.max_total_tokens = 2147483648 does not fit in int32"),
        ({**CAPACITY, "max_batch": 2**62}, "capacity.max_batch = 4611686018427387904 does not fit in int32"),
    ],
)
def test_from_dict_huge_capacity_fails_fast_without_allocating(capacity, fragment, monkeypatch):
    allocated = []

    def no_big_allocation(*shape, **kwargs):
        allocated.append(shape)
        raise AssertionError(f"allocated {shape}")

    monkeypatch.setattr(torch, "zeros", no_big_allocation)
    for data in ({"capacity": capacity, "cta_tile_q": 16}, {**good_dict(), "capacity": capacity}):
        t0 = time.perf_counter()
        with pytest.raises(pw.PagedWindowError) as err:
            pw.PrefillPagedPlan.from_dict(data)
        elapsed = time.perf_counter() - t0
        assert fragment in str(err.value) and str(err.value).startswith("from_dict: "), str(err.value)
        assert elapsed < 1.0, f"from_dict took {elapsed:.3f} s to refuse {capacity}"
    assert allocated == []


H256 = dict(num_qo_heads=2, num_kv_heads=1, head_dim=256, page_size=4)
CSR256 = ([0, 3, 5], [0, 1, 3], [7, 1, 2], [3, 2])  # the policy picks 16; its exact capacity alone would pick 64

PLAN_KINDS = {
    "from_csr": lambda: pw.PrefillPagedPlan.from_csr(*CSR256, **H256),
    "batch": lambda: pw.PrefillPagedPlan.batch(**GOOD_REQUESTS, **HEADS),
    "single": lambda: pw.PrefillPagedPlan.single(list(range(10, 30)), 16, 300, 20, **{**HEADS, "page_size": 16}),
    "preallocated unfilled": lambda: pw.PrefillPagedPlan.preallocated(**CAPACITY),
    "preallocated filled": filled_plan,
    "preallocated at 128, filled": lambda: update_csr(  # the capacity's tile, not the batch's (16)
        pw.PrefillPagedPlan.preallocated(max_total_tokens=1024, max_total_pages=8, max_batch=4, max_tiles=8)
    ),
    "explicit cta_tile_q": lambda: from_csr(cta_tile_q=128),
}


@pytest.mark.parametrize("kind", PLAN_KINDS)
def test_from_dict_takes_what_to_dict_writes_for_every_plan_kind_and_keeps_the_tile(kind):
    plan = PLAN_KINDS[kind]()
    for data in (plan.to_dict(), json.loads(json.dumps(plan.to_dict()))):
        rebuilt = pw.PrefillPagedPlan.from_dict(data)
        assert rebuilt == plan and rebuilt.to_dict() == data
        assert (rebuilt.cta_tile_q, rebuilt.filled, rebuilt.capacity) == (plan.cta_tile_q, plan.filled, plan.capacity)
    data = plan.to_dict()
    data["cta_tile_q"] = None  # never "ask the policy again": a plan's tile is fixed at creation
    with pytest.raises(pw.PagedWindowError, match=r"^from_dict: cta_tile_q must be an integer, got None"):
        pw.PrefillPagedPlan.from_dict(data)
    del data["cta_tile_q"]
    with pytest.raises(pw.PagedWindowError, match=r"^from_dict: missing 'cta_tile_q'"):
        pw.PrefillPagedPlan.from_dict(data)


def test_from_dict_keeps_the_plans_tile_whatever_a_policy_would_pick():
    plan = PLAN_KINDS["from_csr"]()  # the batch's pick; the capacity's would be 64
    cap = plan.capacity
    assert plan.cta_tile_q == 16 and tiles.tile_for_capacity(cap.max_total_tokens, cap.max_batch)[0] == 64
    assert pw.PrefillPagedPlan.from_dict(plan.to_dict()).cta_tile_q == 16
    plan = PLAN_KINDS["preallocated at 128, filled"]()  # the capacity's pick; the batch's would be 16
    assert plan.cta_tile_q == 128 and from_csr().cta_tile_q == 16
    assert pw.PrefillPagedPlan.from_dict(plan.to_dict()).cta_tile_q == 128


def test_from_dict_names_a_non_string_derived_key():
    data = PLAN_KINDS["from_csr"]().to_dict()
    data["derived"][1] = 0
    with pytest.raises(pw.PagedWindowError) as err:
        pw.PrefillPagedPlan.from_dict(data)
    assert str(err.value) == "from_dict: 'derived' keys must be array names (str), got 1 (int)"


def test_capacity_at_the_buffer_limit_is_accepted_and_one_past_refused():
    fixed = 3 + 5 + 4 + 5 + 2 * 8  # scalars, page_indptr, last_page_len, qo_indptr, two tile segments
    at_limit = dict(max_total_tokens=8, max_batch=4, max_tiles=8, max_total_pages=PLAN_BUFFER_MAX_ENTRIES - fixed)
    cap = PlanCapacity.checked(
        "", *(at_limit[k] for k in ("max_total_tokens", "max_total_pages", "max_batch", "max_tiles"))
    )
    assert cap.buffer_entries == PLAN_BUFFER_MAX_ENTRIES
    with pytest.raises(pw.PagedWindowError) as err:
        PlanCapacity.checked("", 8, PLAN_BUFFER_MAX_ENTRIES - fixed + 1, 4, 8)
    assert f"needs a buffer of {PLAN_BUFFER_MAX_ENTRIES + 1} int32 entries" in str(err.value)
    with pytest.raises(pw.PagedWindowError, match="past the limit"):
        pw.PrefillPagedPlan.preallocated(
            max_total_tokens=8, max_total_pages=PLAN_BUFFER_MAX_ENTRIES - fixed + 1, max_batch=4, max_tiles=8
        )


# -- returned arrays are copies ------------------------------------------------------------------------------

ARRAY_PROPERTIES = ("page_indices", "page_indptr", "last_page_len", "qo_indptr", "request_indices", "qo_tile_indices")


@pytest.mark.parametrize("name", ARRAY_PROPERTIES)
@pytest.mark.parametrize("exact", [True, False])
def test_mutating_a_returned_array_leaves_the_plan_unchanged(name, exact):
    plan = from_csr() if exact else filled_plan()
    before = snapshot(plan)
    bounds = (plan.max_page_index, plan.max_last_page_len, plan.total_tokens, plan.num_tiles)
    got = getattr(plan, name)
    expected = got.tolist()
    assert got.dtype == torch.int32 and got.numel() > 0
    got.fill_(INT32_MAX)
    got[0] = -7
    assert getattr(plan, name).tolist() == expected
    got.numpy()[:] = 12345  # through the numpy view too
    assert getattr(plan, name).tolist() == expected
    assert_unchanged(plan, before)
    assert (plan.max_page_index, plan.max_last_page_len, plan.total_tokens, plan.num_tiles) == bounds
    # the CPU device buffer and its views are fresh copies too
    plan.device_buffer("cpu").fill_(-1)
    getattr(plan.device_arrays("cpu"), name).fill_(-1)
    assert_unchanged(plan, before)


# -- host cost -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shared_prefix", [0, 128])
def test_from_csr_host_time_64_requests_256_pages(shared_prefix):
    batch, pages, page_size = 64, 256, 16
    gen = np.random.default_rng(1)
    prefix = np.arange(shared_prefix)  # read-only pages every request starts with
    own = gen.permutation(batch * (pages - shared_prefix)) + shared_prefix
    kv_indices = np.concatenate(
        [
            np.concatenate([prefix, own[i * (pages - shared_prefix) : (i + 1) * (pages - shared_prefix)]])
            for i in range(batch)
        ]
    ).astype(np.int32)
    kv_indptr = np.arange(batch + 1, dtype=np.int32) * pages
    last = gen.integers(1, page_size + 1, batch).astype(np.int32)
    seq = gen.integers(1, (pages - shared_prefix - 1) * page_size, batch)  # new rows stay past the shared prefix
    qo_indptr = np.concatenate(([0], np.cumsum(seq))).astype(np.int32)
    args = [torch.from_numpy(a) for a in (qo_indptr, kv_indptr, kv_indices, last)]
    heads = dict(num_qo_heads=8, num_kv_heads=1, head_dim=256, page_size=page_size, device="cpu")
    plan = pw.PrefillPagedPlan.from_csr(*args, **heads)
    assert plan.batch_size == batch and plan.total_pages == batch * pages
    assert plan.seq_lens == tuple(seq.tolist())
    times = []
    for _ in range(40):
        t0 = time.perf_counter()
        pw.PrefillPagedPlan.from_csr(*args, **heads)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    assert median < 5e-3, f"from_csr median {median * 1e3:.3f} ms for 64 x 256 pages (bound 5 ms)"


# -- inputs that once slipped through: a bool or float among ints, non-sequences, names in messages ---------


def test_a_bool_among_ints_is_refused():
    for make in (
        lambda: from_csr(last_page_len=[True, 3]),
        lambda: pw.PrefillPagedPlan.batch(GOOD_REQUESTS["page_indices"], [2, 3], [2, 0], [4, True], **HEADS),
    ):
        try:
            plan = make()
        except pw.PagedWindowError as err:
            assert "must be an integer" in str(err) and "bool" in str(err), str(err)
        else:
            raise AssertionError(f"accepted a bool as an integer: {plan!r}")


def test_a_float_among_ints_is_named_by_its_own_index():
    with pytest.raises(pw.PagedWindowError) as err:
        from_csr(qo_indptr=[0, 4.5, 7])
    assert "qo_indptr[1] must be an integer" in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("last_page_lens", 5, "last_page_lens must be a sequence of integers, got int"),
        ("start_positions", None, "start_positions must be a sequence of integers, got NoneType"),
        ("last_page_lens", torch.tensor(2), "last_page_lens must be one-dimensional, got shape ()"),
        ("start_positions", torch.tensor([[2, 0]]), "start_positions must be one-dimensional, got shape (1, 2)"),
        ("seq_lens", 7, "seq_lens must be a sequence of integers, got int"),
    ],
)
def test_a_non_sequence_per_request_field_names_the_key(field, value, message):
    with pytest.raises(pw.PagedWindowError) as err:
        pw.PrefillPagedPlan.batch(**{**GOOD_REQUESTS, field: value}, **HEADS)
    assert str(err.value) == message
    plan = filled_plan(cta_tile_q=16)  # update refuses it the same way and changes nothing
    before = snapshot(plan)
    with pytest.raises(pw.PagedWindowError) as err:
        plan.update(**{**GOOD_REQUESTS, field: value}, **HEADS)
    assert str(err.value) == message
    assert_unchanged(plan, before)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("last_page_lens", 5, "from_dict: last_page_lens must be a sequence of integers, got int"),
        ("start_positions", None, "from_dict: start_positions must be a sequence of integers, got NoneType"),
    ],
)
def test_from_dict_names_a_non_sequence_request_field(field, value, message):
    with pytest.raises(pw.PagedWindowError) as err:
        pw.PrefillPagedPlan.from_dict(changed([field], value))
    assert str(err.value) == message


def test_batch_names_a_bad_page_id_per_request():
    with pytest.raises(pw.PagedWindowError) as err:
        pw.PrefillPagedPlan.batch([[3, 2**31], [0]], [2, 3], [2, 0], [4, 3], **HEADS)
    assert str(err.value) == "page id page_indices[0][1] = 2147483648 does not fit in int32 (bound 2147483647)"
    with pytest.raises(pw.PagedWindowError) as err:  # from_dict goes through the per-request form
        pw.PrefillPagedPlan.from_dict(changed(["page_indices"], [[3, 1], [-1]]))
    assert str(err.value) == "from_dict: page id page_indices[1][0] = -1 is below its minimum 0"


@pytest.mark.parametrize("requests", REQUEST_SETS)
def test_batch_of_plain_int_lists_equals_the_per_request_form(requests):
    """Lists of plain ints are read in one conversion; tuples and arrays request by request: the same plan."""
    *lists, page_size = requests
    heads = dict(num_qo_heads=8, num_kv_heads=2, head_dim=16, page_size=page_size, device="cpu")
    as_lists = pw.PrefillPagedPlan.batch(*lists, **heads)
    as_tuples = pw.PrefillPagedPlan.batch([tuple(p) for p in lists[0]], *lists[1:], **heads)
    as_arrays = pw.PrefillPagedPlan.batch([np.array(p, dtype=np.int64) for p in lists[0]], *lists[1:], **heads)
    assert as_lists.to_dict() == as_tuples.to_dict() == as_arrays.to_dict()
    assert torch.equal(as_lists.device_buffer("cpu"), as_tuples.device_buffer("cpu"))


@pytest.mark.parametrize(
    "pages, message",
    [
        ([[3, True], [0]], "page_indices[0][1] must be an integer, got True (bool)"),
        ([[3, 1], [0.0]], "page_indices[1][0] must be an integer, got 0.0 (float)"),
        ([[3, 2**64], [0]], "page_indices[0] holds integers past int64"),
        ([[3, 1], ["0"]], "page_indices[1][0] must be an integer, got '0' (str)"),
        ([[3, 1], []], "page_indices[1] is empty; every request needs at least one page"),
        ([[3, 1], [-1]], "page id page_indices[1][0] = -1 is below its minimum 0"),
    ],
)
def test_batch_of_lists_names_the_bad_entry(pages, message):
    for form in (pages, [tuple(p) for p in pages]):  # the one-conversion path and the per-request path
        with pytest.raises(pw.PagedWindowError) as err:
            pw.PrefillPagedPlan.batch(form, [2, 3], [2, 0], [4, 3], **HEADS)
        assert message in str(err.value)


def test_batch_accepts_numpy_ints_inside_lists():
    plain = pw.PrefillPagedPlan.batch([[3, 1], [0]], [2, 3], [2, 0], [4, 3], **HEADS)
    mixed = pw.PrefillPagedPlan.batch([[np.int32(3), 1], [np.int64(0)]], [2, 3], [2, 0], [4, 3], **HEADS)
    assert plain.to_dict() == mixed.to_dict()


def test_from_dict_prefixes_once():
    with pytest.raises(pw.PagedWindowError) as err:
        pw.PrefillPagedPlan.from_dict(changed(["capacity", "max_total_pages"], -1))
    assert str(err.value) == "from_dict: capacity.max_total_pages = -1 is below its minimum 1"


def test_csr_tensors_past_int64_or_unreadable_are_refused_naming_them():
    heads = dict(num_qo_heads=4, num_kv_heads=2, head_dim=8, page_size=4)
    big = torch.tensor([2**64 - 1], dtype=torch.uint64)  # numpy reads it as uint64; it must not wrap to -1
    with pytest.raises(pw.PagedWindowError, match=r"^last_page_len holds integers past int64"):
        pw.PrefillPagedPlan.from_csr([0, 1], [0, 1], [0], big, **heads)
    with pytest.raises(pw.PagedWindowError, match=r"^kv_indptr holds integers past int64"):
        pw.PrefillPagedPlan.from_csr([0, 1], torch.tensor([0, 2**64 - 1], dtype=torch.uint64), [0], [1], **heads)
    sparse = torch.tensor([0, 1]).to_sparse()
    with pytest.raises(pw.PagedWindowError, match=r"^qo_indptr: cannot read a cpu tensor .* layout torch.sparse_coo"):
        pw.PrefillPagedPlan.from_csr(sparse, [0, 1], [0], [1], **heads)
    negative_view = torch._neg_view(torch.tensor([0, -1]))  # reads as [0, 1]
    want = pw.PrefillPagedPlan.from_csr([0, 1], [0, 1], [0], [1], **heads)
    assert pw.PrefillPagedPlan.from_csr(negative_view, [0, 1], [0], [1], **heads) == want


@pytest.mark.parametrize("buffer", [bytes, bytearray, memoryview], ids=lambda b: b.__name__)
def test_byte_buffers_are_refused_alike(buffer):
    """bytes, bytearray and memoryview are sequences of small ints to Python; none is read as integers."""
    name = buffer.__name__

    def raw(values):
        return buffer(bytes(values))

    with pytest.raises(pw.PagedWindowError) as err:  # a bytearray here was once read as page 7
        pw.PrefillPagedPlan.from_csr([0, 1], [0, 1], raw([7]), [1], **HEADS)
    assert str(err.value) == f"kv_indices must be a sequence of integers, got {name}"
    cases = [
        (dict(page_indices=[raw([3, 1]), [0]]), f"page_indices[0] must be a sequence of integers, got {name}"),
        (dict(page_indices=raw([3, 0])), f"page_indices must be a sequence of per-request page lists, got {name}"),
        (dict(seq_lens=raw([4, 3])), f"seq_lens must be a sequence of integers, got {name}"),
        (dict(start_positions=raw([2, 0])), f"start_positions must be a sequence of integers, got {name}"),
    ]
    for overrides, message in cases:
        with pytest.raises(pw.PagedWindowError) as err:
            pw.PrefillPagedPlan.batch(**{**GOOD_REQUESTS, **overrides}, **HEADS)
        assert str(err.value) == message
        plan = filled_plan(cta_tile_q=16)
        before = snapshot(plan)
        with pytest.raises(pw.PagedWindowError) as err:
            plan.update(**{**GOOD_REQUESTS, **overrides}, **HEADS)
        assert str(err.value) == message
        assert_unchanged(plan, before)
    plan = filled_plan(cta_tile_q=16)
    before = snapshot(plan)
    with pytest.raises(pw.PagedWindowError) as err:
        update_csr(plan, qo_indptr=raw([0, 4, 7]))
    assert str(err.value) == f"qo_indptr must be a sequence of integers, got {name}"
    assert_unchanged(plan, before)


# -- the device argument ---------------------------------------------------------------------------------------

CUDA_COUNT = torch.cuda.device_count()
NO_CUDA = "requested but CUDA is not available"
BAD_DEVICES = [
    ("bogus", "device 'bogus' is not a device: give None, 'cpu', 'cuda', 'cuda:N', a CUDA index or a torch.device"),
    ("cuda:x", "device 'cuda:x' is not a device"),
    ("", "device '' is not a device"),
    (1.5, "device 1.5 (float) is not a device"),
    (True, "device True (bool) is not a device"),
    (-1, "device -1 (int) is not a device"),
    (["cpu"], "device ['cpu'] (list) is not a device"),
    ("cuda:99", f"device 'cuda:99' {NO_CUDA}" if not CUDA_COUNT else f"only {CUDA_COUNT} CUDA device(s) are visible"),
    (99, f"device 99 {NO_CUDA}" if not CUDA_COUNT else "device 99 requested but only"),
    (torch.device("cuda", 99), "device 'cuda:99' requested but"),
]
if not CUDA_COUNT:
    BAD_DEVICES += [
        ("cuda", f"device 'cuda' {NO_CUDA}"),
        ("cuda:0", f"device 'cuda:0' {NO_CUDA}"),
        (7, f"device 7 {NO_CUDA}"),
        (torch.device("cuda"), f"device 'cuda' {NO_CUDA}"),
    ]

CONSTRUCTORS = {
    "from_csr": lambda device: from_csr(device=device),
    "from_csr on tensors": lambda device: pw.PrefillPagedPlan.from_csr(
        *(torch.tensor(GOOD[k]) for k in ("qo_indptr", "kv_indptr", "kv_indices", "last_page_len")),
        **HEADS,
        device=device,
    ),
    "batch": lambda device: pw.PrefillPagedPlan.batch(**GOOD_REQUESTS, **HEADS, device=device),
    "single": lambda device: pw.PrefillPagedPlan.single([5], 1, 0, 1, **HEADS, device=device),
    "preallocated": lambda device: pw.PrefillPagedPlan.preallocated(**CAPACITY, device=device),
    "preallocated, explicit tile": lambda device: pw.PrefillPagedPlan.preallocated(
        **CAPACITY, cta_tile_q=64, device=device
    ),
    "from_dict": lambda device: pw.PrefillPagedPlan.from_dict(good_dict(), device=device),
    "from_dict unfilled": lambda device: pw.PrefillPagedPlan.from_dict(
        {"capacity": CAPACITY, "cta_tile_q": 16}, device=device
    ),
}


@pytest.mark.parametrize("constructor", CONSTRUCTORS)
@pytest.mark.parametrize("device, fragment", BAD_DEVICES, ids=lambda v: repr(v) if not isinstance(v, str) else v)
def test_every_constructor_refuses_a_bad_device_first(constructor, device, fragment, monkeypatch):
    """A PagedWindowError naming the device (never a torch error, never blamed on a plan dict), before any device
    buffer is made; the value is not remembered as checked."""
    monkeypatch.setattr(plan_module, "_DeviceMirror", lambda *a: pytest.fail("made a device buffer"))
    for _ in range(2):
        with pytest.raises(pw.PagedWindowError) as err:
            CONSTRUCTORS[constructor](device)
        assert fragment in str(err.value) and "dict" not in str(err.value), str(err.value)
    if isinstance(device, (str, torch.device)):
        assert device not in plan_module._checked_devices


@pytest.mark.parametrize("device, fragment", BAD_DEVICES, ids=lambda v: repr(v) if not isinstance(v, str) else v)
def test_the_device_buffer_and_the_workspace_refuse_a_bad_device(device, fragment, monkeypatch):
    """``device_buffer`` / ``device_arrays`` / ``split_kv_workspace`` name a bad device as the constructors do
    (a tile-16 plan, which owns a workspace on a GPU), and make nothing."""
    monkeypatch.setattr(plan_module, "_DeviceMirror", lambda *a: pytest.fail("made a device buffer"))
    plan = from_csr()
    assert plan.cta_tile_q == 16
    for method in (plan.device_buffer, plan.device_arrays, plan.split_kv_workspace):
        with pytest.raises(pw.PagedWindowError) as err:
            method(device)
        assert fragment in str(err.value), str(err.value)
    with pytest.raises(pw.PagedWindowError, match="device_buffer: a device is required"):
        plan.device_buffer(None)
    assert torch.equal(plan.device_buffer("cpu"), plan.device_buffer(torch.device("cpu")))
    assert plan.split_kv_workspace("cpu") is None


@pytest.mark.parametrize("constructor", CONSTRUCTORS)
@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu"), "cpu:0"], ids=repr)
def test_every_constructor_takes_a_host_device(constructor, device):
    plan = CONSTRUCTORS[constructor](device)
    assert plan.device == (None if device is None else torch.device(device))
    assert plan == CONSTRUCTORS[constructor](None)


def test_a_checked_device_is_remembered_and_the_memory_is_bounded(monkeypatch):
    """A serving loop's repeated device costs one dict lookup: no parse, no CUDA query."""
    monkeypatch.setattr(plan_module, "_checked_devices", {})
    assert plan_module._checked_device(None) is None
    cpu = plan_module._checked_device("cpu")
    assert cpu == torch.device("cpu") and plan_module._checked_device(cpu) is cpu
    monkeypatch.setattr(plan_module, "_as_device", lambda device: pytest.fail(f"parsed {device!r} again"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: pytest.fail("asked CUDA again"))
    for _ in range(3):
        assert plan_module._checked_device("cpu") is cpu and plan_module._checked_device(cpu) is cpu
    monkeypatch.undo()
    monkeypatch.setattr(plan_module, "_checked_devices", {})
    for i in range(3 * plan_module._DEVICE_CACHE_LIMIT):
        assert plan_module._checked_device(f"cpu:{i}") == torch.device("cpu", i)
    assert len(plan_module._checked_devices) == plan_module._DEVICE_CACHE_LIMIT
