"""The committed notebooks: output-free (nbstripout), a documented ``parameters`` cell, and each one executed
through papermill with the smoke parameters on the CPU, its ``metrics.json`` gate asserted."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import papermill
import pytest

from pagedwindow import report

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
IDS = [p.stem for p in PATHS]
PARAMETER_LINE = re.compile(r"^\w+: [\w\[\], ]+ = .+ {2}# \S.*$")
REQUIRED = {
    "01_window_prefill_vs_hf": {
        "family",
        "sliding_window",
        "page_size",
        "prompt_len",
        "prefix_len",
        "dtype",
        "backend",
        "seed",
        "out_dir",
    },
    "02_kernel_explorer": {
        "page_size",
        "seq_lens",
        "start_positions",
        "num_qo_heads",
        "num_kv_heads",
        "window_left",
        "cta_tile_q",
        "backend",
        "seed",
        "out_dir",
    },
    "03_greedy_decode_oracle": {
        "family",
        "sliding_window",
        "page_size",
        "prompt_len",
        "max_new_tokens",
        "dtype",
        "backend",
        "seed",
        "out_dir",
    },
    "04_benchmark": {"results_dir", "run_benchmark", "out_dir"},
}


def test_the_four_notebooks_are_there():
    assert IDS == sorted(REQUIRED)


# -- committed form --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_committed_notebook_is_output_free(path):
    nb = nbformat.read(str(path), as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: a code cell has outputs"
        assert set(cell.metadata) <= {"tags"}, f"{path.name}: volatile cell metadata {dict(cell.metadata)}"
    assert set(nb.metadata) <= {"kernelspec", "language_info"}, f"{path.name}: notebook metadata {set(nb.metadata)}"
    assert "papermill" not in json.dumps(nb.metadata)


def test_nbstripout_verify_passes():
    exe = shutil.which("nbstripout") or str(Path(sys.executable).with_name("nbstripout"))
    if not Path(exe).exists():
        pytest.fail("nbstripout is not installed (it is in the [test] extra)")
    result = subprocess.run([exe, "--verify", *map(str, PATHS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_notebook_code_passes_ruff():
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(exe).exists():
        pytest.fail("ruff is not installed (it is in the [test] extra)")
    result = subprocess.run([exe, "check", *map(str, PATHS)], capture_output=True, text=True, cwd=NOTEBOOKS.parent)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", PATHS, ids=IDS)
def test_first_code_cell_is_the_documented_parameters_cell(path):
    nb = nbformat.read(str(path), as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert "parameters" in first.metadata.get("tags", []), f"{path.name}: first code cell is not tagged"
    tree = ast.parse(first.source)
    assert all(isinstance(node, ast.AnnAssign) and node.simple for node in tree.body), (
        f"{path.name}: the parameters cell holds something other than annotated assignments"
    )
    lines = [line for line in first.source.splitlines() if line.strip()]
    assert len(lines) == len(tree.body), f"{path.name}: one assignment per line"
    for line in lines:
        assert PARAMETER_LINE.match(line), f"{path.name}: {line!r} is not `name: type = value  # help`"
    declared = papermill.inspect_notebook(str(path))  # what `papermill --help-notebook` prints
    assert list(declared) == [node.target.id for node in tree.body]
    assert all(p["help"] for p in declared.values()), f"{path.name}: a parameter has no help"
    assert REQUIRED[path.stem] <= set(declared)


# -- executed with smoke parameters ----------------------------------------------------------------------------------
def _smoke_parameters(stem: str) -> dict:
    declared = {p.stem: set(report.declared_parameters(p)) for p in PATHS}
    data = report.load_params(report.resolve_params("smoke", NOTEBOOKS))
    (run,) = report.plan_runs(data, declared, [stem])
    return run.parameters


def _execute(stem: str, tmp_path: Path, **overrides) -> dict:
    out = tmp_path / stem
    params = dict(_smoke_parameters(stem), **overrides, out_dir=str(out))
    with report._kernel_environment(NOTEBOOKS.parent):
        papermill.execute_notebook(
            str(NOTEBOOKS / f"{stem}.ipynb"),
            str(tmp_path / f"{stem}.ipynb"),
            parameters=params,
            kernel_name="python3",
            progress_bar=False,
            cwd=str(tmp_path),
        )
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.slow
def test_01_window_prefill_vs_hf(tmp_path):
    m = _execute("01_window_prefill_vs_hf", tmp_path)
    assert m["passed"] is True, m["failures"]
    assert m["max_rel_err"] <= 1e-4 and m["floor_max_abs_err"] > 0 and m["weight_beyond_window"] == 0.0
    assert m["backend"] == "reference" and m["chunks"] == [24, 16]
    kernels = m["environment"]["kernels"]  # what ran: the oracle's and the detail's launches, all reference
    assert kernels["backend"] == "reference" and set(kernels["launches"]) == {"reference"}
    assert kernels["prefill_kernels"] == kernels["kv_copy_paths"] == []
    assert "max |ours − HF eager|" in m["gate_summary"]
    assert [row["layer"] for row in m["layers"]] == [0, 1, 2] and all(row["gate_passed"] for row in m["layers"])
    # fused_prep (the default): the sliding layers ran our prep, the full one HF's q/k/v
    assert m["fused_prep"] is True and m["fused_layers"] == [0, 1]
    assert [row["fused"] for row in m["layers"]] == [True, True, False]
    prep = m["prep"]  # the prep panel: part of the gate, every sliding layer's q, k and v
    assert prep["passed"] is True and prep["failures"] == [] and prep["backend"] == "reference"
    assert [(r["layer"], r["tensor"]) for r in prep["layers"]] == [(la, t) for la in (0, 1) for t in "qkv"]
    assert all(r["gate_passed"] and r["ours_max_rel"] <= 1e-5 and r["tokens"] == 69 for r in prep["layers"])
    assert prep["params"]["0"]["norm_style"] == "gemma4" and prep["params"]["0"]["rope_theta"] == 10000.0
    assert "Prep (norms + RoPE, paged K/V write): max |ours − ref|" in m["gate_summary"]
    out = tmp_path / "01_window_prefill_vs_hf"
    for png in ("error_vs_distance", "error_across_pages", "error_per_head", "error_histogram", "prep_errors"):
        assert (out / f"{png}.png").is_file()
    assert (out / "prep.csv").read_text().startswith("case,layer,tensor,tokens,")


@pytest.mark.slow
def test_02_kernel_explorer(tmp_path):
    m = _execute("02_kernel_explorer", tmp_path)
    assert m["passed"] is True, m["failures"]
    assert 0 < m["max_abs_err"] <= m["limit"] and m["rows_written"] and m["spare_rows_untouched"]
    assert len(m["tiles"]) == m["num_tiles"] == 4
    assert m["backend"] == "reference" and m["environment"]["kernels"]["launches"] == {"reference": 1}
    assert m["gate_summary"].startswith("max |ours − fp64| = ")
    for png in ("mask", "tiles", "tile_errors"):
        assert (tmp_path / "02_kernel_explorer" / f"{png}.png").is_file()


@pytest.mark.slow
def test_03_greedy_decode_oracle(tmp_path):
    m = _execute("03_greedy_decode_oracle", tmp_path)
    assert m["passed"] is True, m["failures"]
    assert m["steps"] == 10 and m["clear_steps"] > 0 and m["teacher_forced_matches"] >= m["clear_steps"]
    assert m["backend"] == "reference" and m["backend_requested"] == "reference"
    assert (tmp_path / "03_greedy_decode_oracle" / "decode_steps.png").is_file()


@pytest.mark.slow
def test_04_benchmark_without_results_passes_and_says_so(tmp_path):
    empty = tmp_path / "no_results"
    empty.mkdir()
    m = _execute("04_benchmark", tmp_path, results_dir=str(empty))
    assert m["passed"] is True and m["measured"] is False and m["measured_here"] is False
    assert m["backend"] == "none" and m["environment"]["kernels"]["launches"] == {}
    executed = (tmp_path / "04_benchmark.ipynb").read_text()
    assert "Not measuring" in executed and "No benchmark results yet" in executed


@pytest.mark.slow
def test_04_benchmark_plots_a_results_file(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    records = [
        {
            "system": s,
            "workload": w,
            "ms": ms,
            "useful_tflops": None if ms is None else 100 / ms,
            "max_abs_err": None if ms is None else 4e-3,
        }
        for w in ("prefill_1x8192", "decode_64x4096")
        for s, ms in (("pagedwindow", 0.5), ("flashinfer_fa2", 0.6), ("flex", None))
    ]
    (results / "h200-2026-01-01.json").write_text(
        json.dumps({"gpu": "old", "peak_bf16_tflops": 700.0, "records": records})
    )
    (results / "h200-2026-02-01.json").write_text(
        json.dumps({"gpu": "NVIDIA H200", "peak_bf16_tflops": 750.0, "records": records})
    )
    m = _execute("04_benchmark", tmp_path, results_dir=str(results))
    assert m["passed"] is True and m["measured"] is True and m["measured_here"] is False
    assert m["gpu"] == "NVIDIA H200" and m["results_file"] == "results/h200-2026-02-01.json"  # relative to cwd
    assert m["backend"] == "none" and "timed on 2 of 2 workloads" in m["gate_summary"]
    for png in ("throughput", "speedup", "errors"):
        assert (tmp_path / "04_benchmark" / f"{png}.png").is_file()
