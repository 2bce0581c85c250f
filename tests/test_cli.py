"""The ``pagedwindow`` command line on a CPU: --version and ``python -m``, plain-text help, usage errors as one line
on stderr with exit code 2, labels that cannot leave --out, and ``doctor``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pagedwindow
from pagedwindow import report, settings
from pagedwindow.cli import main

SRC = Path(__file__).resolve().parents[1] / "src"


def _python_m(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "pagedwindow", *args], capture_output=True, text=True, env=env, timeout=300
    )


def _usage_error(capsys, argv: list[str]) -> str:
    """Run the command, assert exit code 2 with one line on stderr and no traceback; return that line."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# -- --version, python -m, help ------------------------------------------------------------------------------------
def test_version_via_python_m():
    proc = _python_m("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"pagedwindow {pagedwindow.__version__}\n"


@pytest.mark.parametrize(
    "argv,options",
    [
        ([], ["--version", "report", "bench", "doctor", "exit codes"]),
        (["report"], ["--params", "--out", "--notebooks"]),
        (["bench"], ["--out", "--workloads", "--systems", "--sweep", "--quick", "--cta-tile-q", "--label"]),
        (["doctor"], ["builds nothing"]),
    ],
)
def test_help_is_plain_text_and_lists_options(capsys, argv, options):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in options:
        assert option in out
    for markup in ("``", ":func:", ":class:", ":mod:"):
        assert markup not in out


# -- usage errors: one line, exit 2 --------------------------------------------------------------------------------
def test_report_malformed_and_non_utf8_params(tmp_path, capsys):
    malformed = tmp_path / "malformed.yaml"
    malformed.write_text("seed: [1, 2\n")
    assert "malformed YAML" in _usage_error(capsys, ["report", "--params", str(malformed), "--out", str(tmp_path)])
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"seed: \xff\xfe\n")
    assert "not UTF-8" in _usage_error(capsys, ["report", "--params", str(binary), "--out", str(tmp_path)])
    not_a_mapping = tmp_path / "list.yaml"
    not_a_mapping.write_text("- 1\n")
    assert "mapping" in _usage_error(capsys, ["report", "--params", str(not_a_mapping), "--out", str(tmp_path)])


@pytest.mark.parametrize("name", ["no_such_set", "../params/smoke", "/../../x"])
def test_report_unknown_params_name(tmp_path, capsys, name):
    err = _usage_error(capsys, ["report", "--params", name, "--out", str(tmp_path / "r")])
    assert "parameter" in err and not (tmp_path / "r").exists()


def test_report_unknown_notebook(tmp_path, capsys):
    err = _usage_error(capsys, ["report", "--params", "smoke", "--out", str(tmp_path / "r"), "--notebooks", "99"])
    assert "'99'" in err and not (tmp_path / "r").exists()


@pytest.fixture
def unwritable_dir(tmp_path):
    """A directory this process cannot create entries in (root ignores permission bits: /proc then)."""
    if os.geteuid() == 0:
        if not Path("/proc").is_dir():
            pytest.skip("running as root without /proc")
        yield Path("/proc")
        return
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    yield locked
    locked.chmod(0o700)


@pytest.mark.parametrize("command", ["report", "bench"])
def test_out_that_is_a_file_or_unwritable(tmp_path, capsys, unwritable_dir, command, no_gpu):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    args = ["--params", "smoke", "--notebooks", "02"] if command == "report" else []
    for out in (a_file, a_file / "sub"):
        assert "not a directory" in _usage_error(capsys, [command, *args, "--out", str(out)])
    err = _usage_error(capsys, [command, *args, "--out", str(unwritable_dir / "pagedwindow-test" / "r")])
    if command == "report":
        assert "output directory" in err


@pytest.mark.parametrize("label", ["/../../x", "a/b", "a\\b", "..", "a..b", "with space", "caf\u00e9", "", "x" * 65])
def test_bench_label_cannot_escape_out(tmp_path, capsys, no_gpu, label):
    out = tmp_path / "results"
    assert "--label" in _usage_error(capsys, ["bench", "--out", str(out), "--label", label])
    assert not out.exists()


def test_bench_names_tile_and_gpu(tmp_path, capsys, no_gpu):
    out = str(tmp_path / "results")
    assert "unknown workload" in _usage_error(capsys, ["bench", "--out", out, "--workloads", "nope"])
    assert "unknown system" in _usage_error(capsys, ["bench", "--out", out, "--systems", "nope"])
    assert "--cta-tile-q 32" in _usage_error(capsys, ["bench", "--out", out, "--cta-tile-q", "32"])
    assert "CUDA GPU" in _usage_error(capsys, ["bench", "--out", out, "--label", "v1.sm90_x-2", "--quick"])
    assert not Path(out).exists()


