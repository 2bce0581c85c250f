"""GPU suite for our kernels (marker `cuda`): the prefill kernel against float64 under flash-attn's tolerance rule,
NaN-poisoned outputs, the pool write bit-exact, CUDA-graph replay after plan.update(), torch.compile and opcheck."""

import pytest
import torch

import pagedwindow as pw
from pagedwindow import testing, tiles
from pagedwindow.cuda import ops
from pagedwindow.layout import checked_paged_geometry
from pagedwindow.plan import SPLIT_KV_UNITS_PER_SM
from pagedwindow.testing import dense_attention, error_bound, max_abs_err, random_batch, run_kernel_case

from .kernel_source import decode_constant
from .plan_buffers import live_entries

pytestmark = pytest.mark.cuda
D = 256


GEOMETRIES, WINDOWS, SM_SCALE = testing.KERNEL_GEOMETRIES, testing.KERNEL_WINDOWS, testing.KERNEL_SM_SCALE


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=testing.kernel_case_id)
@pytest.mark.parametrize("window_left", WINDOWS)
def test_prefill_kernel_against_float64(geometry, window_left):
    case, out, lse = run_kernel_case(
        geometry, window_left, seed=GEOMETRIES.index(geometry) * 100 + WINDOWS.index(window_left)
    )
    assert_kernel_case_right(case, out, lse, window_left)


def attend(case, window_left: int, *, backend: str, out=None, lse=None):
    """``batch_prefill_paged_window`` over a kernel case's batch at ``SM_SCALE``."""
    return pw.batch_prefill_paged_window(
        case.q,
        case.pool,
        case.layout,
        case.layer,
        case.plan,
        sm_scale=SM_SCALE,
        window_left=window_left,
        out=out,
        lse=lse,
        backend=backend,
    )


def assert_kernel_case_right(case, out, lse, window_left: int) -> None:
    """``run_kernel_case``'s out and lse: every live row within the fp64 error bound, the LSE the reference's,
    the spare rows past total_tokens untouched (still NaN)."""
    rows = case.plan.total_tokens
    exact = dense_attention(case, sm_scale=SM_SCALE, window_left=window_left)  # [rows, hq, d] fp64
    plain = dense_attention(case, sm_scale=SM_SCALE, window_left=window_left, dtype=torch.bfloat16)
    plain_err = max_abs_err(plain, exact)
    assert not torch.isnan(out[:rows]).any(), "a row that should have been written was not"
    assert torch.isnan(out[rows:]).all(), "rows past total_tokens were written"
    err = max_abs_err(out[:rows], exact)
    assert err <= error_bound(plain_err), f"max |kernel - fp64| {err:.3e} vs plain bf16 {plain_err:.3e}"
    ref_lse = torch.empty(rows, case.q.shape[1], dtype=torch.float32, device="cuda")
    attend(case, window_left, backend="reference", lse=ref_lse)
    torch.testing.assert_close(lse[:rows], ref_lse, rtol=1e-3, atol=1e-3)
    assert torch.isnan(lse[rows:]).all()


@pytest.mark.parametrize("page_size, bulk", [(1, 0), (5, 0), (8, 1), (16, 1), (32, 1), (48, 0), (64, 1), (128, 1)])
def test_sm90_kernel_copies_kv_tiles_in_bulk_where_the_page_size_allows(page_size, bulk):
    """The wgmma kernel's K/V copy: bulk tensor copies for page sizes 8, 16, 32 and multiples of 64, else cp.async
    (GEOMETRIES run both)."""
    layout = pw.PagedKvLayout(2, 8, D, page_size)
    pool = layout.allocate(3, device="cuda")
    geo = checked_paged_geometry("test", layout, pool, 1, D, 8)
    lib = ops.library(pool.device)
    mode = lib.pw_prefill_hd256_sm90_kv_copy_mode(
        pool.data_ptr(), geo.k_offset, geo.v_offset, geo.page_stride, page_size, 8
    )
    assert mode == bulk


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 5, 16, 64])
def test_pool_write_bit_exact(dtype, page_size):
    gen = torch.Generator().manual_seed(page_size)
    case = random_batch(
        gen,
        seq_lens=[77, 0, 5],
        start_positions=[3, 4, 200],
        page_size=page_size,
        num_qo_heads=16,
        num_kv_heads=8,
        head_dim=D,
        dtype=dtype,
        device="cuda",
    )
    expected = case.pool.clone()
    pw.append_paged_kv(case.k, case.v, expected, case.layout, case.layer, case.plan, backend="reference")
    pw.append_paged_kv(case.k, case.v, case.pool, case.layout, case.layer, case.plan, backend="cuda")
    assert torch.equal(case.pool, expected)


