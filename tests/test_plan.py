"""PrefillPagedPlan: every construction rule fails with a named value; invariants hold on random batches."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedwindow as pw
from pagedwindow.plan import SUPPORTED_CTA_TILE_Q, default_cta_tile_q

HEADS = dict(num_qo_heads=4, num_kv_heads=2, head_dim=8, page_size=4)
GOOD = dict(page_indices=[[3, 1], [0]], last_page_lens=[2, 3], start_positions=[2, 0], seq_lens=[4, 3])


def build(**overrides):
    args = {**GOOD, **HEADS, **overrides}
    return pw.PrefillPagedPlan.batch(args.pop("page_indices"), args.pop("last_page_lens"),
                                     args.pop("start_positions"), args.pop("seq_lens"), **args)


def test_good_plan_arrays():
    plan = build()
    assert plan.page_indices.tolist() == [3, 1, 0]
    assert plan.page_indptr.tolist() == [0, 2, 3]
    assert plan.last_page_len.tolist() == [2, 3]
    assert plan.qo_indptr.tolist() == [0, 4, 7]
    assert plan.cta_tile_q == 16  # 7 tokens * group 2 = 14 packed rows fit one 16-row tile
    assert plan.request_indices.tolist() == [0, 1] and plan.qo_tile_indices.tolist() == [0, 0]
    assert (plan.max_page_index, plan.max_last_page_len) == (3, 3)
    assert plan.page_indices.dtype == torch.int32


def test_default_tile_rule_over_whole_batch():
    assert default_cta_tile_q(8, 2) == 16 and default_cta_tile_q(9, 2) == 64
    small = build(page_indices=[[0]], last_page_lens=[3], start_positions=[0], seq_lens=[3])
    assert small.cta_tile_q == 16 and small.num_tiles == 1
    assert build(cta_tile_q=64).cta_tile_q == 64  # an override is recorded as laid out
    big = build(page_indices=[[3, 1, 2, 4, 5]], last_page_lens=[1], start_positions=[0], seq_lens=[17])
    assert big.cta_tile_q == 64 and big.num_tiles == 1
    assert build(page_indices=[[3, 1, 2, 4, 5]], last_page_lens=[1], start_positions=[0], seq_lens=[17],
                 cta_tile_q=16).qo_tile_indices.tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (dict(num_kv_heads=0), "num_kv_heads = 0"),
        (dict(num_qo_heads=0), "num_qo_heads = 0"),
        (dict(num_qo_heads=3), "num_qo_heads = 3 is not a multiple of num_kv_heads = 2"),
        (dict(num_kv_heads=2**31), "num_kv_heads = 2147483648 does not fit in int32"),
        (dict(head_dim=0), "head_dim = 0"),
        (dict(page_size=0), "page_size = 0"),
        (dict(page_size=True), "page_size must be an integer"),
        (dict(seq_lens=[]), "at least one request"),
        (dict(seq_lens=[4]), "page_indices has 2 entries but seq_lens has 1"),
        (dict(seq_lens=[-1, 3]), "seq_lens[0] = -1 is below its minimum 0"),
        (dict(seq_lens=[2**31, 3]), "seq_lens[0] = 2147483648 does not fit in int32"),
        (dict(start_positions=[2**31 - 2, 0]), "kv_len of request 0"),
        (dict(start_positions=[-1, 0]), "start_positions[0] = -1"),
        (dict(page_indices=[[3, -1], [0]]), "page_indices[0][1] = -1"),
        (dict(page_indices=[[3, 2**31], [0]]), "page_indices[0][1] = 2147483648 does not fit in int32"),
        (dict(page_indices=[[3, 3], [0]]), "page id 3 appears more than once in page_indices[0]"),
        (dict(page_indices=[[3], [0]]), "1 pages do not cover kv_len 6"),
        (dict(page_indices=[[3, 1, 2], [0]]), "3 pages do not cover kv_len 6"),
        (dict(page_indices=[[], [0]], last_page_lens=[0, 3], start_positions=[0, 0], seq_lens=[0, 3]),
         "page_indices[0] is empty"),
        (dict(page_indices=[[5], [0]], last_page_lens=[1, 3], start_positions=[0, 0], seq_lens=[0, 3]),
         "request 0 has kv_len 0"),
        (dict(last_page_lens=[3, 3]), "last_page_lens[0] = 3 disagrees with kv_len 6"),
        (dict(last_page_lens=[5, 3]), "last_page_lens[0] = 5"),
        (dict(cta_tile_q=32), "cta_tile_q = 32 is not a supported tile"),
        (dict(page_indices="ab"), "page_indices must be a sequence"),
        (dict(seq_lens=[4.0, 3]), "seq_lens[0] must be an integer"),
    ],
)
def test_bad_plan_inputs_fail_with_the_value(overrides, fragment):
    with pytest.raises(pw.PagedWindowError) as err:
        build(**overrides)
    assert fragment in str(err.value)


def test_heads_are_settled_before_anything_divides():
    # A zero kv-head count with otherwise broken inputs still reports the head relation first.
    with pytest.raises(pw.PagedWindowError, match="num_kv_heads = 0"):
        build(num_kv_heads=0, seq_lens=[1, 2, 3], page_indices=[[0, 0]])


def test_packed_rows_past_int32_fail():
    with pytest.raises(pw.PagedWindowError, match="packed rows"):
        pw.PrefillPagedPlan.single(list(range(1024)), 2**20, 0, 2**30, num_qo_heads=2, num_kv_heads=1,
                                   head_dim=8, page_size=2**20)


def test_tensor_inputs_accepted():
    plan = pw.PrefillPagedPlan.batch([torch.tensor([3, 1]), torch.tensor([0])], torch.tensor([2, 3]),
                                     torch.tensor([2, 0]), torch.tensor([4, 3]), **HEADS)
    assert plan == build()


def test_new_slot_collision_is_recorded_not_rejected_for_reads():
    # Requests may share pages (a read-only prefix); only the pool write refuses colliding new rows.
    shared = pw.PrefillPagedPlan.batch([[0, 1], [0, 2]], [1, 1], [4, 4], [1, 1], **HEADS)
    assert shared.new_slot_collision is None
    clash = pw.PrefillPagedPlan.batch([[0], [0]], [2, 2], [0, 0], [2, 2], **HEADS)
    assert "requests 0 and 1 both write page 0 slot 0" in clash.new_slot_collision


def test_preallocated_update_validates_then_commits():
    plan = pw.PrefillPagedPlan.preallocated(max_total_tokens=8, max_total_pages=4, max_batch=2, max_tiles=2)
    assert not plan.filled and "unfilled" in repr(plan)
    with pytest.raises(pw.PagedWindowError, match="never filled"):
        _ = plan.total_tokens
    plan.update(**GOOD, **HEADS)
    before = plan.to_dict()
    host_before = plan._host.clone()
    for bad in (dict(seq_lens=[4, 5], last_page_lens=[2, 1], page_indices=[[3, 1], [0, 2]]),  # 9 tokens > 8
                dict(page_indices=[[3, 1], [0]], last_page_lens=[2, 3], start_positions=[7, 0], seq_lens=[4, 3]),
                dict(num_kv_heads=0)):
        with pytest.raises(pw.PagedWindowError):
            plan.update(**{**GOOD, **HEADS, **bad})
        assert plan.to_dict() == before
        assert torch.equal(plan._host, host_before)
    with pytest.raises(pw.PagedWindowError, match="total_tokens = 9 exceeds the plan's capacity 8"):
        plan.update(**{**GOOD, **HEADS, "seq_lens": [4, 5], "last_page_lens": [2, 1],
                       "page_indices": [[3, 1], [0, 2]]})
    with pytest.raises(pw.PagedWindowError, match="num_tiles = 4 exceeds the plan's capacity 2"):
        plan.update([[0, 1]], [4], [0], [8], **{**HEADS, "num_qo_heads": 8, "num_kv_heads": 1, "cta_tile_q": 16})
    with pytest.raises(pw.PagedWindowError, match="batch_size = 3 exceeds the plan's capacity 2"):
        plan.update([[0], [1], [2]], [1, 1, 1], [0, 0, 0], [1, 1, 1], **HEADS)
    assert plan.to_dict() == before


@pytest.mark.parametrize("field", ["max_total_tokens", "max_total_pages", "max_batch", "max_tiles"])
def test_preallocated_capacity_checked(field):
    caps = dict(max_total_tokens=8, max_total_pages=4, max_batch=2, max_tiles=2)
    with pytest.raises(pw.PagedWindowError, match=f"{field} = 0"):
        pw.PrefillPagedPlan.preallocated(**{**caps, field: 0})
    with pytest.raises(pw.PagedWindowError, match=f"{field} = 2147483648 does not fit"):
        pw.PrefillPagedPlan.preallocated(**{**caps, field: 2**31})


def test_round_trip_and_repr():
    plan = build()
    data = json.loads(json.dumps(plan.to_dict()))
    again = pw.PrefillPagedPlan.from_dict(data)
    assert again == plan and repr(again) == repr(plan)
    assert "cta_tile_q=16" in repr(plan) and "max_page_index=3" in repr(plan)
    assert "page ids" in plan.describe()
    data["derived"]["max_page_index"] = 9
    with pytest.raises(pw.PagedWindowError, match="derived arrays disagree"):
        pw.PrefillPagedPlan.from_dict(data)
    empty = pw.PrefillPagedPlan.preallocated(max_total_tokens=8, max_total_pages=4, max_batch=2, max_tiles=2)
    assert not pw.PrefillPagedPlan.from_dict(empty.to_dict()).filled


def test_window_conversion_is_w_minus_one():
    assert pw.window_left_from_sliding_window(1024) == 1023
    assert pw.window_left_from_sliding_window(1) == 0
    assert pw.window_left_from_sliding_window(None) == -1
    for bad in (0, -3, 2**31, 1.5):
        with pytest.raises(pw.PagedWindowError, match="sliding_window"):
            pw.window_left_from_sliding_window(bad)


# -- property tests --------------------------------------------------------------------------------------------

@st.composite
def batches(draw):
    page_size = draw(st.sampled_from([1, 3, 16]))
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 4, 8, 16]))
    n = draw(st.integers(1, 5))
    seqs = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    starts = [draw(st.integers(0 if s else 1, 50)) for s in seqs]
    kv = [s + q for s, q in zip(starts, seqs)]
    need = [-(-x // page_size) for x in kv]
    ids = draw(st.permutations(range(sum(need) + 2)))
    pages, at = [], 0
    for k in need:
        pages.append(list(ids[at: at + k]))
        at += k
    lasts = [x - (k - 1) * page_size for x, k in zip(kv, need)]
    tile = draw(st.sampled_from([None, *SUPPORTED_CTA_TILE_Q]))
    return dict(page_indices=pages, last_page_lens=lasts, start_positions=starts, seq_lens=seqs,
                num_qo_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=8, page_size=page_size,
                cta_tile_q=tile)


@settings(max_examples=150, deadline=None)
@given(batches())
def test_plan_invariants(args):
    plan = pw.PrefillPagedPlan.batch(**args)
    group = plan.group_size
    qo, pi = plan.qo_indptr.tolist(), plan.page_indptr.tolist()
    assert qo[0] == 0 and pi[0] == 0
    assert all(a <= b for a, b in zip(qo, qo[1:])) and all(a < b for a, b in zip(pi, pi[1:]))
    assert plan.max_page_index == max(plan.page_indices.tolist())
    assert plan.max_last_page_len == max(plan.last_page_len.tolist())
    # tiles cover every packed row exactly once
    covered = {}
    for r, t in zip(plan.request_indices.tolist(), plan.qo_tile_indices.tolist()):
        rows = (qo[r + 1] - qo[r]) * group
        for p in range(t * plan.cta_tile_q, min((t + 1) * plan.cta_tile_q, rows)):
            covered[(r, p)] = covered.get((r, p), 0) + 1
    expected = {(r, p) for r in range(plan.batch_size) for p in range((qo[r + 1] - qo[r]) * group)}
    assert set(covered) == expected and all(c == 1 for c in covered.values())
    # update into a roomy preallocated plan is the same as a fresh build
    roomy = pw.PrefillPagedPlan.preallocated(max_total_tokens=400, max_total_pages=400, max_batch=8,
                                             max_tiles=800)
    roomy.update(**args)
    fresh = roomy.to_dict()
    fresh.pop("capacity")
    built = plan.to_dict()
    built.pop("capacity")
    assert fresh == built
    assert plan.device_arrays("cpu").scalars.tolist() == [plan.batch_size, plan.total_tokens, plan.num_tiles]