def test_bench_takes_sweep_points_by_name(tmp_path, capsys, no_gpu):
    """A sweep point's name passes the name check (the GPU check refuses next); a malformed one does not, nor
    does a sweep name under --prep."""
    out = str(tmp_path / "results")
    names = ["decode_b1_kv4096_w1023", "sweep_decode_b4_n1_c4095_p16_w1023", "prefill_1x8192"]
    assert "CUDA GPU" in _usage_error(capsys, ["bench", "--out", out, "--workloads", *names])
    for bad in ("decode_b1_kv4096", "decode_b0_kv4096_w1023", "sweep_decode_b4_n1_c4095_p16"):
        err = _usage_error(capsys, ["bench", "--out", out, "--workloads", bad])
        assert f"unknown workload(s) ['{bad}']" in err and "decode_b<batch>_kv<keys>_w<window>" in err
    err = _usage_error(capsys, ["bench", "--prep", "--out", out, "--workloads", "decode_b1_kv4096_w1023"])
    assert "unknown workload(s)" in err and "prep_8192" in err
    assert not Path(out).exists()


@pytest.mark.parametrize("label", ["../x", "a/b", "sp ace"])
def test_variant_labels_are_file_names(label):
    declared = {"01_a": {"x", "out_dir"}}
    with pytest.raises(report.ReportUsageError, match="label"):
        report.plan_runs({"01_a": {"variants": {label: {}}}}, declared, ["01_a"])
    assert [r.name for r in report.plan_runs({"01_a": {"variants": {"bf16": {}, 2: {}}}}, declared, ["01_a"])] == [
        "01_a-bf16",
        "01_a-2",
    ]


# -- doctor --------------------------------------------------------------------------------------------------------
def test_doctor_on_a_cpu_machine_builds_nothing(tmp_path, capsys, monkeypatch, no_gpu):
    from pagedwindow.cuda import build

    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGEDWINDOW_CACHE_DIR", str(cache))
    monkeypatch.setattr(build, "build_shared_library", lambda *a: pytest.fail("doctor built the kernels"))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and "nvcc: " in out and f"kernel cache: {cache}" in out
    assert "no GPU: backend='auto' runs the PyTorch reference" in out
    assert not cache.exists()

    def missing():
        raise build.BuildError("nvcc not found: set PAGEDWINDOW_NVCC or CUDA_HOME, or put nvcc on PATH")

    monkeypatch.setattr(build, "find_nvcc", missing)
    assert main(["doctor"]) == 0
    assert "nvcc: not found: set PAGEDWINDOW_NVCC" in capsys.readouterr().out


def test_doctor_names_the_kernel_auto_would_use(tmp_path, capsys, monkeypatch):
    """A pretend Hopper GPU: the sm_90a target, the wgmma launcher, the library not built yet."""
    from pagedwindow.cuda import build

    monkeypatch.setenv("PAGEDWINDOW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PAGEDWINDOW_PREFILL_KERNEL", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "Pretend H200")
    monkeypatch.setattr(build, "find_nvcc", lambda: "/opt/cuda/bin/nvcc")
    monkeypatch.setattr(build, "nvcc_version", lambda nvcc: "Cuda compilation tools, release 12.8, V12.8.93")
    monkeypatch.setattr(build, "build_shared_library", lambda *a: pytest.fail("doctor built the kernels"))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "GPU 0: Pretend H200, compute capability 9.0 (target sm_90a)" in out
    assert "prefill kernel for backend='auto': wgmma (pw_prefill_hd256_bf16_sm90)" in out
    assert "nvcc: /opt/cuda/bin/nvcc (Cuda compilation tools, release 12.8, V12.8.93)" in out
    assert "not built yet" in out and not (tmp_path / "cache").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-machine output")
def test_doctor_via_python_m_on_a_cpu_machine():
    proc = _python_m("doctor")
    assert proc.returncode == 0, proc.stderr
    assert "nvcc" in proc.stdout and "kernel cache:" in proc.stdout
    assert "no GPU: backend='auto' runs the PyTorch reference" in proc.stdout


@pytest.mark.cuda
def test_doctor_build_on_a_gpu_reports_the_library_and_the_kv_copy_path(capsys):
    """On Hopper the wgmma kernel copies K/V by bulk tensor copies at page 16 and by cp.async at page 5; the
    mma.sync kernel always by cp.async."""
    assert main(["doctor", "--build"]) == 0
    out = capsys.readouterr().out
    assert "built or verified and loaded" in out and "(built and verified;" in out
    assert "call gate: " in out and "(loaded; eager calls check and launch in one C call)" in out
    hopper = torch.cuda.get_device_capability() == (9, 0) and settings.prefill_kernel() != "mma_sync"
    assert f"K/V copy path, bf16 pool of page 16, 8 KV heads: {'tma' if hopper else 'cp.async'}" in out
    assert "K/V copy path, bf16 pool of page 5, 8 KV heads: cp.async" in out