def test_auto_routes_bf16_to_the_kernel_and_matches_reference():
    case, out, _ = run_kernel_case(GEOMETRIES[0], 1023, seed=1)
    auto = pw.batch_prefill_paged_window(
        case.q, case.pool, case.layout, case.layer, case.plan, sm_scale=SM_SCALE, window_left=1023
    )
    assert torch.equal(auto, out[: case.plan.total_tokens])


def update_cases(gen, updates, *, page_size, num_qo_heads, num_kv_heads, num_pages) -> list:
    """``(name, random_batch)`` for each ``(name, seq_lens, start_positions)`` of ``updates``: bf16 on the GPU,
    one layer, ``num_pages`` pages (the pool a captured graph keeps)."""
    return [
        (
            name,
            random_batch(
                gen,
                seq_lens=seqs,
                start_positions=starts,
                page_size=page_size,
                num_qo_heads=num_qo_heads,
                num_kv_heads=num_kv_heads,
                head_dim=D,
                dtype=torch.bfloat16,
                device="cuda",
                num_pages=num_pages,
                num_layers=1,
                layer=0,
            ),
        )
        for name, seqs, starts in updates
    ]


def captured(step) -> torch.cuda.CUDAGraph:
    """``step`` run once on a side stream (the warm-up outside capture: builds the library and sets the kernels'
    shared-memory attributes), then captured into a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


# One graph, replayed after updates of every shape class: (seq_lens, start_positions) per update.
UPDATE_SEQUENCE = [
    ("decode", [1] * 8, [300, 1100, 17, 640, 5, 999, 64, 250]),
    ("chunk", [100], [1000]),
    ("long prefill", [500], [0]),
    ("ragged", [300, 1, 90], [700, 0, 5]),
    ("no new rows in some requests", [0, 5, 0], [50, 7, 3]),
    ("decode again", [1, 1], [4, 2000]),
    ("no new rows at all", [0, 0], [33, 16]),
    ("ragged again", [100, 37], [0, 250]),
]


@pytest.mark.parametrize(
    ("tile", "csr_device"), [(None, "cpu"), (16, "cpu"), (64, "cpu"), (128, "cpu"), (None, "cuda"), (16, "cuda")]
)
def test_cuda_graph_replay_across_every_update_equals_eager(tile, csr_device):
    """Capture append + prefill once on a preallocated plan (its tile fixed at creation: the policy's pick, or
    explicit); replay after each update of every shape class equals eager, pool included, and leaves rows past
    total_tokens untouched. The updates' CSR tensors on the host, or on the GPU (page ids checked there)."""
    hq, hkv, ps, cap_tokens, num_pages = 16, 8, 16, 512, 400
    plan = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=cap_tokens,
        max_total_pages=num_pages,
        max_batch=8,
        max_tiles=160,
        cta_tile_q=tile,
        device="cuda",
    )
    fixed = plan.cta_tile_q
    gen = torch.Generator().manual_seed((7 if tile is None else tile) + (csr_device == "cuda"))
    layout = pw.PagedKvLayout(1, hkv, D, ps)
    pool = layout.allocate(num_pages, torch.bfloat16, "cuda")
    q = torch.zeros(cap_tokens, hq, D, dtype=torch.bfloat16, device="cuda")
    k = torch.zeros(cap_tokens, hkv, D, dtype=torch.bfloat16, device="cuda")
    v = torch.zeros_like(k)
    out = torch.empty(cap_tokens, hq, D, dtype=torch.bfloat16, device="cuda")

    def step():
        pw.append_paged_kv(k, v, pool, layout, 0, plan, backend="cuda")
        pw.batch_prefill_paged_window(q, pool, layout, 0, plan, sm_scale=1.0, window_left=1023, out=out, backend="cuda")

    def load(case):
        """Copy a case into the captured buffers and re-plan in place from CSR tensors."""
        p = case.plan
        plan.update_csr(
            p.qo_indptr.to(csr_device),
            p.page_indptr.to(csr_device),
            p.page_indices.to(csr_device),
            p.last_page_len.to(csr_device),
            num_qo_heads=hq,
            num_kv_heads=hkv,
            head_dim=D,
            page_size=ps,
        )
        pool.copy_(case.pool)
        n = p.total_tokens
        q[:n], k[:n], v[:n] = case.q, case.k, case.v
        out.fill_(float("nan"))

    cases = update_cases(gen, UPDATE_SEQUENCE, page_size=ps, num_qo_heads=hq, num_kv_heads=hkv, num_pages=num_pages)
    load(cases[0][1])
    graph = captured(step)
    for name, case in cases:
        n = case.plan.total_tokens
        load(case)
        assert plan.cta_tile_q == fixed
        graph.replay()
        torch.cuda.synchronize()
        replayed, replayed_pool = out.clone(), pool.clone()
        load(case)
        step()
        torch.cuda.synchronize()
        assert torch.equal(replayed[:n], out[:n]), f"{name}: graph replay differs from eager for {plan!r}"
        assert not torch.isnan(out[:n]).any(), f"{name}: eager left rows unwritten"
        assert torch.equal(replayed_pool, pool), f"{name}: the replayed pool write differs from eager"
        assert torch.isnan(replayed[n:]).all(), f"{name}: graph replay wrote rows past total_tokens"
        exact = dense_attention(case, sm_scale=1.0, window_left=1023)
        if n:
            err = (out[:n].double() - exact).abs().max().item()
            assert err <= 0.05 * exact.abs().max().item(), f"{name}: eager is wrong ({err:.3e})"
    other = next(t for t in (16, 64, 128) if t != fixed)
    with pytest.raises(pw.PagedWindowError, match="fixed tile"):
        p = cases[1][1].plan
        plan.update_csr(
            p.qo_indptr,
            p.page_indptr,
            p.page_indices,
            p.last_page_len,
            num_qo_heads=hq,
            num_kv_heads=hkv,
            head_dim=D,
            page_size=ps,
            cta_tile_q=other,
        )


