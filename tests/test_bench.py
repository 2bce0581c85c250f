"""The benchmark's counting and reporting (CPU); the timing itself runs on a GPU (`pagedwindow bench`)."""

import json
import time

import pytest
import torch

import pagedwindow as pw
from pagedwindow import bench, bench_sweep
from pagedwindow.measure import bench_results

HAS_FROM_CSR = hasattr(pw.PrefillPagedPlan, "from_csr")
needs_from_csr = pytest.mark.skipif(not HAS_FROM_CSR, reason="PrefillPagedPlan.from_csr has not landed yet")


def dense_visible_pairs(w: bench.Workload) -> int:
    """Visible pairs from a dense mask per distinct (start, seq) request, times how often it occurs."""
    total = 0
    for start, seq in set(zip(w.start_positions, w.seq_lens)):
        q = torch.arange(start, start + seq)[:, None]  # [seq, 1]
        k = torch.arange(start + seq)[None, :]  # [1, kv_len]
        mask = k <= q
        if w.window_left >= 0:
            mask &= q - k <= w.window_left
        total += int(mask.sum()) * list(zip(w.start_positions, w.seq_lens)).count((start, seq))
    return total


# -- counting ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, pairs",
    [
        ("prefill_1x8192", 7_864_832),
        ("prefill_8x2048", 12_587_008),
        ("chunk_2048_on_6144", 2_097_152),
        ("decode_64x4096", 65_536),
        ("decode_256x2000_p32", 256 * 1024),
        ("prompts_32x128", 32 * 128 * 129 // 2),
        ("chunk_512_on_30000", 512 * 1024),
    ],
)
def test_visible_pairs_of_the_workloads(name, pairs):
    w = bench.WORKLOADS[name]
    assert w.visible_pairs() == pairs
    assert w.useful_flops() == 4 * 256 * 16 * pairs


@pytest.mark.parametrize(
    "name", ["decode_256x2000_p32", "prompts_32x128", "chunk_512_on_30000", "chunk_2048_on_6144", "decode_64x4096"]
)
def test_visible_pairs_of_the_workloads_match_a_dense_mask(name):
    assert bench.WORKLOADS[name].visible_pairs() == dense_visible_pairs(bench.WORKLOADS[name])


@pytest.mark.parametrize("window_left", [-1, 0, 1, 2, 7, 40])
def test_visible_pairs_match_a_dense_mask(window_left):
    gen = torch.Generator().manual_seed(window_left + 1)
    seqs = torch.randint(0, 30, (6,), generator=gen).tolist()
    starts = torch.randint(0, 50, (6,), generator=gen).tolist()
    w = bench.Workload("t", tuple(seqs) + (7, 5), tuple(starts) + (3, 0), window_left=window_left)
    assert w.visible_pairs() == dense_visible_pairs(w)


def test_the_serving_workloads_shapes():
    decode = bench.WORKLOADS["decode_256x2000_p32"]
    assert decode.page_size == 32 and decode.kv_lens == (2000,) * 256 and decode.seq_lens == (1,) * 256
    assert bench.WORKLOADS["prompts_32x128"].kv_lens == (128,) * 32
    assert bench.WORKLOADS["chunk_512_on_30000"].kv_lens == (30512,)
    assert {w.page_size for n, w in bench.WORKLOADS.items() if n != "decode_256x2000_p32"} == {16}


def test_the_decode_sweep_covers_batch_length_and_window_within_its_memory_bound():
    points = bench.sweep_workloads(bench_sweep.sweep_slices(decode_only=True))
    assert len({w.name for w in points}) == len(points)
    for w in points:
        assert set(w.seq_lens) == {1} and len(set(w.kv_lens)) == 1
        assert len(w.seq_lens) * w.kv_lens[0] <= bench_sweep.MAX_SWEEP_KEYS
    grid = {(len(w.seq_lens), w.kv_lens[0], w.window_left) for w in points}
    assert {b for b, _, _ in grid} == {1, 16, 64, 256, 512} and {w for _, _, w in grid} == {1023, -1}
    assert {kv for _, kv, _ in grid} == {1, 1024, 4096, 32768, 131072}
    assert (1, 131072, -1) in grid and (512, 4096, 1023) in grid and (512, 32768, -1) not in grid
    assert "decode_b64_kv4096_w1023" in {w.name for w in points}  # the names results since 2026-12-04 carry


