"""The benchmark's counting and reporting (CPU); the timing itself runs on a GPU (`pagedwindow bench`)."""

import json

import pytest
import torch

from pagedwindow import bench


@pytest.mark.parametrize("name, pairs", [("prefill_1x8192", 7_864_832), ("prefill_8x2048", 12_587_008),
                                         ("chunk_2048_on_6144", 2_097_152), ("decode_64x4096", 65_536)])
def test_visible_pairs_of_the_workloads(name, pairs):
    w = bench.WORKLOADS[name]
    assert w.visible_pairs() == pairs
    assert w.useful_flops() == 4 * 256 * 16 * pairs


def test_visible_pairs_match_a_dense_mask():
    w = bench.Workload("t", (7, 5), (3, 0), window_left=2)
    total = 0
    for start, seq in zip(w.start_positions, w.seq_lens):
        q = torch.arange(start, start + seq)[:, None]
        k = torch.arange(start + seq)[None, :]
        total += int(((k <= q) & (q - k <= 2)).sum())
    assert w.visible_pairs() == total


def test_table_and_plots_from_a_result(tmp_path):
    result = {"gpu": "NVIDIA H200", "date": "2026-12-02", "peak_bf16_tflops": 800.0,
              "allocations_per_10_calls": {"prefill_1x8192": 0},
              "records": [
                  {"system": "pagedwindow", "workload": "prefill_1x8192", "ms": 0.4, "useful_tflops": 322.2,
                   "max_abs_err": 0.0156, "status": "ok"},
                  {"system": "flashinfer_fa3", "workload": "prefill_1x8192", "ms": 0.5, "useful_tflops": 257.8,
                   "max_abs_err": 0.0156, "status": "ok"},
                  {"system": "flex", "workload": "prefill_1x8192", "ms": None, "useful_tflops": None,
                   "max_abs_err": None, "status": "missing: No module named 'x'"}]}
    table = bench.markdown_table(result)
    assert "| prefill_1x8192 | flashinfer_fa3 | 0.5000 | 257.8 | 32.2 | 1.25× |" in table
    assert "| prefill_1x8192 | flex | — | — | — | — | missing: No module named 'x' |" in table
    assert "prefill_1x8192 0" in table
    path = tmp_path / "h200-2026-12-02.json"
    path.write_text(json.dumps(result))
    bench.write_plots(path)
    assert (tmp_path / "h200-2026-12-02-throughput.png").stat().st_size > 0
    assert (tmp_path / "h200-2026-12-02-speedup.png").stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_bench_refuses_without_a_gpu(capsys):
    assert bench.run_bench(out="unused") == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
