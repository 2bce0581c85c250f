"""``pagedwindow.settings``: the one reader of the environment, read at call time, listed in the README."""

import ast
import re
from pathlib import Path

from pagedwindow import settings
from pagedwindow.cuda import build, ops

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "pagedwindow"


def test_every_pagedwindow_variable_anywhere_in_the_tree_is_a_setting():
    known = {s.name for s in settings.SETTINGS}
    paths = [
        p
        for pattern in (
            "src/**/*.py",
            "tests/**/*.py",
            "benchmarks/*.py",
            "benchmarks/*.sh",
            "notebooks/*.ipynb",
            "*.md",
            "*/*.md",
            "Makefile",
        )
        for p in REPO.glob(pattern)
    ]
    named = {
        (m, p.relative_to(REPO).as_posix())
        for p in paths
        for m in re.findall(r"\bPAGEDWINDOW_[A-Z0-9_]+\b", p.read_text(encoding="utf-8"))
    }
    assert named, "the scan found no variable at all"
    assert sorted((m, path) for m, path in named if m not in known) == []


def test_only_the_settings_module_reads_the_environment():
    """One exception: the report sets variables for the notebooks it runs (by the settings' names) and restores
    them after, in ``_kernel_environment``."""
    touching = {
        p.relative_to(SRC).as_posix(): p for p in SRC.rglob("*.py") if re.search(r"os\.environ|getenv", p.read_text())
    }
    assert set(touching) == {"settings.py", "report.py"}, sorted(touching)
    tree = ast.parse(touching["report.py"].read_text())
    (setter,) = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "_kernel_environment"]
    lines = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "environ"]
    assert lines and all(setter.lineno <= line <= setter.end_lineno for line in lines)


def test_the_readme_lists_every_setting_with_its_default_and_meaning():
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| `([A-Z_]+)` \| (.*?) \| (.*?) \|$", readme, re.M)
    assert rows == [(s.name, s.default, s.doc) for s in settings.SETTINGS]


def test_settings_are_read_when_asked_for(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGEDWINDOW_PREFILL_KERNEL", raising=False)
    assert settings.prefill_kernel() == "auto" and ops.prefill_entry("sm_90a") == "pw_prefill_hd256_bf16_sm90"
    monkeypatch.setenv("PAGEDWINDOW_PREFILL_KERNEL", "mma_sync")
    assert settings.prefill_kernel() == "mma_sync" and ops.prefill_entry("sm_90a") == "pw_prefill_hd256_bf16"

    monkeypatch.setenv("PAGEDWINDOW_CACHE_DIR", str(tmp_path / "a"))
    assert build.cache_root() == tmp_path / "a"
    monkeypatch.delenv("PAGEDWINDOW_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert build.cache_root() == tmp_path / "home" / ".cache" / "pagedwindow"

    monkeypatch.setenv("PAGEDWINDOW_NVCC_FLAGS", "-DA=1 '-DB=two words'")
    assert build.nvcc_flags()[-2:] == ["-DA=1", "-DB=two words"]
    monkeypatch.setenv("NVCC_CCBIN", "/opt/gcc")
    monkeypatch.delenv("NVCC_APPEND_FLAGS", raising=False)
    environment = settings.nvcc_environment()
    assert environment["NVCC_CCBIN"] == "/opt/gcc" and environment["NVCC_APPEND_FLAGS"] is None
    assert build.NVCC_ENVIRONMENT == tuple(environment)


def test_empty_values(monkeypatch):
    """An empty value counts as unset where the code always treated it so (paths, nvcc, the commit), and as
    given where it did not (the prefill kernel: an error; MPLBACKEND: set)."""
    for name in (
        "PAGEDWINDOW_NVCC",
        "PAGEDWINDOW_KERNELS_DIR",
        "PAGEDWINDOW_NOTEBOOKS",
        "PAGEDWINDOW_REPO",
        "PAGEDWINDOW_COMMIT",
        "CUDA_HOME",
        "CUDA_PATH",
        "PAGEDWINDOW_PREFILL_KERNEL",
        "MPLBACKEND",
    ):
        monkeypatch.setenv(name, "")
    assert (
        settings.nvcc(),
        settings.kernels_dir(),
        settings.notebooks_dir(),
        settings.repo_dir(),
        settings.commit(),
    ) == (None,) * 5
    assert settings.cuda_home() == Path("/usr/local/cuda")
    assert settings.prefill_kernel() == "" and settings.mpl_backend() == ""
    monkeypatch.setenv("CUDA_PATH", "/opt/cuda")
    assert settings.cuda_home() == Path("/opt/cuda")
    monkeypatch.setenv("PAGEDWINDOW_REQUIRE_GPU", "yes")
    assert not settings.require_gpu()
    monkeypatch.setenv("PAGEDWINDOW_REQUIRE_GPU", "1")
    assert settings.require_gpu()