def test_the_sweep_spans_every_axis_the_bench_promises():
    points = bench.sweep_workloads(bench_sweep.sweep_slices())
    names = [w.name for w in points]
    assert len(set(names)) == len(names) and set(
        bench.sweep_workloads(bench_sweep.sweep_slices(decode_only=True))
    ) <= set(points)
    assert {len(w.seq_lens) for w in points} >= {1, 4, 16, 64, 256, 512}
    assert {w.seq_lens[0] for w in points} >= {1, 16, 128, 1024, 4096, 32768}
    assert {w.start_positions[0] for w in points} >= {0, 1024, 8192, 32768, 131072}
    assert {w.page_size for w in points} == {1, 16, 32, 64, 128}
    assert {w.window_left for w in points} == {0, 255, 1023, -1}
    for w in points:  # every point within the memory bounds, identical requests
        assert len(set(w.seq_lens)) == 1 and len(set(w.start_positions)) == 1
        assert sum(w.seq_lens) <= bench_sweep.MAX_SWEEP_TOKENS and sum(w.kv_lens) <= bench_sweep.MAX_SWEEP_KEYS
    page = next(s for s in bench_sweep.sweep_slices() if s.name == "page_x_shape")
    assert {(p.x, p.y) for p in page.points} == {
        (ps, shape) for ps in (1, 16, 32, 64, 128) for shape in bench_sweep.PAGE_SHAPES
    }
    # one shape's keys end inside the last page-sized chunk at every page size (a partial chunk the bulk-copy
    # producer copies itself), the others' on a 16-key boundary
    partial = {shape for shape, (_, new, cached) in bench_sweep.PAGE_SHAPES.items() if (new + cached) % 64 == 63}
    assert partial == {"chunk 512 on 30015"}


def _sweep_records(times):
    """Records of ``{(workload, system): ms}``, as run_bench makes them."""
    records = []
    for (workload, system), ms in times.items():
        record = bench.new_record(system, workload)
        record["ms"] = ms
        records.append(record)
    return records


def test_sweep_summary_gives_each_point_its_speedup_over_flashinfers_best():
    slices = bench_sweep.sweep_slices(decode_only=True)
    a, b, c = (p.name for p in slices[0].points[:3])
    records = _sweep_records(
        {
            (a, "pagedwindow"): 0.010,
            (a, "flashinfer_fa2"): 0.013,
            (a, "flashinfer_fa3"): 0.020,
            (b, "pagedwindow"): 0.020,
            (b, "flashinfer_fa3"): 0.016,
            (c, "pagedwindow"): None,  # a failed run: listed, no speed-up
            (c, "flashinfer_fa2"): 0.1,
        }
    )
    rows = bench_sweep.sweep_summary(records, slices)
    assert [r["workload"] for r in rows] == [a, b, c]  # points that did not run are left out
    assert rows[0]["flashinfer_best"] == "flashinfer_fa2" and rows[0]["speedup"] == pytest.approx(1.3)
    assert rows[1]["flashinfer_best"] == "flashinfer_fa3" and rows[1]["speedup"] == pytest.approx(0.8)
    assert rows[2]["speedup"] is None and rows[2]["flashinfer_best_ms"] == 0.1
    assert rows[0]["slice"] == "decode_w1023" and (rows[0]["x_axis"], rows[0]["y_axis"]) == ("kv_len", "batch")
    assert [r["workload"] for r in bench_sweep.slower_points(rows)] == [b]


