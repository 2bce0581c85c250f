"""``pagedwindow report`` (report.run_report): parameter-set planning, a smoke report end to end (index.html, HTML
without inputs, artifacts in the report directory, nothing in notebooks/), and non-zero exits for a failing gate,
a raising notebook and usage errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pagedwindow import report
from pagedwindow.cli import main as cli_main

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _snapshot(directory: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in directory.rglob("*")}


# -- planning ------------------------------------------------------------------------------------------------------
DECLARED = {"01_a": {"seed", "dtype", "x", "out_dir"}, "02_b": {"seed", "y", "out_dir"}}


def test_plan_runs_shares_keys_by_declaration_and_expands_variants():
    data = {
        "seed": 3,
        "dtype": "float32",
        "01_a": {"x": 1, "variants": {"fp32": {}, "bf16": {"dtype": "bfloat16"}}},
        "02_b": {"y": [1, 2]},
    }
    runs = report.plan_runs(data, DECLARED, ["01_a", "02_b"])
    assert [r.name for r in runs] == ["01_a-fp32", "01_a-bf16", "02_b"]
    assert runs[0].parameters == {"seed": 3, "dtype": "float32", "x": 1}
    assert runs[1].parameters == {"seed": 3, "dtype": "bfloat16", "x": 1}
    assert runs[2].parameters == {"seed": 3, "y": [1, 2]}  # dtype is not declared by 02_b: not passed
    assert [r.name for r in report.plan_runs(data, DECLARED, ["02_b"])] == ["02_b"]


@pytest.mark.parametrize(
    "data,match",
    [
        ({"sed": 1}, "sed"),  # a shared key nobody declares
        ({"01_a": {"y": 1}}, "01_a: parameter"),  # a key its notebook does not declare
        ({"01_a": {"variants": {"v": {"z": 1}}}}, "'z'"),  # ... inside a variant
        ({"01_a": {"variants": []}}, "variants"),
        ({"01_a": [1]}, "mapping"),
        ({1: "a", "seed": 2}, r"the parameter set has key\(s\) \[1\] that are not names"),  # a stray "1:" line
        ({"01_a": {1: 2, "x": 3}}, r"section '01_a' has key\(s\) \[1\] that are not names"),
        ({"01_a": {"variants": {1: {}, "1": {}}}}, r"run name\(s\) \['01_a-1'\] repeat"),
    ],
)
def test_plan_runs_refuses_unknown_keys(data, match):
    with pytest.raises(report.ReportUsageError, match=match):
        report.plan_runs(data, DECLARED, ["01_a", "02_b"])


def test_notebook_selection_by_stem_file_or_prefix():
    available = ["01_a", "02_b", "021_c"]
    assert report._select(None, available) == available
    assert report._select(["02_b.ipynb", "01"], available) == ["02_b", "01_a"]
    with pytest.raises(report.ReportUsageError, match="matches"):
        report._select(["02"], available)  # ambiguous: 02_b and 021_c
    with pytest.raises(report.ReportUsageError, match="nothing"):
        report._select(["9"], available)


@pytest.mark.parametrize("name", ["smoke", "default", "gemma4_12b"])
def test_committed_parameter_sets_plan_every_notebook(name):
    nb_dir = report.default_notebooks_dir()
    stems = report.available_notebooks(nb_dir)
    declared = {s: set(report.declared_parameters(nb_dir / f"{s}.ipynb")) for s in stems}
    runs = report.plan_runs(report.load_params(report.resolve_params(name, nb_dir)), declared, stems)
    assert {r.notebook for r in runs} == set(stems)
    assert all("out_dir" not in r.parameters for r in runs)


def test_gemma4_12b_is_gemma_4_12b_shaped():
    nb_dir = report.default_notebooks_dir()
    stems = report.available_notebooks(nb_dir)
    declared = {s: set(report.declared_parameters(nb_dir / f"{s}.ipynb")) for s in stems}
    runs = report.plan_runs(report.load_params(report.resolve_params("gemma4_12b", nb_dir)), declared, stems)
    for r in runs:
        if r.notebook.startswith(("01", "02", "03")):
            p = r.parameters
            assert (p["num_qo_heads"], p["num_kv_heads"], p["head_dim"], p["page_size"], p["dtype"]) == (
                16,
                8,
                256,
                16,
                "bfloat16",
            )
            assert p["backend"] in ("cuda", "auto")
            assert p.get("sliding_window", (p.get("window_left", -2) + 1)) == 1024


def test_usage_errors_exit_2(tmp_path, capsys):
    assert report.run_report(params="no_such_set", out=tmp_path / "r") == report.EXIT_USAGE
    assert "unknown parameter set 'no_such_set'" in capsys.readouterr().err
    assert report.run_report(params="smoke", out=tmp_path / "r", notebooks=["99"]) == report.EXIT_USAGE
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: 0\nwindow_lft: 3\n")
    assert report.run_report(params=str(bad), out=tmp_path / "r") == report.EXIT_USAGE
    assert "window_lft" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "02_kernel_explorer").write_text("a file where the run's folder goes")
    assert report.run_report(params="smoke", out=tmp_path / "r", notebooks=["02"]) == report.EXIT_USAGE
    assert "holds file(s) ['02_kernel_explorer'] where the runs' folders go" in capsys.readouterr().err


# -- end to end ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smoke_report_writes_index_and_html(tmp_path, capsys):
    before = _snapshot(NOTEBOOKS)
    out = tmp_path / "smoke"
    code = cli_main(["report", "--params", "smoke", "--out", str(out), "--notebooks", "02", "04_benchmark"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "all 2 gate(s) passed" in err
    index = (out / "index.html").read_text()
    for run in ("02_kernel_explorer", "04_benchmark"):
        assert f'href="{run}.html"' in index
        html = (out / f"{run}.html").read_text()
        assert "jp-OutputArea" in html
        assert "import " not in re.sub(r"<(style|script).*?</\1>", "", html, flags=re.S)  # no input cells
        assert (out / run / f"{run}.ipynb").is_file() and (out / run / "metrics.json").is_file()
    assert index.count("PASSED") == 2 and "max_abs_err" in index and "measured" in index
    assert (out / "02_kernel_explorer" / "tiles.png").is_file()
    assert "<img" in (out / "02_kernel_explorer.html").read_text()  # figures rendered into the report
    assert _snapshot(NOTEBOOKS) == before, "the report wrote into notebooks/"
    # what the report exercised: on this CPU, the reference; said on the index, every page and in metrics.json
    assert report.NO_KERNEL in index and "class='pw-banner'" in index
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["passed"] is True and summary["exercised"]["cuda_kernel_exercised"] is False
    assert summary["exercised"]["statement"].startswith(report.NO_KERNEL)
    assert summary["exercised"]["backends"] == {"02_kernel_explorer": "reference", "04_benchmark": "none"}
    assert summary["exercised"]["commit"] == report.git_commit(NOTEBOOKS.parent)
    assert [r["device"] for r in summary["runs"]] == ["CPU", None]
    explorer_page = (out / "02_kernel_explorer.html").read_text()
    assert "No CUDA kernel was exercised in this run" in explorer_page
    assert "This run made no attention call." in (out / "04_benchmark.html").read_text()
    for run in ("02_kernel_explorer", "04_benchmark"):
        page = (out / f"{run}.html").read_text()
        title = re.search(r"<title>(.*?)</title>", page).group(1)
        assert title.endswith(f"{run} (smoke) · pagedwindow report") and title.startswith(("02 ·", "04 ·"))
        header, first_cell = page.index("class='pw-header'"), page.index('<div class="jp-Cell')
        assert header < page.index("href='index.html'") < first_cell  # the link back and the verdict come first
        assert header < page.index(f"{run}: gate PASSED") < first_cell
    top = explorer_page[: explorer_page.index('<div class="jp-Cell')]
    assert "max |ours − fp64| = " in top and "against the limit" in top  # the gate's numbers on top
    for path in [*out.glob("*.html"), *out.glob("*/*.ipynb"), *out.glob("**/metrics.json")]:
        text = path.read_text()
        for machine in {str(out.resolve()), str(tmp_path.resolve()), str(NOTEBOOKS.parent.resolve()), str(Path.home())}:
            assert machine not in text, f"{path.name} holds the absolute path {machine}"


@pytest.mark.slow
def test_failing_gate_and_raising_notebook_exit_nonzero(tmp_path, capsys):
    params = tmp_path / "failing.yaml"
    params.write_text(
        yaml.safe_dump(
            {
                "backend": "reference",
                "device": "cpu",
                "02_kernel_explorer": {
                    "head_dim": 32,
                    "variants": {
                        "gate_fails": {"err_factor": 0.0, "err_slack": 0.0},  # bf16 output is never exact: must fail
                        "raises": {"seq_lens": [0], "start_positions": [0]},  # kv_len 0: the plan refuses it
                        "passes": {},
                    },
                },
            }
        )
    )
    out = tmp_path / "rep"
    code = report.run_report(params=str(params), out=out, notebooks=["02"], progress=False)
    err = capsys.readouterr().err
    assert code == report.EXIT_GATE_FAILED
    assert "FAILED gate(s): 02_kernel_explorer-gate_fails (failed: max |ours − fp64|" in err
    assert "02_kernel_explorer-raises (error: the notebook raised PagedWindowError" in err
    assert "02_kernel_explorer-passes" not in err.split("FAILED gate(s)")[1]
    index = (out / "index.html").read_text()
    assert "2 of 3 runs FAILED" in index and index.count(">FAILED<") == 1 and index.count(">ERROR<") == 1
    assert (out / "02_kernel_explorer-raises.html").is_file()  # the failing notebook is rendered too


# -- what a report exercised, commits, paths ---------------------------------------------------------------------------
def _metrics(backend, *, gpu=None, device="cpu", kernels=(), paths=()):
    env = {
        "device": device,
        "kernels": {"backend": backend, "prefill_kernels": list(kernels), "kv_copy_paths": list(paths)},
    }
    if gpu:
        env["gpu"] = gpu
    return {"passed": True, "backend": backend, "environment": env}


def test_a_cpu_report_says_plainly_that_no_kernel_ran():
    runs = [
        ("01", report.run_exercised(_metrics("reference"))),
        (
            "03",
            report.run_exercised(
                {
                    "passed": True,
                    "backend": "reference",  # notebook 03's keys
                    "environment": {"device": "cpu"},
                }
            ),
        ),
        ("04", report.run_exercised({"passed": True, "backend": "none", "environment": {}})),
    ]
    ex = report.report_exercised(runs, "abc1234")
    assert ex["cuda_kernel_exercised"] is False and ex["statement"].startswith(report.NO_KERNEL)
    assert ex["devices"] == ["CPU"] and ex["prefill_kernels"] == [] and ex["commit"] == "abc1234"


def test_a_gpu_report_names_kernel_copy_path_and_device():
    runs = [
        (
            "01",
            report.run_exercised(
                _metrics("cuda", gpu="NVIDIA H200", device="cuda:0", kernels=["wgmma"], paths=["tma"])
            ),
        ),
        (
            "02",
            report.run_exercised(
                _metrics("cuda+reference", gpu="NVIDIA H200", device="cuda:0", kernels=["wgmma"], paths=["cp.async"])
            ),
        ),
        ("02-fp32", report.run_exercised(_metrics("reference", gpu="NVIDIA H200", device="cuda:0"))),
        ("03", report.run_exercised({})),
    ]  # a run that wrote no metrics
    ex = report.report_exercised(runs, None)
    assert ex["cuda_kernel_exercised"] is True and report.NO_KERNEL not in ex["statement"]
    assert ex["prefill_kernels"] == ["sm_90a wgmma"] and ex["kv_copy_paths"] == ["cp.async", "tma"]
    assert ex["devices"] == ["NVIDIA H200"]
    assert "ran in 2 of 4 runs on NVIDIA H200" in ex["statement"]
    assert "The PyTorch reference ran in: 02, 02-fp32." in ex["statement"]
    assert "Recorded no backend (did not finish?): 03." in ex["statement"]
    banner = report.banner_html(
        backend="cuda",
        device="NVIDIA H200",
        kernels=ex["prefill_kernels"],
        copy_paths=ex["kv_copy_paths"],
        commit="abc1234+dirty",
    )
    assert all(s in banner for s in ("CUDA kernel", "NVIDIA H200", "sm_90a wgmma", "cp.async, tma", "abc1234+dirty"))


def test_git_commit(tmp_path, monkeypatch):
    monkeypatch.delenv(report.COMMIT_ENV, raising=False)
    repo = NOTEBOOKS.parent
    sha = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert report.git_commit(repo) == sha + ("+dirty" if dirty else "")
    assert report.git_commit(tmp_path) is None  # not a checkout
    assert report.git_commit(repo / "notebooks") is None  # inside one, but not its top
    subprocess.run(["git", "init", "-q", str(tmp_path / "r")], check=True)
    (tmp_path / "r" / "f").write_text("1")
    for args in (["add", "f"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c"]):
        subprocess.run(["git", "-C", str(tmp_path / "r"), *args], check=True)
    clean = report.git_commit(tmp_path / "r")
    assert clean and "+dirty" not in clean
    (tmp_path / "r" / "f").write_text("2")
    assert report.git_commit(tmp_path / "r") == clean + "+dirty"
    monkeypatch.setenv(report.COMMIT_ENV, "feedbee")
    assert report.git_commit(None) == "feedbee"


def test_scrub_paths_makes_machine_paths_relative():
    pairs = [("/tmp/r", ""), ("/work/main", ""), ("/root", "~/"), ("/work/main/.venv", "<python>/")]
    text = (
        "Written: /tmp/r/01/metrics.json; results /work/main/benchmarks/x.json; cwd /tmp/r; "
        "/work/main/.venv/lib/site.py; /root/.cache/k; /srv/root/keep; /tmp/rest/keep; /work/mainline; "
        "File \x1b[0;32m/work/main/src/a.py\x1b[0m"
    )  # a traceback's colours
    assert report.scrub_paths(text, pairs) == (
        "Written: 01/metrics.json; results benchmarks/x.json; cwd .; <python>/lib/site.py; ~/.cache/k; "
        "/srv/root/keep; /tmp/rest/keep; /work/mainline; File \x1b[0;32msrc/a.py\x1b[0m"
    )


def test_machine_paths_cover_package_directories_outside_the_prefix(tmp_path, monkeypatch):
    site = "/opt/elsewhere/lib/python3.12/site-packages"
    monkeypatch.setattr(sys, "path", [*sys.path, site])
    pairs = report.machine_paths(tmp_path / "r", None)
    warning = f"{site}/tqdm/auto.py:21: TqdmWarning: IProgress not found"
    assert report.scrub_paths(warning, pairs) == "<site-packages>/tqdm/auto.py:21: TqdmWarning: IProgress not found"


def test_gate_summary_prefers_the_runs_own_sentence():
    assert (
        report.gate_summary({"gate_summary": "all 3 layers within 1e-4", "max_abs_err": 1.0})
        == "all 3 layers within 1e-4"
    )
    assert (
        report.gate_summary({"passed": True, "max_abs_err": 0.5, "tolerance": 0.25, "steps": 4, "x": 1})
        == "max_abs_err 0.5; tolerance 0.25; steps 4"
    )


@pytest.mark.parametrize(
    "status,metrics,label",
    [
        ("passed", {"passed": True}, "PASSED"),
        ("failed", {"passed": False, "verdict": "failed"}, "FAILED"),
        (
            "failed",
            {
                "passed": False,
                "verdict": "inconclusive",
                "failures": ["3 clear-margin steps, fewer than min_clear_steps 8"],
            },
            "INCONCLUSIVE",
        ),
        ("error", {}, "ERROR"),
        ("no-metrics", {}, "NO METRICS"),
    ],
)
def test_the_page_and_the_index_show_the_runs_verdict(tmp_path, status, metrics, label):
    result = report.RunResult(report.RunSpec("03", "03_greedy_decode_oracle", {}), status, 1.0, metrics)
    assert result.label == label
    header = report.page_header(result, params_name="smoke", commit=None)
    assert f"03: gate {label}</h2>" in header
    assert all(f in header for f in metrics.get("failures", []))
    report.write_index(tmp_path, [result], params_name="smoke", params_path="smoke.yaml", params_text="seed: 0\n")
    assert f"<b>{label}</b>" in (tmp_path / "index.html").read_text()
