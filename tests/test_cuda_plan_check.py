"""GPU tests of plans from CSR tensors on the GPU (marker `cuda`): the page ids are checked there
(``pw_plan_check_pages``, kernels/plan_check.cu) and the plan equals the one the host's pass builds from the same
arrays on the CPU; every bad input fails with the host pass's error and changes nothing; findings the device
pass cannot rule on (shared pages, sparse ids) go to the host pass."""

import numpy as np
import pytest
import torch

import pagedwindow as pw
from pagedwindow import plan as plan_module
from pagedwindow.cuda import host_pass

from .plan_buffers import live_entries

pytestmark = pytest.mark.cuda
KW = dict(num_qo_heads=16, num_kv_heads=8, head_dim=256)
INT32_MAX = 2**31 - 1


def _csr(rng, batch, page_size, *, max_new=40, max_cached=300, spare=7):
    """A random batch's CSR arrays (numpy int64): distinct page ids drawn from a shuffled pool."""
    seq = rng.integers(0, max_new + 1, batch)
    kv_len = seq + rng.integers(0, max_cached + 1, batch)
    kv_len = np.maximum(kv_len, 1)
    pages = -(-kv_len // page_size)
    ids = rng.permutation(int(pages.sum()) + spare)[: int(pages.sum())]
    qo = np.concatenate([[0], np.cumsum(seq)])
    kv = np.concatenate([[0], np.cumsum(pages)])
    last = kv_len - (pages - 1) * page_size
    return qo, kv, ids, last


def _tensors(arrays, device, dtypes=(torch.int32,) * 4):
    return tuple(torch.as_tensor(np.asarray(a), dtype=d, device=device) for a, d in zip(arrays, dtypes))


def _error(fn) -> str:
    with pytest.raises(pw.PagedWindowError) as info:
        fn()
    return str(info.value)


DTYPES = [
    (torch.int32,) * 4,
    (torch.int64,) * 4,
    (torch.int64, torch.int32, torch.int64, torch.int32),
    (torch.int32, torch.int64, torch.int32, torch.int64),
]


@pytest.mark.parametrize("dtypes", DTYPES, ids=["int32", "int64", "mixed-a", "mixed-b"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_a_plan_from_gpu_csr_equals_the_plan_from_the_same_csr_on_the_host(dtypes, page_size):
    """For random batches: the same state, tile, bounds and device buffer as from the CPU arrays; the page ids
    stay on the device until the host asks for them; the caller's arrays may change afterwards."""
    rng = np.random.default_rng(page_size)
    for batch in (1, 3, 64, 300):
        arrays = _csr(rng, batch, page_size)
        host = pw.PrefillPagedPlan.from_csr(*_tensors(arrays, "cpu", dtypes), **KW, page_size=page_size, device="cuda")
        given = _tensors(arrays, "cuda", dtypes)
        plan = pw.PrefillPagedPlan.from_csr(*given, **KW, page_size=page_size)
        assert plan.state.device_pages is not None, "the device pass did not run"
        assert live_entries(plan) == live_entries(host)
        assert not plan.state.device_pages.filled, "the upload read the page ids back to the host"
        given[2].fill_(-5)  # the plan holds its own copy
        assert plan.to_dict() == host.to_dict()
        assert plan.state.device_pages.filled
        assert (plan.cta_tile_q, plan.tile_reason, plan.max_page_index) == (
            host.cta_tile_q,
            host.tile_reason,
            host.max_page_index,
        )
        assert torch.equal(plan.page_indices, host.page_indices)


def _bad_batches():
    """(name, qo_indptr, kv_indptr, kv_indices, last_page_len) each breaking one rule (page size 16)."""
    good = ([0, 3, 4], [0, 2, 3], [5, 9, 2], [16, 1])
    yield "negative id", good[0], good[1], [5, -1, 2], good[3]
    yield "id past int32", good[0], good[1], [5, INT32_MAX + 1, 2], good[3]
    yield "repeat in a request", good[0], good[1], [5, 5, 2], good[3]
    yield "pages past kv_indices", good[0], [0, 2, 4], [5, 9, 2], good[3]
    yield "no page ids at all", good[0], good[1], [], good[3]
    yield "kv_indptr not from 0", good[0], [1, 2, 3], [5, 9, 2, 4], good[3]
    yield "falling kv_indptr", good[0], [0, 3, 2], [5, 9, 2], good[3]
    yield "last page too full", good[0], good[1], good[2], [17, 1]
    yield "empty last page", good[0], good[1], good[2], [16, 0]
    yield "more rows than keys", [0, 3, 6], good[1], good[2], good[3]
    yield "qo_indptr too short", [0, 3], good[1], good[2], good[3]
    yield "new rows into a shared prefix", [0, 1, 2], [0, 2, 4], [5, 9, 9, 2], [1, 1]


BAD_CASES = [
    pytest.param(case, dtype, id=f"{case[0]}-{str(dtype).removeprefix('torch.')}")
    for case in _bad_batches()
    for dtype in (torch.int32, torch.int64)
    if not (dtype == torch.int32 and case[0] == "id past int32")  # not representable in int32
]


@pytest.mark.parametrize(("case", "dtype"), BAD_CASES)
def test_every_bad_gpu_csr_fails_as_on_the_host_and_changes_nothing(case, dtype):
    """from_csr and update_csr of a bad batch on the GPU raise the host pass's error (same message) and leave a
    preallocated plan exactly as it was: state, version and device buffer."""
    name, *arrays = case
    kwargs = dict(**KW, page_size=16)
    expected = _error(lambda: pw.PrefillPagedPlan.from_csr(*_tensors(arrays, "cpu", (dtype,) * 4), **kwargs))
    cuda = _tensors(arrays, "cuda", (dtype,) * 4)
    assert _error(lambda: pw.PrefillPagedPlan.from_csr(*cuda, **kwargs)) == expected
    plan = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=64, max_total_pages=32, max_batch=4, max_tiles=64, device="cuda"
    )
    plan.update_csr(*_tensors(([0, 2], [0, 1], [7], [2]), "cuda"), **kwargs)
    before, version, buffer = plan.to_dict(), plan.version, live_entries(plan)
    assert _error(lambda: plan.update_csr(*cuda, **kwargs)) == expected
    assert (plan.to_dict(), plan.version, live_entries(plan)) == (before, version, buffer)


def test_more_pages_than_a_preallocated_plan_holds_fail_and_change_nothing():
    kwargs = dict(**KW, page_size=16)
    plan = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=64, max_total_pages=3, max_batch=4, max_tiles=64, device="cuda"
    )
    plan.update_csr(*_tensors(([0, 2], [0, 1], [7], [2]), "cuda"), **kwargs)
    before = (plan.to_dict(), live_entries(plan))
    with pytest.raises(pw.PagedWindowError, match="total_pages"):
        plan.update_csr(*_tensors(([0, 1, 2], [0, 2, 4], [1, 2, 3, 4], [16, 16]), "cuda"), **kwargs)
    assert (plan.to_dict(), live_entries(plan)) == before


def test_read_only_prefix_pages_shared_between_requests_are_ruled_on_by_the_host_pass():
    """Two requests reading one cached page (legal): the device pass reports the repeat, the host pass accepts
    the batch, and the plan equals the CPU one."""
    arrays = ([0, 1, 2], [0, 2, 4], [5, 9, 5, 3], [1, 1])  # page 5 is both requests' first (full) page
    kwargs = dict(**KW, page_size=16)
    host = pw.PrefillPagedPlan.from_csr(*_tensors(arrays, "cpu"), **kwargs, device="cuda")
    plan = pw.PrefillPagedPlan.from_csr(*_tensors(arrays, "cuda"), **kwargs)
    assert plan.state.device_pages is None  # built by the host pass
    assert plan.to_dict() == host.to_dict() and live_entries(plan) == live_entries(host)


def test_the_stamp_table_grows_for_large_ids_and_sparse_ids_go_to_the_host_pass():
    check = host_pass.device_check(torch.device("cuda", torch.cuda.current_device()))
    assert check is not None
    kwargs = dict(**KW, page_size=16)
    for ids in ([3, 200_000], [1, 3_000_000_000 % INT32_MAX]):
        arrays = ([0, 1, 2], [0, 1, 2], ids, [4, 4])
        host = pw.PrefillPagedPlan.from_csr(*_tensors(arrays, "cpu", (torch.int64,) * 4), **kwargs, device="cuda")
        plan = pw.PrefillPagedPlan.from_csr(*_tensors(arrays, "cuda", (torch.int64,) * 4), **kwargs)
        assert plan.to_dict() == host.to_dict() and live_entries(plan) == live_entries(host)
        assert plan.max_page_index == max(ids)
        if max(ids) < check.MAX_TABLE:
            assert plan.state.device_pages is not None and len(check.stamps) > max(ids)
        else:
            assert plan.state.device_pages is None  # past the table's bound: the host pass (it sorts)


def test_repeats_are_found_across_the_generation_wrap():
    """Stamps left by earlier passes never read as repeats, also when the generation wraps and the table is
    cleared; a repeat inside one pass is always found."""
    check = host_pass.device_check(torch.device("cuda", torch.cuda.current_device()))
    kwargs = dict(**KW, page_size=16)
    good = _tensors(([0, 1, 2], [0, 2, 3], [4, 8, 6], [16, 3]), "cuda")
    bad = _tensors(([0, 1, 2], [0, 2, 3], [4, 4, 8], [16, 3]), "cuda")  # page 4 twice in request 0
    check.generation = 0xFFFFFFFF - 2
    for _ in range(5):
        assert pw.PrefillPagedPlan.from_csr(*good, **kwargs).state.device_pages is not None
        with pytest.raises(pw.PagedWindowError, match="page id"):
            pw.PrefillPagedPlan.from_csr(*bad, **kwargs)
    assert 0 < check.generation < 10


def test_a_gpu_csr_plan_attends_like_the_host_plan():
    """The launch reads the ids the device pass copied: same output as the plan from host arrays."""
    from pagedwindow.testing import random_batch

    case = random_batch(
        torch.Generator().manual_seed(3),
        seq_lens=[5, 1, 40],
        start_positions=[100, 700, 0],
        page_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        head_dim=256,
        num_qo_heads=16,
        num_kv_heads=8,
    )
    case.append(backend="cuda")
    p = case.plan
    arrays = (p.qo_indptr, p.page_indptr, p.page_indices, p.last_page_len)
    outs = []
    for plan in (
        pw.PrefillPagedPlan.from_csr(*arrays, **KW, page_size=16, device="cuda"),
        pw.PrefillPagedPlan.from_csr(*(a.cuda() for a in arrays), **KW, page_size=16),
    ):
        outs.append(
            pw.batch_prefill_paged_window(
                case.q, case.pool, case.layout, case.layer, plan, sm_scale=0.0625, window_left=1023, backend="cuda"
            )
        )
    assert torch.equal(outs[0], outs[1])
    assert outs[1].isfinite().all()


def test_the_device_pass_is_used_only_for_contiguous_gpu_tensors_on_the_plans_device():
    kwargs = dict(**KW, page_size=16)
    arrays = ([0, 1, 2], [0, 2, 3], [4, 8, 6], [16, 3])
    strided = torch.tensor([4, 0, 8, 0, 6, 0], dtype=torch.int32, device="cuda")[::2]
    given = list(_tensors(arrays, "cuda"))
    given[2] = strided
    plan = pw.PrefillPagedPlan.from_csr(*given, **kwargs)
    assert plan.state.device_pages is None and plan.page_indices.tolist() == [4, 8, 6]
    on_cpu_plan = pw.PrefillPagedPlan.from_csr(*_tensors(arrays, "cuda"), **kwargs, device="cpu")
    assert on_cpu_plan.state.device_pages is None and on_cpu_plan.page_indices.tolist() == [4, 8, 6]
    heads = plan_module._Heads.checked(16, 8, 256, 16)
    assert plan_module._state_from_device_csr(tuple(given), heads, None, None, None) is None


def test_planning_from_gpu_csr_while_capturing_a_graph_is_refused_and_the_capture_survives():
    """The device pass must synchronise, which a capturing stream forbids: a clear error before anything is
    enqueued, and the capture goes on."""
    kwargs = dict(**KW, page_size=16)
    given = _tensors(([0, 1, 2], [0, 2, 3], [4, 8, 6], [16, 3]), "cuda")
    x = torch.zeros(4, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with pytest.raises(pw.PagedWindowError, match="captures a CUDA graph"):
            pw.PrefillPagedPlan.from_csr(*given, **kwargs)
        x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [1.0] * 4