def test_sweep_table_lists_every_slower_point_and_the_heat_maps_draw(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from pagedwindow.viz.bench_plots import AXIS_LABELS, plot_sweep

    slices = bench_sweep.sweep_slices()
    assert {a for s in slices for a in (s.x, s.y)} <= set(AXIS_LABELS)  # every axis drawn with its label
    times = {}
    for s in slices:
        for i, p in enumerate(s.points):
            times[(p.name, "pagedwindow")] = 1.0
            if i % 5:  # every fifth point without a peer: n/a in the map
                times[(p.name, "flashinfer_fa2")] = 0.9 if i % 7 == 0 else 1.2
    records = _sweep_records(times)
    result = {"gpu": "NVIDIA H200", "peak_bf16_tflops": 800.0, "records": records}
    result["sweep"] = bench_sweep.sweep_summary(records, slices)
    table = bench.markdown_table(result)
    slower = bench_sweep.slower_points(result["sweep"])
    assert slower and f"slower than FlashInfer's best (kernel time) at {len(slower)}:" in table
    assert all(f"- {r['workload']}: 0.90×" in table for r in slower)
    fig = plot_sweep(result["sweep"])
    assert len([ax for ax in fig.axes if ax.get_visible() and ax.images]) == len(slices)
    fig.savefig(tmp_path / "sweep.png")


def test_merge_results_joins_runs_of_other_systems_and_recomputes_the_sweep(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    slices = bench_sweep.sweep_slices(decode_only=True)
    a, b = (p.name for p in slices[0].points[:2])
    base = {"gpu": "NVIDIA H200", "date": "2026-12-04", "peak_bf16_tflops": 800.0, "tile_override": None}
    ours = _sweep_records({(a, "pagedwindow"): 0.010, (a, "flashinfer_fa2"): 0.013, (b, "pagedwindow"): 0.020})
    fa3 = _sweep_records({(a, "flashinfer_fa3"): 0.011, (b, "flashinfer_fa3"): 0.016})
    first, second = tmp_path / "run-a.json", tmp_path / "run-b.json"
    first.write_text(json.dumps({**base, "label": "a", "records": ours, "allocations_per_10_calls": {a: 0}}))
    second.write_text(json.dumps({**base, "date": "2026-12-05", "label": "b", "records": fa3, "sweep": []}))

    path = bench.merge_results([first, second], tmp_path / "out", "merged")
    assert path.name == "h200-2026-12-04-merged.json"  # the first run's date
    merged = json.loads(path.read_text())
    assert [(r["workload"], r["system"]) for r in merged["records"]] == [
        (a, "pagedwindow"),
        (a, "flashinfer_fa2"),
        (a, "flashinfer_fa3"),
        (b, "pagedwindow"),
        (b, "flashinfer_fa3"),
    ]
    assert merged["merged_from"] == ["run-a.json", "run-b.json"] and merged["allocations_per_10_calls"] == {a: 0}
    speedups = {r["workload"]: (r["flashinfer_best"], r["speedup"]) for r in merged["sweep"]}
    assert speedups[a] == ("flashinfer_fa3", pytest.approx(1.1))  # fa3 from the second run is the best peer
    assert speedups[b] == ("flashinfer_fa3", pytest.approx(0.8))
    assert "slower than FlashInfer's best (kernel time) at 1:" in path.with_suffix(".md").read_text()
    assert path.with_name("h200-2026-12-04-merged-sweep.png").stat().st_size > 0

    second.write_text(json.dumps({**base, "records": _sweep_records({(b, "pagedwindow"): 0.02})}))
    with pytest.raises(ValueError, match="more than one run"):
        bench.merge_results([first, second], tmp_path / "out", "twice")
    second.write_text(json.dumps({**base, "gpu": "NVIDIA H100", "records": fa3}))
    with pytest.raises(ValueError, match="different GPUs"):
        bench.merge_results([first, second], tmp_path / "out", "other")


@pytest.mark.parametrize("name", ["decode_256x2000_p32", "prefill_8x2048", "chunk_512_on_30000"])
def test_paged_csr_encodes_each_requests_kv(name):
    w = bench.WORKLOADS[name]
    order = torch.randperm(20_000, generator=torch.Generator().manual_seed(0)).tolist()  # more ids than pages
    csr = bench.paged_csr(w, order)
    assert all(t.dtype == torch.int32 and t.device.type == "cpu" for t in csr)
    pages = (csr.kv_indptr[1:] - csr.kv_indptr[:-1]).tolist()
    kv_lens = [(n - 1) * w.page_size + int(last) for n, last in zip(pages, csr.last_page_len)]
    assert tuple(kv_lens) == w.kv_lens and all(1 <= int(last) <= w.page_size for last in csr.last_page_len)
    seq_lens = (csr.qo_indptr[1:] - csr.qo_indptr[:-1]).tolist()
    assert tuple(kv - n for kv, n in zip(kv_lens, seq_lens)) == w.start_positions  # start = kv_len - seq_len
    assert csr.kv_indices.tolist() == order[: int(csr.kv_indptr[-1])]
    with pytest.raises(ValueError, match="pages needed"):
        bench.paged_csr(w, order[: int(csr.kv_indptr[-1]) - 1])  # too few page ids


@needs_from_csr
def test_make_inputs_is_seeded_and_plans_from_the_csr():
    w = bench.Workload("small", (5, 1, 40), (0, 20, 3), window_left=7, page_size=16)
    one, two = (bench.make_inputs(w, torch.Generator().manual_seed(0), "cpu") for _ in range(2))
    assert torch.equal(one.pool, two.pool) and torch.equal(one.q, two.q) and one.pool.isfinite().all()
    assert torch.equal(one.plan.qo_indptr, one.csr.qo_indptr) and one.plan.kv_lens == w.kv_lens
    assert one.q.shape == (46, bench.HQ, bench.HEAD_DIM) and one.pool.shape[3] == 16
    k, v = bench.dense_kv(one, 2)
    assert k.shape == v.shape == (43, bench.HKV, bench.HEAD_DIM)
    forced = bench.make_inputs(w, torch.Generator().manual_seed(0), "cpu", cta_tile_q=16)
    assert forced.plan.cta_tile_q == 16 and forced.cta_tile_q == 16


@needs_from_csr
def test_plan_times_of_pagedwindow_on_the_host():
    w = bench.Workload("small", (5, 1), (0, 20), page_size=16)
    times = bench.plan_times("pagedwindow", w, bench.make_inputs(w, torch.Generator().manual_seed(0), "cpu"), 3)
    assert times["plan_ms"] > 0 and times["update_plan_ms"] > 0 and times["plan_inputs"]["kv_indices"] == "cpu"
    assert times["plan_ms_host_csr"] > 0 and times["update_plan_ms_host_csr"] > 0


def test_peers_without_a_plan_step():
    times = bench.plan_times("sdpa", bench.WORKLOADS["prompts_32x128"], inp=None, reps=1)
    assert times["plan_ms"] is None and times["update_plan_ms"] is None and "not applicable" in times["plan_status"]
    record = bench.new_record("flex", "prompts_32x128")
    assert all(record[k] is None for k in ("e2e_ms", "ms", "plan_ms", "update_plan_ms")) and record["status"] == "ok"


# -- timing helpers (host side) ------------------------------------------------------------------------------------
def test_e2e_and_host_times_are_per_call_wall_clock():
    counts, syncs = [0, 0], []

    def call(i):
        def run():
            counts[i] += 1
            time.sleep(0.002)

        return run

    ms = bench.e2e_ms([call(0), call(1)], iters=4, loops=3, synchronize=lambda: syncs.append(1))
    assert counts == [1 + 3 * 2, 1 + 3 * 2]  # a warm-up round, then 3 loops of 4 calls in rotation
    assert len(syncs) == 2 * 3 and 2.0 <= ms < 50
    assert 2.0 <= bench.host_ms(call(0), 3, synchronize=lambda: None) < 50 and counts[0] == 7 + 4


def test_interleaved_e2e_takes_turns_in_a_new_order_each_round_and_keeps_each_systems_median():
    order = []

    def system(name, seconds):
        def run():
            order.append(name)
            time.sleep(seconds)

        return [run]

    e2e = bench.interleaved_e2e_ms(
        {"fast": system("fast", 0.001), "slow": system("slow", 0.004)}, iters=2, rounds=3, synchronize=lambda: None
    )
    assert sorted(e2e) == ["fast", "slow"] and 1.0 <= e2e["fast"] < e2e["slow"] < 50
    # each round: one system's warm-up call and loop of 2, then the other's, in the round's order
    blocks = [order[i : i + 3] for i in range(0, len(order), 3)]
    assert len(blocks) == 6 and all(len(set(b)) == 1 for b in blocks)
    rounds = [(blocks[i][0], blocks[i + 1][0]) for i in range(0, 6, 2)]
    assert all(sorted(r) == ["fast", "slow"] for r in rounds)
    assert rounds == [tuple(r) for r in bench.shuffled_rounds(["fast", "slow"], 3)]  # seeded: the same orders
    assert bench.interleaved_e2e_ms({}, iters=2, rounds=3) == {}


def test_interleaved_host_ms_varies_who_runs_before_whom():
    """Every callable runs ``reps`` times (after one warm-up each), in a new order each round, so each one follows
    every other one in some round: none always runs right after the same system."""
    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in "abcd"}
    got = bench.interleaved_host_ms(fns, reps=40, synchronize=lambda: None)
    assert sorted(got) == list("abcd") and all(ms >= 0 for ms in got.values())
    assert order[:4] == list("abcd") and all(order.count(n) == 41 for n in "abcd")
    timed = order[4:]
    rounds = [tuple(timed[i : i + 4]) for i in range(0, len(timed), 4)]
    assert all(sorted(r) == list("abcd") for r in rounds) and len(set(rounds)) > 4
    followed = {(x, y) for r in rounds for x, y in zip(r, r[1:])}
    assert followed == {(x, y) for x in "abcd" for y in "abcd" if x != y}


# -- names ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, slug",
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100-80gb-hbm3"),
        ("NVIDIA H200 NVL", "h200-nvl"),
        ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
        ("AMD Instinct MI300X", "instinct-mi300x"),
        ("NVIDIA", "nvidia"),
        ("Tesla V100-SXM2-16GB", "tesla-v100-sxm2-16gb"),
        ("  ", "gpu"),
    ],
)
def test_gpu_slug(name, slug):
    assert bench.gpu_slug(name) == slug


