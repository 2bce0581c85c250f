"""pagedwindow.measure and pagedwindow.viz: plan geometry against brute force, the explorer's gate, the weight probe
(including a backend that ignores the window, which it must catch), what ran, artifacts, benchmark results, and
every plot drawing."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import pagedwindow as pw
from pagedwindow import api, reference, testing
from pagedwindow.measure import bench_results, explorer, paged_replay, plan_geometry, prefill_detail, runtime
from pagedwindow.semantics import key_visible
from pagedwindow.viz import artifacts, bench_plots, figures, paths, plan_drawing, prefill_plots


def _plan(page_size=5, seq_lens=(37, 1, 20, 0), starts=(0, 24, 11, 9), hq=4, hkv=2, tile=None, seed=0):
    table = testing.random_pages(
        torch.Generator().manual_seed(seed), [s + n for s, n in zip(starts, seq_lens)], page_size, spare_pages=3
    )
    return pw.PrefillPagedPlan.batch(
        table.pages,
        table.last_page_lens,
        list(starts),
        list(seq_lens),
        num_qo_heads=hq,
        num_kv_heads=hkv,
        head_dim=16,
        page_size=page_size,
        cta_tile_q=tile,
    )


# -- plan geometry ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window_left", [-1, 0, 1, 13, 200])
@pytest.mark.parametrize("tile", [16, 64])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_tile_spans_match_brute_force(window_left, tile, group):
    plan = _plan(hq=2 * group, hkv=2, tile=tile)
    spans = plan_geometry.tile_spans(plan, window_left)
    assert len(spans) == plan.num_tiles
    covered = {r: [] for r in range(plan.batch_size)}
    for s in spans:
        start, seq = plan.start_positions[s.request], plan.seq_lens[s.request]
        rows = range(*s.packed_rows)
        assert 0 < len(rows) <= tile
        covered[s.request].extend(rows)
        tokens = {r // group for r in rows}
        assert (min(tokens), max(tokens) + 1) == s.tokens
        visible = {k for j in tokens for k in range(start + seq) if key_visible(start + j, k, window_left)}
        assert (min(visible), max(visible) + 1) == s.keys
        pages = {k // plan.page_size for k in visible}
        assert (min(pages), max(pages) + 1) == s.pages_read
        assert s.page_ids_read == tuple(plan.pages[s.request][p] for p in range(*s.pages_read))
        assert s.pages_skipped_left + s.num_pages_read + s.pages_skipped_right == len(plan.pages[s.request])
    for r, seq in enumerate(plan.seq_lens):
        assert sorted(covered[r]) == list(range(seq * group)), f"request {r}: tiles do not cover its packed rows"


def test_tile_spans_skip_pages_left_of_the_window():
    plan = _plan(page_size=4, seq_lens=(8,), starts=(40,), hq=2, hkv=2, tile=16)
    (span,) = plan_geometry.tile_spans(plan, window_left=3)
    assert span.keys == (37, 48) and span.pages_read == (9, 12)
    assert span.pages_skipped_left == 9 and span.pages_skipped_right == 0


@pytest.mark.parametrize("window_left", [-1, 0, 5])
def test_visibility_is_the_semantics(window_left):
    vis = plan_geometry.visibility(7, 9, window_left)
    assert vis.shape == (9, 16)
    for j in range(9):
        for k in range(16):
            assert bool(vis[j, k]) == key_visible(7 + j, k, window_left)


def test_per_tile_max_is_the_max_over_each_tiles_packed_rows():
    plan = _plan(hq=8, hkv=2, tile=16)
    values = torch.rand(plan.total_tokens, plan.num_qo_heads, generator=torch.Generator().manual_seed(1))
    spans = plan_geometry.tile_spans(plan, -1)
    got = plan_geometry.per_tile_max(values, plan, spans)
    qo = plan.qo_indptr.tolist()
    group = plan.group_size
    for s in spans:
        for h in range(plan.num_kv_heads):
            want = max(float(values[qo[s.request] + r // group, h * group + r % group]) for r in range(*s.packed_rows))
            assert float(got[s.tile, h]) == want


# -- explorer ----------------------------------------------------------------------------------------------------
CASE = dict(
    page_size=5,
    seq_lens=[37, 1, 20, 0],
    start_positions=[0, 24, 11, 9],
    num_qo_heads=4,
    num_kv_heads=2,
    head_dim=32,
    window_left=13,
    sm_scale=1.0,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_explorer_reference_passes_its_gate(dtype):
    case = explorer.build_case(**CASE, dtype=dtype, seed=3)
    result = explorer.run_case(case, backend="reference")
    assert result.backend == "reference"
    assert result.rows_written and result.spare_rows_untouched
    assert 0 < result.max_abs_err <= result.limit and result.passed and not result.failures()
    truth = testing.dense_attention(case, sm_scale=case.sm_scale, window_left=case.window_left)
    assert result.max_abs_err == pytest.approx(float((result.out.double() - truth).abs().max()))
    metrics = explorer.explorer_metrics(case, result, err_factor=2.0, err_slack=1e-3)
    assert metrics["passed"] and len(metrics["tiles"]) == case.plan.num_tiles
    json.dumps(artifacts.json_safe(metrics))


def test_explorer_gate_can_fail():
    case = explorer.build_case(**CASE, dtype=torch.bfloat16, seed=3)
    result = explorer.run_case(case, backend="reference", err_factor=0.0, err_slack=0.0)
    assert not result.passed
    assert "exceeds the limit" in result.failures()[0]


def test_explorer_surfaces_plan_errors():
    with pytest.raises(pw.PagedWindowError, match="kv_len 0"):
        explorer.build_case(**dict(CASE, seq_lens=[0], start_positions=[0]), seed=0)


# -- replay and the weight probe -----------------------------------------------------------------------------------
def _fake_call(length=40, hq=4, hkv=2, d=16, sliding_window=8, layer=0, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    return SimpleNamespace(
        layer_idx=layer,
        layer_type="sliding_attention" if sliding_window else "full_attention",
        q=rand(1, hq, length, d, std=d**-0.25),
        k=rand(1, hkv, length, d, std=d**-0.25),
        v=rand(1, hkv, length, d),
        scaling=1.0,
        sliding_window=sliding_window,
    )


@pytest.mark.parametrize("sliding_window", [8, None])
@pytest.mark.parametrize("chunks", [(40,), (23, 17)])
def test_replay_matches_dense_attention(sliding_window, chunks):
    calls = [_fake_call(sliding_window=sliding_window, layer=i, seed=i) for i in range(2)]
    (ours0, ours1) = paged_replay.replay_capture(
        SimpleNamespace(calls=calls), chunks=chunks, page_size=5, backend="reference", seed=1
    )
    for call, ours in zip(calls, (ours0, ours1)):
        want = testing.dense_attention_of_request(
            call.q[0].transpose(0, 1),
            call.k[0].transpose(0, 1),
            call.v[0].transpose(0, 1),
            sm_scale=1.0,
            window_left=pw.window_left_from_sliding_window(sliding_window),
        )
        assert (ours.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("sliding_window,passes", [(8, 1), (None, 3)])
def test_probe_reads_back_the_weights(sliding_window, passes):
    call = _fake_call(sliding_window=sliding_window, d=16)  # 40 keys, head_dim 16: full causal needs 3 passes
    probe = paged_replay.probe_weights(call, chunks=(23, 17), page_size=5, backend="reference")
    assert probe.passes == passes
    assert probe.span == (16 if sliding_window else 40)
    assert probe.max_err < 1e-6 and probe.weight_sum_err < 1e-5
    assert probe.weight_beyond_window == 0.0
    assert probe.distance_mean_weight[0] > 0 and probe.slot_max_err.shape == (5,)
    if sliding_window:
        assert float(probe.distance_mean_weight[sliding_window:].abs().max()) == 0.0


def test_probe_catches_a_backend_that_ignores_the_window(monkeypatch):
    honest = reference.batch_prefill_paged_window

    def leaky(*args, **kwargs):
        return honest(*args, **dict(kwargs, window_left=-1))

    monkeypatch.setattr(reference, "batch_prefill_paged_window", leaky)
    probe = paged_replay.probe_weights(_fake_call(sliding_window=8), chunks=(40,), page_size=5, backend="reference")
    assert probe.weight_beyond_window > 1e-3 and probe.max_err > 1e-3


# -- runtime and artifacts -----------------------------------------------------------------------------------------
def test_observe_backends_counts_and_unregisters():
    case = explorer.build_case(**CASE, dtype=torch.float32, seed=0)
    with runtime.observe_backends() as launches:
        assert len(api.prefill_observers) == 1
        explorer.run_case(case, backend="reference")
    assert launches["reference"] == 1 and runtime.backend_label(launches) == "reference"
    assert api.prefill_observers == []
    assert runtime.backend_label(type(launches)()) == "none"


def test_resolve_names():
    assert runtime.resolve_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(pw.PagedWindowError, match="float8"):
        runtime.resolve_dtype("float8")
    assert runtime.resolve_device("cpu").type == "cpu"
    assert runtime.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_paths_resolve_against_the_repository(tmp_path, monkeypatch):
    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    (repo / "benchmarks" / "results").mkdir(parents=True)
    elsewhere.mkdir()
    monkeypatch.setenv(paths.REPO_ENV, str(repo))
    monkeypatch.chdir(elsewhere)  # e.g. JupyterLab started in notebooks/
    assert paths.repository_root() == repo
    assert paths.output_dir("out/x") == repo / "out" / "x" and (repo / "out" / "x").is_dir()
    assert paths.output_dir(tmp_path / "abs") == tmp_path / "abs"
    assert paths.resolve_path("benchmarks/results") == repo / "benchmarks" / "results"
    assert paths.resolve_path("nowhere") is None
    monkeypatch.delenv(paths.REPO_ENV)
    assert paths.repository_root() == Path(__file__).resolve().parents[1]  # the checkout


def test_metrics_are_json_safe(tmp_path):
    path = artifacts.write_metrics(
        tmp_path,
        {
            "passed": False,
            "x": float("nan"),
            "y": float("-inf"),
            "t": torch.tensor([1.5, 2.0]),
            "d": torch.float32,
            "n": (1, 2),
        },
    )
    data = json.loads(path.read_text())
    assert data == {"passed": False, "x": "nan", "y": "-inf", "t": [1.5, 2.0], "d": "torch.float32", "n": [1, 2]}
    assert artifacts.read_metrics(tmp_path) == data
    with pytest.raises(ValueError, match="passed"):
        artifacts.write_metrics(tmp_path, {"passed": 1})


def test_csv_and_html_table(tmp_path):
    rows = [{"a": 1, "ok": True}, {"a": 2.5e-9, "b": "<x>", "ok": False}]
    text = artifacts.write_csv(tmp_path, "t.csv", rows).read_text().splitlines()
    assert text[0] == "a,ok,b" and len(text) == 3
    table = artifacts.html_table(rows, highlight="ok")
    assert "&lt;x&gt;" in table and table.count("background:#fdd") == 1 and "2.50e-09" in table


# -- benchmark results ---------------------------------------------------------------------------------------------
def _results(tmp_path, name="h200-2026-01-02.json", *, ours_err=1e-3, ours_ms=0.5):
    records = [
        {
            "system": "pagedwindow",
            "workload": "prefill_1x8192",
            "ms": ours_ms,
            "useful_tflops": 250.0,
            "max_abs_err": ours_err,
        },
        {
            "system": "flashinfer_fa2",
            "workload": "prefill_1x8192",
            "ms": 0.6,
            "useful_tflops": 215.0,
            "max_abs_err": 2e-3,
        },
        {
            "system": "flashinfer_fa3",
            "workload": "prefill_1x8192",
            "ms": None,
            "useful_tflops": None,
            "max_abs_err": None,
            "status": "missing: flashinfer",
        },
        {"system": "pagedwindow", "workload": "decode_64x4096", "ms": 0.2, "useful_tflops": 5.0, "max_abs_err": 0.0},
        {"system": "pagedwindow", "workload": "decode_64x4096", "metric": "allocations_per_10_calls", "value": 0},
    ]
    path = tmp_path / name
    path.write_text(json.dumps({"gpu": "NVIDIA H200", "peak_bf16_tflops": 750.0, "records": records}))
    return path


def test_bench_results_newest_load_and_summary(tmp_path):
    _results(tmp_path, "h200-2025-12-31.json")
    newest = _results(tmp_path, "h200-2026-01-02.json")
    (tmp_path / "notes.json").write_text("{}")
    assert bench_results.newest_results(tmp_path) == newest
    assert bench_results.newest_results(tmp_path / "absent") is None
    res = bench_results.load_results(newest)
    assert res.date == "2026-01-02" and res.workloads == ["prefill_1x8192", "decode_64x4096"]
    assert res.systems == ["pagedwindow", "flashinfer_fa2", "flashinfer_fa3"] and len(res.auxiliary) == 1
    rows = {(r["workload"], r["system"]): r for r in bench_results.summary_rows(res)}
    assert rows["prefill_1x8192", "flashinfer_fa2"]["pagedwindow_speedup"] == pytest.approx(1.2)
    assert rows["prefill_1x8192", "pagedwindow"]["pct_of_gemm"] == pytest.approx(100 * 250 / 750)
    assert rows["prefill_1x8192", "flashinfer_fa3"]["status"] == "missing: flashinfer"
    assert bench_results.bench_gate(res, max_err_limit=2e-2) == []


def test_bench_gate_fails_on_untimed_or_wrong_pagedwindow(tmp_path):
    res = bench_results.load_results(_results(tmp_path, ours_err=0.5))
    assert "exceeds" in bench_results.bench_gate(res, max_err_limit=2e-2)[0]
    res = bench_results.load_results(_results(tmp_path, ours_ms=None))
    assert "not timed" in bench_results.bench_gate(res, max_err_limit=2e-2)[0]


@pytest.mark.parametrize(
    "broken,field", [({"gpu": 1}, "gpu"), ({"peak_bf16_tflops": 0}, "peak_bf16_tflops"), ({"records": {}}, "records")]
)
def test_bench_results_schema_errors_name_the_field(tmp_path, broken, field):
    path = _results(tmp_path)
    data = dict(json.loads(path.read_text()), **broken)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=field):
        bench_results.load_results(path)


def test_bench_results_record_errors(tmp_path):
    path = _results(tmp_path)
    data = json.loads(path.read_text())
    data["records"][0]["ms"] = "fast"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"records\[0\]: ms"):
        bench_results.load_results(path)


# -- drawings ------------------------------------------------------------------------------------------------------
def test_backend_is_agg_outside_a_kernel():
    assert figures.ensure_backend().lower() == "agg"


def _saved(fig, tmp_path, name):
    path = figures.save_figure(fig, tmp_path, name)
    figures.plt.close(fig)
    assert path.stat().st_size > 1000
    return path


def test_plan_drawings(tmp_path):
    case = explorer.build_case(**CASE, dtype=torch.float32, seed=0)
    result = explorer.run_case(case, backend="reference")
    _saved(plan_drawing.draw_masks(case.plan, 13), tmp_path, "mask")
    _saved(plan_drawing.draw_tiles(case.plan, 13), tmp_path, "tiles")
    _saved(
        plan_drawing.draw_tile_errors(result.tile_err, result.spans, result.packed_err, limit=result.limit),
        tmp_path,
        "tile_errors",
    )
    big = _plan(page_size=16, seq_lens=(3000,), starts=(0,), hq=2, hkv=2)  # subsampled mask
    _saved(plan_drawing.draw_masks(big, 1023), tmp_path, "big_mask")


def test_prefill_plots(tmp_path):
    calls = [_fake_call(sliding_window=8, layer=0), _fake_call(sliding_window=None, layer=1, seed=1)]
    detail = prefill_detail.PrefillDetail(prompt_len=40, chunks=(23, 17), page_size=5)
    for call, ours in zip(
        calls,
        paged_replay.replay_capture(SimpleNamespace(calls=calls), chunks=(23, 17), page_size=5, backend="reference"),
    ):
        err = (ours.double() - ours.double().round(decimals=3)).abs()  # stand-in errors
        hist, zeros = prefill_detail._histogram(err)
        detail.layers.append(
            prefill_detail.LayerDetail(
                layer=call.layer_idx,
                layer_type=call.layer_type,
                window_left=pw.window_left_from_sliding_window(call.sliding_window),
                sm_scale=1.0,
                head_err=err.amax(dim=(0, 2)),
                head_floor=err.amax(dim=(0, 2)) / 2,
                row_err=err.amax(dim=(1, 2)),
                row_floor=err.amax(dim=(1, 2)) / 2,
                hist_err=hist,
                hist_floor=hist,
                zeros_err=zeros,
                zeros_floor=zeros,
                ref_max=1.0,
                probe=paged_replay.probe_weights(call, chunks=(23, 17), page_size=5, backend="reference"),
            )
        )
    assert sum(int(d.hist_err.sum()) + d.zeros_err for d in detail.layers) == 2 * 40 * 4 * 16
    _saved(prefill_plots.plot_error_vs_distance(detail), tmp_path, "distance")
    _saved(prefill_plots.plot_page_boundaries(detail, sliding_window=8), tmp_path, "pages")
    _saved(prefill_plots.plot_head_heatmap(detail), tmp_path, "heads")
    _saved(prefill_plots.plot_error_histogram(detail, limit=1e-3), tmp_path, "hist")


def test_bench_plots(tmp_path):
    res = bench_results.load_results(_results(tmp_path))
    _saved(bench_plots.plot_throughput(res), tmp_path, "throughput")
    _saved(bench_plots.plot_speedup(res), tmp_path, "speedup")
    _saved(bench_plots.plot_errors(res, max_err_limit=2e-2), tmp_path, "errors")


def test_bench_gate_trusts_the_runs_own_check_when_recorded(tmp_path):
    def one(record):
        path = tmp_path / "h200-2026-12-02.json"
        base = {"system": "pagedwindow", "workload": "chunk_2048_on_6144", "ms": 0.12, "useful_tflops": 283.0}
        path.write_text(json.dumps({"gpu": "NVIDIA H200", "peak_bf16_tflops": 800.0, "records": [{**base, **record}]}))
        return bench_results.bench_gate(bench_results.load_results(path), max_err_limit=2e-2)

    # one bf16 ulp at |out| ~ 4-8 passes the run's relative check although it is above the fallback limit
    assert one({"max_abs_err": 0.03125, "err_bound": 0.05, "status": "ok"}) == []
    assert "output check failed" in one({"max_abs_err": 0.03125, "err_bound": 0.02, "status": "ok"})[0]
    assert "output check failed" in one({"max_abs_err": 0.5, "status": "wrong output (max abs err 5e-01)"})[0]
    assert "not a finite number" in one({"max_abs_err": float("nan"), "status": "ok"})[0]


# -- what ran, and the plots' scales -------------------------------------------------------------------------------
def test_launch_record_and_environment_say_what_ran():
    case = explorer.build_case(**CASE, dtype=torch.float32, seed=0)
    before = runtime.launch_record()["launches"].get("reference", 0)
    with runtime.observe_backends() as outer:
        with runtime.observe_backends() as inner:
            explorer.run_case(case, backend="reference")  # observes once more inside
    assert outer["reference"] == inner["reference"] == 1
    assert runtime.launch_record()["launches"]["reference"] == before + 1  # nested blocks count a launch once
    record = runtime.launch_record(outer)
    assert record == {"backend": "reference", "launches": {"reference": 1}, "prefill_kernels": [], "kv_copy_paths": []}
    assert runtime.environment(torch.device("cpu"), outer)["kernels"] == record


def test_observe_backends_records_the_cuda_kernel_and_copy_path(monkeypatch):
    """Through the API's dispatch with a stand-in CUDA backend: each launch's backend, kernel and copy path."""
    from pagedwindow import cuda

    two, one = (
        explorer.build_case(**dict(CASE, num_kv_heads=hkv), dtype=torch.float32, backend="reference") for hkv in (2, 1)
    )
    seen = []
    fake = SimpleNamespace(batch_prefill_paged_window=lambda *a, **k: seen.append(a))
    monkeypatch.setattr(api, "_resolve_backend", lambda *args: "cuda")
    monkeypatch.setattr(api, "_cuda_backend", lambda: fake)
    monkeypatch.setattr(cuda, "prefill_kernel", lambda device: "wgmma")
    monkeypatch.setattr(cuda, "kv_copy_path", lambda pool, geometry, hkv: "tma" if hkv == 2 else "cp.async")

    def launch(case):
        pw.batch_prefill_paged_window(
            case.q, case.pool, case.layout, case.layer, case.plan, sm_scale=1.0, window_left=3, backend="cuda"
        )

    with runtime.observe_backends() as launches:
        launch(two)
        launch(two)
        launch(one)
    assert len(seen) == 3 and launches["cuda"] == 3
    assert runtime.launch_record(launches) == {
        "backend": "cuda",
        "launches": {"cuda": 3},
        "prefill_kernels": ["wgmma"],
        "kv_copy_paths": ["cp.async", "tma"],
    }
    monkeypatch.setattr(cuda, "kv_copy_path", lambda *a: 1 / 0)  # a failing query never breaks the launch
    with runtime.observe_backends() as launches:
        launch(two)
    assert len(seen) == 4 and launches.kv_copy_paths == {"unknown": 1}


def test_zero_floor_and_error_range():
    assert figures.zero_floor(torch.tensor([0.0, 3e-3, 1e-2])) == pytest.approx(1e-4)
    assert figures.zero_floor([0.0], torch.tensor([float("nan")]), default=1e-9) == 1e-9
    lo, hi = figures.error_log_range(torch.bfloat16)
    assert (lo, hi) == pytest.approx((math.log10(2**-7) - 3, math.log10(2**-7) + 1))


def test_head_heatmap_scale_is_absolute_not_stretched_by_one_ulp():
    ulp = 2**-8  # bf16 values in [0.5, 1): neighbouring heads one ulp apart
    layer = SimpleNamespace(
        layer=0,
        window_left=7,
        head_err=torch.tensor([2 * ulp, 3 * ulp, 2 * ulp, 2 * ulp]),
        head_floor=torch.tensor([2 * ulp, 2 * ulp, 0.0, 2 * ulp]),
    )
    detail = prefill_detail.PrefillDetail(prompt_len=8, chunks=(8,), page_size=4, layers=[layer], dtype=torch.bfloat16)
    fig = prefill_plots.plot_head_heatmap(detail)
    images = [ax.images[0] for ax in fig.axes if ax.images]
    lo, hi = figures.error_log_range(torch.bfloat16)
    assert all(im.get_clim() == pytest.approx((lo, hi)) for im in images)
    shown = images[0].get_array()
    assert float(shown.max() - shown.min()) < 0.05 * (hi - lo)  # one ulp is a small step of the scale
    assert float(images[1].get_array().min()) == pytest.approx(lo)  # an exact 0 sits at the bottom
    figures.plt.close(fig)


def test_tile_error_axis_is_not_stretched_by_an_exact_zero():
    case = explorer.build_case(**CASE, dtype=torch.bfloat16, seed=0)
    result = explorer.run_case(case, backend="reference")
    result.packed_err[0][0, 0] = 0.0
    fig = plan_drawing.draw_tile_errors(
        result.tile_err, result.spans, result.packed_err, limit=result.limit, dtype=torch.bfloat16
    )
    heat, rows = fig.axes[0], fig.axes[1]  # axes[2] is the colour bar
    assert heat.images[0].get_clim() == pytest.approx(figures.error_log_range(torch.bfloat16))
    smallest = min(float(e[e > 0].min()) for e in result.packed_err if (e > 0).any())
    assert rows.get_ylim()[0] > smallest / 1000 and "exact 0 drawn at" in rows.get_ylabel()  # not at 1e-12
    assert all(line.get_linestyle() == "None" for line in rows.lines if line.get_label().startswith("kv head"))
    figures.plt.close(fig)


def test_masks_are_a_grid():
    plan = _plan()  # 4 requests
    fig = plan_drawing.draw_masks(plan, 13, max_requests=4)
    panels = [ax for ax in fig.axes if ax.get_title() or not ax.axison]
    assert len(panels) == 4
    xs = sorted({round(ax.get_position().x0, 2) for ax in panels})
    ys = sorted({round(ax.get_position().y0, 2) for ax in panels})
    assert len(xs) == 2 and len(ys) == 2  # 2 × 2, not a 1 × 4 strip
    width, height = fig.get_size_inches()
    assert width / height < 1.5
    figures.plt.close(fig)


def _recorded_results(tmp_path):
    records = [
        {
            "system": s,
            "workload": w,
            "ms": ms,
            "useful_tflops": 1.0,
            "max_abs_err": err,
            "status": "ok",
            "err_bound": bound,
        }
        for w, bound in (("prefill_1x8192", 0.05), ("decode_64x4096", 0.04))
        for s, ms, err in (("pagedwindow", 0.3, 0.031), ("flashinfer_fa2", 0.5, 0.0), ("sdpa", 4.5, 0.015))
    ]
    records.append(
        {"system": "pagedwindow", "workload": "old_file", "ms": 0.2, "useful_tflops": 1.0, "max_abs_err": 0.01}
    )  # no status: the fallback limit applies
    records.append(
        {"system": "flashinfer_fa2", "workload": "old_file", "ms": 0.4, "useful_tflops": 1.0, "max_abs_err": 0.01}
    )
    path = tmp_path / "h200-2026-12-02.json"
    path.write_text(
        json.dumps(
            {
                "gpu": "NVIDIA H200",
                "peak_bf16_tflops": 800.0,
                "prefill_kernel": "pw_prefill_hd256_bf16_sm90",
                "records": records,
            }
        )
    )
    return bench_results.load_results(path)


def test_applied_bound_is_what_the_gate_applies(tmp_path):
    res = _recorded_results(tmp_path)
    bounds = [bench_results.applied_bound(res.record(w, "pagedwindow"), max_err_limit=0.02) for w in res.workloads]
    assert bounds == [0.05, 0.04, 0.02] and res.prefill_kernel == "pw_prefill_hd256_bf16_sm90"
    assert bench_results.bench_gate(res, max_err_limit=0.02) == []
    assert bench_results.bench_gate(res, max_err_limit=0.005) == [
        "old_file: pagedwindow max_abs_err 0.01 exceeds 0.005"
    ]
    summary = bench_results.gate_summary(res, [], max_err_limit=0.02)
    assert "3 of 3 workloads" in summary and "0.031 against its bound 0.04" in summary


def test_error_plot_draws_the_applied_bounds_and_points(tmp_path):
    res = _recorded_results(tmp_path)
    fig = bench_plots.plot_errors(res, max_err_limit=0.02)
    (ax,) = fig.axes
    segments = [seg for bars in ax.collections for seg in bars.get_segments()]  # each workload's bound
    assert sorted((round(float(seg[0][0] + seg[1][0]) / 2, 6), round(float(seg[0][1]), 6)) for seg in segments) == [
        (0.0, 0.05),
        (1.0, 0.04),
        (2.0, 0.02),
    ]
    systems = [line for line in ax.lines if line.get_label() in res.systems]
    assert len(systems) == 3 and all(line.get_linestyle() == "None" for line in systems)  # points, not lines
    assert ax.get_yscale() == "log" and ax.get_ylim()[0] > 1e-4  # the exact 0 does not stretch the axis
    assert "exact 0 drawn at 1e-03" in ax.get_ylabel()
    figures.plt.close(fig)


def test_speedup_axis_is_logarithmic_from_parity(tmp_path):
    res = _recorded_results(tmp_path)
    fig = bench_plots.plot_speedup(res)
    (ax,) = fig.axes
    assert ax.get_yscale() == "log"
    tops = sorted(round(p.get_y() + p.get_height(), 6) for p in ax.patches)
    assert all(p.get_y() == 1.0 for p in ax.patches) and tops[-1] == pytest.approx(15.0)
    figures.plt.close(fig)


def test_display_path_is_never_absolute(tmp_path, monkeypatch):
    root = paths.repository_root()
    assert paths.display_path(root / "benchmarks" / "results") == "benchmarks/results"
    assert paths.display_path("benchmarks/results") == "benchmarks/results"
    monkeypatch.chdir(tmp_path)
    assert paths.display_path(tmp_path / "a" / "b.json") == "a/b.json"
    assert paths.display_path(Path("/nonexistent-root/x/y.json")) == "y.json"