def _kernels_run(step) -> list[str]:
    """The names of the kernels one call of ``step`` launches (the profiler's CUDA events)."""
    step()  # built and warm
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_an_eager_decode_launch_runs_the_merge_grid_only_when_a_tile_can_need_it():
    """With a tile capacity that splits a tile more than 16 ways, an eager launch whose plan can give no tile more
    than 16 splits (one key) runs no merge grid, and one whose plan can (4 001 keys) does; both equal the
    reference."""
    hq, hkv, ps, num_pages = 8, 2, 16, 600
    plan = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=2, max_total_pages=num_pages, max_batch=2, max_tiles=2, device="cuda"
    )
    layout = pw.PagedKvLayout(1, hkv, D, ps)
    pool = layout.allocate(num_pages, torch.bfloat16, "cuda")
    gen = torch.Generator().manual_seed(5)
    cases = update_cases(
        gen, [("one key", [1], [0]), ("4 001 keys", [1], [4000])], page_size=ps, num_qo_heads=hq,
        num_kv_heads=hkv, num_pages=num_pages,
    )  # fmt: skip
    for (name, case), merge_grid in zip(cases, (False, True)):
        case.append(backend="reference")
        p = case.plan
        plan.update_csr(
            p.qo_indptr, p.page_indptr, p.page_indices, p.last_page_len,
            num_qo_heads=hq, num_kv_heads=hkv, head_dim=D, page_size=ps,
        )  # fmt: skip
        pool.copy_(case.pool)
        out = torch.empty(p.total_tokens, hq, D, dtype=torch.bfloat16, device="cuda")

        def step(case=case, out=out):
            pw.batch_prefill_paged_window(
                case.q, pool, layout, 0, plan, sm_scale=SM_SCALE, window_left=-1, out=out, backend="cuda"
            )

        names = _kernels_run(step)
        assert any("pw_decode_hd256_kernel" in n for n in names), f"{name}: {names}"
        assert any("pw_decode_merge_kernel" in n for n in names) == merge_grid, f"{name}: {names}"
        exact = dense_attention(case, sm_scale=SM_SCALE, window_left=-1)
        plain = dense_attention(case, sm_scale=SM_SCALE, window_left=-1, dtype=torch.bfloat16)
        assert max_abs_err(out, exact) <= error_bound(max_abs_err(plain, exact)), name