def test_result_names_are_found_by_the_results_reader(tmp_path):
    assert bench.result_stem("NVIDIA H200", "2026-12-02") == "h200-2026-12-02"
    assert bench.result_stem("NVIDIA H100 80GB HBM3", "2026-12-03", "v5") == "h100-80gb-hbm3-2026-12-03-v5"
    for stem in ("h200-2026-12-02", "h100-80gb-hbm3-2026-12-03-v5"):
        (tmp_path / f"{stem}.json").write_text(json.dumps(RESULT))
    newest = bench_results.newest_results(tmp_path)
    assert newest.name == "h100-80gb-hbm3-2026-12-03-v5.json"
    assert bench_results.load_results(newest).date == "2026-12-02"  # the file's own date wins over its name


# -- reporting -----------------------------------------------------------------------------------------------------
def _record(system, e2e, ms, plan=None, update=None, **extra):
    return {
        "system": system,
        "workload": "prefill_1x8192",
        "e2e_ms": e2e,
        "ms": ms,
        "plan_ms": plan,
        "update_plan_ms": update,
        "useful_tflops": None if ms is None else 0.1288 / ms,
        "max_abs_err": None if ms is None else 0.0156,
        "err_bound": None if ms is None else 0.05,
        "status": "ok",
        **extra,
    }


