"""GPU tests of the plan-buffer pool (marker `cuda`): a new plan takes the device and pinned buffers of a freed
plan, and neither a launch still queued with the freed plan nor a plan on another stream sees the reuse."""

import gc

import pytest
import torch

import pagedwindow as pw
from pagedwindow import plan as plan_module
from pagedwindow.testing import random_batch

pytestmark = pytest.mark.cuda
D = 256
HEADS = dict(num_qo_heads=16, num_kv_heads=8)


def _case(seed, seq_lens, start_positions):
    gen = torch.Generator().manual_seed(seed)
    case = random_batch(
        gen,
        seq_lens=seq_lens,
        start_positions=start_positions,
        page_size=16,
        head_dim=D,
        dtype=torch.bfloat16,
        device="cuda",
        **HEADS,
    )
    case.append(backend="cuda")
    return case


def _csr_plan(case):
    p = case.plan
    return pw.PrefillPagedPlan.from_csr(
        p.qo_indptr, p.page_indptr, p.page_indices, p.last_page_len, head_dim=D, page_size=16, device="cuda", **HEADS
    )


def _attend(case, plan):
    out = torch.full((case.plan.total_tokens, 16, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    pw.batch_prefill_paged_window(
        case.q, case.pool, case.layout, case.layer, plan, sm_scale=0.0625, window_left=1023, out=out, backend="cuda"
    )
    return out


def _empty_pool():
    """An empty pool that stays empty: plans of earlier tests held in reference cycles are collected first (the
    test's own ``gc.collect()`` would otherwise pool their buffers, and a smaller one that fits would be taken)."""
    gc.collect()
    plan_module.release_pooled_plan_buffers()


def _storage_ptr(plan):
    return plan.device_buffer(torch.device("cuda", torch.cuda.current_device())).data_ptr()


def test_a_new_plan_takes_a_freed_plans_buffers_after_its_queued_launch():
    """Plan A's launch waits behind ~0.3 s of GPU work when A is freed and plan B takes A's buffers; B's upload is
    ordered after A's launch on the stream, so both outputs equal those of plans that never shared a buffer."""
    a, b = _case(1, [300, 1], [40, 900]), _case(2, [1, 200, 7], [500, 0, 33])
    expected_a, expected_b = _attend(a, _csr_plan(a)), _attend(b, _csr_plan(b))
    _empty_pool()
    plan_a = _csr_plan(a)
    storage = _storage_ptr(plan_a)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(5e8))
    out_a = _attend(a, plan_a)
    del plan_a
    gc.collect()
    plan_b = _csr_plan(b)
    assert _storage_ptr(plan_b) == storage, "the new plan did not take the freed plan's buffer"
    out_b = _attend(b, plan_b)
    torch.cuda.synchronize()
    assert torch.equal(out_a, expected_a)
    assert torch.equal(out_b, expected_b)


def test_a_plan_on_another_stream_does_not_take_a_freed_plans_buffers():
    """Pooled buffers are reused only on the stream they were made on (as torch's caching allocator does)."""
    a = _case(3, [64, 5], [0, 100])
    _empty_pool()
    plan_a = _csr_plan(a)
    storage = _storage_ptr(plan_a)
    del plan_a
    gc.collect()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        plan_side = _csr_plan(a)
        assert _storage_ptr(plan_side) != storage
        out = _attend(a, plan_side)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, _attend(a, _csr_plan(a)))
    gc.collect()
    assert _storage_ptr(_csr_plan(a)) == storage  # back on the stream it was made on
    plan_module.release_pooled_plan_buffers()
    assert not any(plan_module._MIRROR_POOL.free.values())