# Decode updates under one graph whose plan's tile capacity (2 tiles x 2 KV heads) splits a tile more ways than
# the decode grid merges itself, so that its launch runs the merge grid: (seq_lens, start_positions) per update.
MERGE_GRID_UPDATES = [
    ("one request on 4 001 keys", [1], [4000]),
    ("two requests", [1, 1], [3000, 50]),
    ("seven steps: merged in the decode grid", [1], [100]),
    ("one key", [1], [0]),
    ("no new rows", [0], [20]),
    ("two long requests", [1, 1], [4095, 2047]),
]


@pytest.mark.parametrize("window_left", [-1, 1023])
def test_cuda_graph_replay_with_the_merge_grid_equals_eager(window_left):
    """A preallocated decode plan of 2 tiles, so that each launch runs the split merge as a grid of its own after
    the decode grid (sm_90: by programmatic dependent launch): one captured graph, replayed after every update,
    equals eager bit for bit (rows and LSEs) and the fp64 answer, whether a tile's splits are merged after the grid
    or, few enough, inside it, and leaves the split counters zero."""
    hq, hkv, ps, num_pages = 8, 2, 16, 600  # 2 x 2 items: min(64, SMs) splits, > 16 from 17 SMs
    plan = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=2, max_total_pages=num_pages, max_batch=2, max_tiles=2, device="cuda"
    )
    assert plan.cta_tile_q == 16
    gen = torch.Generator().manual_seed(13 + window_left)
    layout = pw.PagedKvLayout(1, hkv, D, ps)
    pool = layout.allocate(num_pages, torch.bfloat16, "cuda")
    q = torch.zeros(2, hq, D, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(2, hq, D, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(2, hq, dtype=torch.float32, device="cuda")

    def step():
        pw.batch_prefill_paged_window(
            q, pool, layout, 0, plan, sm_scale=SM_SCALE, window_left=window_left, out=out, lse=lse, backend="cuda"
        )

    def load(case):
        p = case.plan
        plan.update_csr(
            p.qo_indptr, p.page_indptr, p.page_indices, p.last_page_len,
            num_qo_heads=hq, num_kv_heads=hkv, head_dim=D, page_size=ps,
        )  # fmt: skip
        pool.copy_(case.pool)  # the case's prefix and new rows (appended below, once per case)
        q[: p.total_tokens] = case.q
        out.fill_(float("nan"))
        lse.fill_(float("nan"))

    cases = update_cases(gen, MERGE_GRID_UPDATES, page_size=ps, num_qo_heads=hq, num_kv_heads=hkv, num_pages=num_pages)
    for _, case in cases:
        case.append(backend="reference")  # the new rows' K/V into the case's pool, which the LSE reference reads
    load(cases[0][1])
    _, counters = plan.split_kv_workspace(torch.device("cuda"))  # made with the first filled plan
    capacity_splits = min(tiles.SPLIT_KV_MAX_SPLITS, len(counters) // (2 * hkv))
    assert capacity_splits > decode_constant("kGridMergeMaxSplits"), "the launch would not run the merge grid"
    graph = captured(step)
    for name, case in cases:
        n = case.plan.total_tokens
        load(case)
        graph.replay()
        torch.cuda.synchronize()
        replayed, replayed_lse = out.clone(), lse.clone()
        load(case)
        step()
        torch.cuda.synchronize()
        assert torch.equal(replayed[:n], out[:n]), f"{name}: graph replay differs from eager"
        assert torch.equal(replayed_lse[:n], lse[:n]), f"{name}: the replayed LSEs differ from eager"
        assert torch.isnan(replayed[n:]).all(), f"{name}: graph replay wrote rows past total_tokens"
        assert torch.equal(counters, torch.zeros_like(counters)), f"{name}: a launch left a split counter set"
        if n:
            exact = dense_attention(case, sm_scale=SM_SCALE, window_left=window_left)
            plain = dense_attention(case, sm_scale=SM_SCALE, window_left=window_left, dtype=torch.bfloat16)
            assert max_abs_err(out[:n], exact) <= error_bound(max_abs_err(plain, exact)), f"{name}: eager is wrong"
            ref_lse = torch.empty(n, hq, dtype=torch.float32, device="cuda")
            attend(case, window_left, backend="reference", lse=ref_lse)
            torch.testing.assert_close(lse[:n], ref_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("passes", ["compiled", "numpy and torch copies"])
@pytest.mark.parametrize("max_tiles", [None, 64, 100_000], ids=["exact", "one-copy", "two-copies"])
def test_every_upload_shape_fills_the_live_entries(max_tiles, passes, monkeypatch):
    """An exact-size plan uploads its packed block; a preallocated one copies header, tiles and pages in one copy
    when the unused tile entries between them are few, else in two. After each of a sequence of updates the
    device buffer's live entries equal the plan's state (and the CPU buffer's). Both host paths: the compiled
    pass and upload (``kernels/plan_pack.cpp``), and numpy with torch copies."""
    from pagedwindow import cuda as cuda_backend
    from pagedwindow import plan as plan_module

    cuda_backend.require()  # the library (and its compiled pass) loaded
    if passes != "compiled":
        monkeypatch.setattr(plan_module, "_host_pass_library", lambda device: None)
        # The mirrors made here upload by torch copies for life: pooled, a later plan would take one and read its
        # page ids back to upload them. They go to a pool of their own, dropped with this test.
        monkeypatch.setattr(plan_module, "_MIRROR_POOL", plan_module._MirrorPool())
    kwargs = dict(num_qo_heads=16, num_kv_heads=8, head_dim=D, page_size=16)
    batches = [
        ([[3, 4]], [16], [17], [15]),
        ([[9], [1, 2, 5]], [4, 16], [0, 40], [4, 8]),
        ([[7, 8, 10]], [1], [0], [33]),
    ]
    if max_tiles is None:
        plans = [pw.PrefillPagedPlan.batch(*b, **kwargs, cta_tile_q=16, device="cuda") for b in batches]
    else:
        plan = pw.PrefillPagedPlan.preallocated(
            max_total_tokens=64, max_total_pages=32, max_batch=4, max_tiles=max_tiles, cta_tile_q=16, device="cuda"
        )
        plans = [plan] * len(batches)
    for plan, b in zip(plans, batches):
        if max_tiles is not None:
            plan.update(*b, **kwargs)
        got = live_entries(plan, plan.device_buffer("cuda"))
        assert got == live_entries(plan, plan.device_buffer("cpu"))
        assert got[6] == [x for pages in b[0] for x in pages] and got[0][0] == len(b[3])


def test_a_plan_made_before_any_launch_uploads_through_the_library(monkeypatch):
    """A mirror loads the kernels' library when it is made: a plan preallocated before anything in the process has
    loaded it uploads by the compiled call, and so does the plan that takes its mirror from the pool once it is
    freed; a plan from CUDA CSR tensors then keeps its page ids on the device."""
    import gc

    from pagedwindow import plan as plan_module
    from pagedwindow.cuda import host_pass

    monkeypatch.setattr(ops, "_by_device", {})  # no library loaded yet, as in a new process
    monkeypatch.setattr(plan_module, "_MIRROR_POOL", plan_module._MirrorPool())  # mirrors from this test only
    device = torch.device("cuda", torch.cuda.current_device())
    first = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=64, max_total_pages=32, max_batch=4, max_tiles=8, cta_tile_q=16, device="cuda"
    )
    mirror = first._mirrors[device]
    assert mirror.lib is not None and host_pass.loaded() is mirror.lib
    del first
    gc.collect()
    csr = [
        torch.tensor(x, dtype=torch.int32, device="cuda")
        for x in ([0, 3, 4], [0, 2, 5], [9, 1, 2, 5, 7], [4, 16])  # qo_indptr, page_indptr, page ids, last lens
    ]
    plan = pw.PrefillPagedPlan.from_csr(*csr, num_qo_heads=16, num_kv_heads=8, head_dim=D, page_size=16)
    assert plan._mirrors[device] is mirror, "the new plan did not take the pooled mirror"
    assert plan.state.device_pages is not None and not plan.state.device_pages.filled
    got = live_entries(plan, plan.device_buffer("cuda"))
    assert got[6] == [9, 1, 2, 5, 7]
    assert not plan.state.device_pages.filled, "the upload read the page ids back to the host"


def test_update_does_not_wait_for_the_gpu():
    """An update while a long kernel runs returns without synchronising (pinned staging, async copy), and the
    launch that follows on the stream reads the new plan."""
    case, _, _ = run_kernel_case(GEOMETRIES[1], 13, seed=11)
    plan = case.plan
    p = plan.to_dict()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(5e8))  # ~0.3 s of GPU work queued ahead
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    import time

    t0 = time.perf_counter()
    plan.update(
        p["page_indices"],
        p["last_page_lens"],
        p["start_positions"],
        p["seq_lens"],
        num_qo_heads=plan.num_qo_heads,
        num_kv_heads=plan.num_kv_heads,
        head_dim=D,
        page_size=plan.page_size,
    )
    host = time.perf_counter() - t0
    assert not start.query(), "the GPU finished its queued work before the update returned"
    assert host < 0.05, f"update took {host * 1e3:.1f} ms of host time while the GPU was busy"
    torch.cuda.synchronize()


@pytest.mark.parametrize("window_left", [-1, 1023])
def test_decode_kernel_splits_a_long_request_and_leaves_its_counters_zero(window_left):
    """One decode token on 70 000 keys (tile 16): the split-KV kernel spreads its keys over many units (their
    partial log-sum-exps land in the workspace, poisoned with NaN beforehand), merges them to the fp64 answer,
    leaves every counter zero for the next launch, and gives bit-identical rows when run again."""
    case, out, lse = run_kernel_case((16, [1], [70000], (16, 8), 16), window_left, seed=11)
    workspace, counters = case.plan.split_kv_workspace(torch.device("cuda"))
    units = len(counters)
    assert units == SPLIT_KV_UNITS_PER_SM * torch.cuda.get_device_properties(0).multi_processor_count
    assert len(workspace) == units * 16 * (D + 1)
    assert torch.equal(counters, torch.zeros_like(counters))
    exact = dense_attention(case, sm_scale=SM_SCALE, window_left=window_left)  # [1, 16, 256] fp64
    plain = dense_attention(case, sm_scale=SM_SCALE, window_left=window_left, dtype=torch.bfloat16)
    assert max_abs_err(out[:1], exact) <= error_bound(max_abs_err(plain, exact))

    workspace.fill_(float("nan"))
    again = torch.full_like(out, float("nan"))
    attend(case, window_left, backend="cuda", out=again)
    torch.cuda.synchronize()
    assert torch.equal(again[:1], out[:1]), "the split merge is not deterministic"
    assert torch.equal(counters, torch.zeros_like(counters)), "a launch left a split counter set"
    partial_lse = workspace[units * 16 * D :].view(16, units).t()  # [units, 16 rows]: row r = head r (group 2)
    written = (~torch.isnan(partial_lse[:, :2])).all(dim=1).sum().item()  # units whose 2 live rows were written
    # 8 KV heads' tiles; 64 splits at most per tile, and at most one per 2 steps of 16 keys
    steps = 4376 if window_left < 0 else 65  # keys [0, 70001), or [68976, 70001) in 16-key steps
    expect = 8 * min(64, units // 8, steps // 2)
    assert written == expect, f"{written} split units written, expected {expect}"


@pytest.mark.parametrize(
    "geometry",
    [
        # group 2: tiles of 16, 16 + 16, 16 + 14 and 6 packed rows, few enough that every tile's keys are split
        (16, [8, 16, 15, 3], [240, 4096, 1000, 70000], (16, 8), 16),
        # group 4: 20 packed rows (a tile of 16 and one of 4) and 8
        (32, [5, 2], [3000, 9], (16, 4), 16),
    ],
    ids=["group2", "group4"],
)
@pytest.mark.parametrize("window_left", [-1, 1023])
def test_decode_kernel_merges_the_splits_of_multi_row_tiles(geometry, window_left):
    """A few requests of several new tokens at tile 16: the split-KV kernel merges tiles of up to 16 rows (odd
    counts too, the merge's row groups padded) to the fp64 answer and the reference's LSE, bit-identically when
    run again over a workspace poisoned with NaN, and leaves every counter zero."""
    case, out, lse = run_kernel_case(geometry, window_left, seed=5)
    assert_kernel_case_right(case, out, lse, window_left)

    rows = case.plan.total_tokens
    workspace, counters = case.plan.split_kv_workspace(torch.device("cuda"))
    units = len(counters)
    workspace.fill_(float("nan"))
    again, again_lse = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    attend(case, window_left, backend="cuda", out=again, lse=again_lse)
    torch.cuda.synchronize()
    assert torch.equal(again[:rows], out[:rows]) and torch.equal(again_lse[:rows], lse[:rows])
    assert torch.equal(counters, torch.zeros_like(counters)), "a launch left a split counter set"
    partial_lse = workspace[units * 16 * D :].view(16, units).t()  # [units, 16 rows] (laid out row by row)
    written = (~torch.isnan(partial_lse)).any(dim=1).sum().item()
    assert written > case.plan.num_tiles * case.plan.num_kv_heads, "the tiles' keys were not split"


@pytest.mark.parametrize(
    "geometry", [GEOMETRIES[2], (16, [1] * 9, [0, 15, 16, 17, 100, 1023, 1024, 4095, 2500], (16, 8), 16)]
)
def test_torch_compile_fullgraph(geometry):
    case, out, _ = run_kernel_case(geometry, 1023, seed=3)
    got = torch.empty_like(out)

    def direct(q, pool, out):
        return pw.batch_prefill_paged_window(
            q, pool, case.layout, case.layer, case.plan, sm_scale=SM_SCALE, window_left=1023, out=out, backend="cuda"
        )

    compiled = torch.compile(direct, fullgraph=True)
    compiled(case.q, case.pool, got)
    torch.cuda.synchronize()
    n = case.plan.total_tokens
    assert torch.equal(got[:n], out[:n])


def test_opcheck_both_ops():
    case, out, lse = run_kernel_case(GEOMETRIES[0], 13, seed=4)
    plan = case.plan
    buffer = plan.device_buffer("cuda")
    geo = pw.checked_paged_geometry("t", case.layout, case.pool, case.layer, D, plan.num_kv_heads)
    offsets = list(plan.capacity.segment_offsets())
    torch.library.opcheck(
        torch.ops.pagedwindow.prefill_hd256.default,
        (
            case.q,
            case.pool,
            buffer,
            out,
            lse,
            None,  # no decode workspace: GEOMETRIES[0] is a 64-row plan
            None,
            geo.k_offset,
            geo.v_offset,
            geo.page_stride,
            geo.page_size,
            plan.num_qo_heads,
            plan.num_kv_heads,
            offsets,
            plan.capacity.max_tiles,
            plan.cta_tile_q,
            SM_SCALE,
            13,
        ),
    )
    torch.library.opcheck(
        torch.ops.pagedwindow.append_paged_kv.default,
        (
            case.k,
            case.v,
            case.pool,
            buffer,
            geo.k_offset,
            geo.v_offset,
            geo.page_stride,
            geo.page_size,
            plan.num_kv_heads,
            D,
            offsets,
            plan.capacity.max_batch,
            plan.capacity.max_total_tokens,
        ),
    )


def test_cuda_backend_refuses_what_the_kernel_cannot_do():
    gen = torch.Generator().manual_seed(9)
    case = random_batch(
        gen,
        seq_lens=[5],
        start_positions=[0],
        page_size=4,
        num_qo_heads=4,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.bfloat16,
        device="cuda",
    )
    out = torch.full_like(case.q, 3.0)
    with pytest.raises(pw.PagedWindowError, match="does not support head_dim 64"):
        pw.batch_prefill_paged_window(
            case.q, case.pool, case.layout, case.layer, case.plan, sm_scale=1.0, window_left=-1, out=out, backend="cuda"
        )
    assert (out == 3.0).all()
    auto = pw.batch_prefill_paged_window(
        case.q, case.pool, case.layout, case.layer, case.plan, sm_scale=1.0, window_left=-1
    )  # auto falls back to the reference for head_dim 64
    ref = pw.batch_prefill_paged_window(
        case.q, case.pool, case.layout, case.layer, case.plan, sm_scale=1.0, window_left=-1, backend="reference"
    )
    assert torch.equal(auto, ref)
    q32 = case.q.float()
    with pytest.raises(pw.PagedWindowError, match="does not support dtype torch.float32"):
        pw.batch_prefill_paged_window(
            q32, case.pool.float(), case.layout, case.layer, case.plan, sm_scale=1.0, window_left=-1, backend="cuda"
        )


def test_cuda_backend_refuses_misaligned_tensors():
    case, _, _ = run_kernel_case(GEOMETRIES[1], 13, seed=5)
    n, h = case.q.shape[0], case.q.shape[1]
    flat = torch.empty(n * h * D + 8, dtype=torch.bfloat16, device="cuda")
    q = flat[1 : 1 + n * h * D].view(n, h, D)  # contiguous, 2 bytes off 16-byte alignment
    q.copy_(case.q)
    out = torch.full_like(case.q, 3.0)
    with pytest.raises(pw.PagedWindowError, match="not 16-byte aligned"):
        pw.batch_prefill_paged_window(
            q, case.pool, case.layout, case.layer, case.plan, sm_scale=1.0, window_left=-1, out=out, backend="cuda"
        )
    assert (out == 3.0).all()


@pytest.mark.parametrize(
    "dtypes", [("int32",) * 4, ("int64",) * 4, ("int32", "int64", "int32", "int64")], ids=["int32", "int64", "mixed"]
)
def test_csr_on_the_gpu_plans_like_csr_on_the_host(dtypes):
    """CUDA CSR tensors (read to the host in one copy when they share a dtype) give the plan host tensors give,
    and a bad value in them is refused with the same error."""
    qo, kv, ids, last = [0, 4, 7], [0, 2, 3], [3, 1, 0], [2, 3]
    kwargs = dict(num_qo_heads=4, num_kv_heads=2, head_dim=D, page_size=4)
    on_gpu = [torch.tensor(v, dtype=getattr(torch, d), device="cuda") for v, d in zip((qo, kv, ids, last), dtypes)]
    host = pw.PrefillPagedPlan.from_csr(qo, kv, ids, last, **kwargs, device="cuda")
    gpu = pw.PrefillPagedPlan.from_csr(*on_gpu, **kwargs)
    assert gpu.device == torch.device("cuda", torch.cuda.current_device()) and gpu.to_dict() == host.to_dict()
    assert torch.equal(gpu.device_buffer("cuda"), host.device_buffer("cuda"))
    on_gpu[2][1] = 3  # page 3 twice in request 0
    with pytest.raises(pw.PagedWindowError, match="page id 3 appears more than once in request 0"):
        pw.PrefillPagedPlan.from_csr(*on_gpu, **kwargs)