RESULT = {
    "gpu": "NVIDIA H200",
    "date": "2026-12-02",
    "peak_bf16_tflops": 800.0,
    "tile_override": None,
    "allocations_per_10_calls": {"prefill_1x8192": 0},
    "records": [
        _record(
            "pagedwindow",
            0.45,
            0.4,
            0.05,
            0.01,
            cta_tile_q=128,
            plan_inputs=dict.fromkeys(bench.Csr._fields, "cpu"),
            plan_status="from_csr",
        ),
        _record(
            "flashinfer_fa2",
            0.7,
            0.6,
            0.2,
            plan_ms_host_indptr=0.1,
            plan_inputs=dict.fromkeys(bench.Csr._fields, "cuda"),
            plan_status="wrapper.plan",
        ),
        _record("flashinfer_fa3", 0.6, 0.5, 0.3, plan_ms_host_indptr=0.15),
        _record("sdpa", 4.5, 4.0, plan_inputs=None, plan_status="not applicable"),
        {**_record("flex", None, None), "status": "missing: No module named 'x'"},
    ],
}


def test_ratios_to_flashinfers_best():
    ratios = bench_results.flashinfer_ratios(RESULT["records"])
    e2e, kernel = ratios["prefill_1x8192", "pagedwindow"]
    assert e2e == pytest.approx(0.45 / 0.6) and kernel == pytest.approx(0.4 / 0.5)  # best: fa3 on both
    mixed = [_record("flashinfer_fa2", 0.5, 0.6), _record("flashinfer_fa3", 0.7, 0.5), _record("pagedwindow", 1, 1)]
    assert bench_results.flashinfer_ratios(mixed)["prefill_1x8192", "pagedwindow"] == (
        pytest.approx(2.0),
        pytest.approx(2.0),
    )
    assert bench_results.flashinfer_ratios(RESULT["records"])["prefill_1x8192", "flex"] == (None, None)
    alone = bench_results.flashinfer_ratios([_record("pagedwindow", 1, 1), _record("flashinfer_fa3", None, None)])
    assert alone["prefill_1x8192", "pagedwindow"] == (None, None)


def test_table_shows_the_three_times_and_the_ratios():
    table = bench.markdown_table(RESULT)
    assert "| e2e ms | kernel ms | plan ms | update ms |" in table
    assert "| prefill_1x8192 | pagedwindow | 0.4500 | 0.4000 | 0.0500 | 0.0100 | 0.3 | 0.0 | 0.75× | 0.80× |" in table
    assert "| prefill_1x8192 | flashinfer_fa3 | 0.6000 | 0.5000 | 0.3000 | — |" in table
    assert "| prefill_1x8192 | sdpa | 4.5000 | 4.0000 | — | — |" in table and "| 7.50× | 8.00× |" in table
    assert "| prefill_1x8192 | flex | — | — | — | — | — | — | — | — | missing: No module named 'x' |" in table
    assert "prefill_1x8192 fa2 0.1000, prefill_1x8192 fa3 0.1500" in table
    assert "plan tile (cta_tile_q): prefill_1x8192 128" in table and "the plan's own choice" in table
    assert "prefill_1x8192 0" in table
    assert "forced to 64" in bench.markdown_table({**RESULT, "tile_override": 64})


def test_table_of_an_older_file_with_kernel_time_only():
    old = {
        "gpu": "NVIDIA H200",
        "peak_bf16_tflops": 800.0,
        "records": [
            {"system": "pagedwindow", "workload": "w", "ms": 0.4, "useful_tflops": 322.2, "max_abs_err": 0.0156}
        ],
    }
    assert "| w | pagedwindow | — | 0.4000 | — | — | 322.2 | 40.3 | — | — | 1.56e-02 |" in bench.markdown_table(old)


def test_results_round_trip_and_plots(tmp_path):
    path = tmp_path / f"{bench.result_stem(RESULT['gpu'], RESULT['date'])}.json"
    path.write_text(json.dumps(RESULT, indent=1))
    res = bench_results.load_results(path)
    assert res.records == RESULT["records"] and res.systems[:3] == ["pagedwindow", "flashinfer_fa2", "flashinfer_fa3"]
    rows = {(r["workload"], r["system"]): r for r in bench_results.summary_rows(res)}
    ours = rows["prefill_1x8192", "pagedwindow"]
    assert (ours["e2e_ms"], ours["ms"], ours["plan_ms"], ours["update_plan_ms"]) == (0.45, 0.4, 0.05, 0.01)
    assert ours["e2e_vs_flashinfer_best"] == pytest.approx(0.75) and ours["ms_vs_flashinfer_best"] == pytest.approx(0.8)
    assert rows["prefill_1x8192", "flashinfer_fa3"]["pagedwindow_speedup"] == pytest.approx(1.25)
    assert bench_results.bench_gate(res, max_err_limit=2e-2) == []
    bench.write_plots(path)
    assert (tmp_path / "h200-2026-12-02-throughput.png").stat().st_size > 0
    assert (tmp_path / "h200-2026-12-02-speedup.png").stat().st_size > 0


@pytest.mark.parametrize("field", ["e2e_ms", "plan_ms", "update_plan_ms", "plan_ms_host_indptr"])
def test_results_reader_checks_the_new_times(tmp_path, field):
    data = json.loads(json.dumps(RESULT))
    data["records"][0][field] = "fast"
    path = tmp_path / "h200-2026-12-02.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"records\[0\]: {field}"):
        bench_results.load_results(path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_bench_refuses_without_a_gpu(capsys):
    assert bench.run_bench(out="unused") == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
    # Sweep points by name, on the grid and off it, get as far as the GPU check.
    names = ["decode_b1_kv4096_w1023", "decode_b4_kv4096_w1023", "sweep_page_x_shape_b2_n512_c30015_p16_w-1"]
    assert bench.run_bench(out="unused", workloads=names, systems=["pagedwindow", "flashinfer_fa2"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_every_sweep_point_is_found_by_its_name():
    for sweep_slice in bench_sweep.sweep_slices():
        for point in sweep_slice.points:
            assert bench_sweep.point_named(point.name) == point
            assert bench.workload_named(point.name) == bench.sweep_workload(point)
    assert bench.workload_named("prefill_1x8192") is bench.WORKLOADS["prefill_1x8192"]


@pytest.mark.parametrize(
    "name, shape, canonical",
    [
        # batch, new tokens, cached, page size, window: off the grids, named as the sweep's points are; the
        # point's own name where it differs
        ("decode_b4_kv4096_w1023", (4, 1, 4095, 16, 1023), None),
        ("decode_b2_kv1_w-1", (2, 1, 0, 16, -1), None),
        ("sweep_decode_b8_n1_c4095_p16_w1023", (8, 1, 4095, 16, 1023), "decode_b8_kv4096_w1023"),
        ("sweep_page_x_shape_b2_n512_c30015_p16_w-1", (2, 512, 30015, 16, -1), None),
        ("sweep_batch_x_new_b3_n7_c0_p1_w0", (3, 7, 0, 1, 0), None),
    ],
)
def test_points_off_the_grids_are_found_by_their_names(name, shape, canonical):
    point = bench_sweep.point_named(name)
    assert (point.batch, point.new_tokens, point.cached, point.page_size, point.window_left) == shape
    workload = bench.workload_named(name)
    assert workload.seq_lens == (shape[1],) * shape[0] and workload.start_positions == (shape[2],) * shape[0]
    assert (workload.page_size, workload.window_left) == shape[3:]
    assert bench_sweep.point_named(point.name) == point  # its own name gives it back
    assert workload.name == point.name == (canonical or name)


@pytest.mark.parametrize(
    "name",
    [
        "nope",
        "decode_b0_kv4096_w1023",  # no request
        "decode_b1_kv0_w1023",  # no key
        "decode_b1_kv4096_w-2",  # window below -1
        "decode_b1_kv4096_w1023x",
        "sweep_decode_b4_n2_c100_p16_w1023",  # a decode name could not say its 2 new tokens
        "sweep_decode_b4_n1_c100_p32_w1023",  # nor its page size
        "sweep_batch_x_new_b0_n1_c0_p16_w1023",
        "sweep_batch_x_new_b1_n0_c0_p16_w1023",
        "sweep_batch_x_new_b1_n1_c0_p0_w1023",
        "sweep_batch_x_new_b1_n1_c0_p16_w-5",
        "sweep_batch_x_new_b2_n131072_c0_p16_w1023",  # past MAX_SWEEP_TOKENS
        "sweep_cached_x_new_b1_n1_c2097152_p16_w1023",  # past MAX_SWEEP_KEYS
        "sweep_b1_n1_c0_p16_w1023",
        "SWEEP_batch_x_new_b1_n1_c0_p16_w1023",
    ],
)
def test_names_of_no_point_are_refused(name):
    assert bench_sweep.point_named(name) is None
    assert bench.workload_named(name) is None


def test_bench_refuses_unknown_names(capsys):
    assert bench.run_bench(out="unused", workloads=["prefill_1x8192", "nope"]) == 2
    assert "unknown workload or system ['nope']" in capsys.readouterr().out
    bad = ["decode_b0_kv5_w1023", "sweep_decode_b4_n2_c100_p16_w1023"]
    assert bench.run_bench(out="unused", workloads=["decode_b4_kv4096_w1023", *bad]) == 2
    assert f"unknown workload or system {bad}" in capsys.readouterr().out
    # Two names of one point are one workload named twice.
    same = ["decode_b4_kv4096_w1023", "sweep_decode_b4_n1_c4095_p16_w1023"]
    assert bench.run_bench(out="unused", workloads=same) == 2
    assert "['decode_b4_kv4096_w1023'] named more than once" in capsys.readouterr().out
    assert bench.run_bench(out="unused", workloads=["prefill_1x8192", "prefill_1x8192"], systems=["sdpa"]) == 2
    assert "['prefill_1x8192'] named more than once" in capsys.readouterr().out
    assert bench.run_bench(out="unused", systems=["sdpa", "flex", "sdpa"]) == 2
    assert "['sdpa'] named more than once" in capsys.readouterr().out
