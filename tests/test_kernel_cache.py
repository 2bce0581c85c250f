"""The JIT cache on a CPU: where the sources come from, what the key covers, and a cache that heals.

Builds go through a wrapper around the real nvcc that logs each call, so a test can tell a rebuild from a cache
hit. Most tests build a one-file stub library (about a second); the ``ops.library`` healing test builds the real
kernels for sm_80.
"""

import ctypes
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

import pagedwindow
from pagedwindow import api, cuda, settings
from pagedwindow.cuda import build, host_pass, ops
from pagedwindow.cuda.build import BuildError

REPO = Path(__file__).resolve().parents[1]
TARGET = "sm_80"
STUB = 'extern "C" int pw_stub(void) { return STUB_VALUE; }\n'


def real_nvcc() -> str:
    try:
        return build.find_nvcc()
    except BuildError as exc:
        pytest.skip(f"nvcc is not installed here ({exc}); the cache tests need it to build")


def c_compiler() -> str:
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (gcc or cc) to build a library without the kernels")
    return compiler


def write_script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def env(monkeypatch, tmp_path):
    """A private cache, and none of the variables of the key set from outside (monkeypatch restores them)."""
    monkeypatch.setenv("PAGEDWINDOW_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("PAGEDWINDOW_NVCC_FLAGS", "PAGEDWINDOW_KERNELS_DIR", *build.NVCC_ENVIRONMENT):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


@pytest.fixture
def nvcc_log(env, monkeypatch):
    """``$PAGEDWINDOW_NVCC`` -> a wrapper of the real nvcc that logs its arguments; returns the log's path."""
    log = env / "nvcc.log"
    log.touch()
    wrapper = write_script(
        env / "bin" / "nvcc",
        f"""\
        echo "$*" >> {log}
        exec {real_nvcc()} "$@"
        """,
    )
    monkeypatch.setenv("PAGEDWINDOW_NVCC", str(wrapper))
    return log


def builds(log: Path) -> int:
    """How many library builds nvcc ran (``--version`` calls for the key are not builds)."""
    return sum("-shared" in line for line in log.read_text().splitlines())


@pytest.fixture
def stub(env, monkeypatch, nvcc_log):
    """A one-file kernels directory (``$PAGEDWINDOW_KERNELS_DIR``): a library with one symbol, fast to build."""
    kernels = env / "kernels"
    kernels.mkdir()
    (kernels / "stub.cuh").write_text("#define STUB_VALUE 42\n")
    (kernels / "stub.cu").write_text('#include "stub.cuh"\n' + STUB)
    monkeypatch.setenv("PAGEDWINDOW_KERNELS_DIR", str(kernels))
    monkeypatch.setattr(build, "SOURCES", ("stub.cu",))
    return kernels


def entry_dir(target=TARGET) -> Path:
    return build.cache_root() / f"{target}-{build.build_key(target, build.find_nvcc())}"


def manifest_of(library: Path) -> dict:
    return json.loads((library.parent / build.MANIFEST).read_text())


def assert_verified(library: Path) -> None:
    manifest = manifest_of(library)
    data = library.read_bytes()
    assert manifest["library"] == library.name
    assert (manifest["size"], manifest["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
    assert library.name == f"{build.LIBRARY_STEM}-{manifest['sha256'][:16]}.so"


def staging_dirs() -> list[Path]:
    return sorted(p for p in build.cache_root().iterdir() if p.name.startswith("."))


# -- where the sources come from ----------------------------------------------------------------------------------


def test_sources_come_from_the_override_then_the_package_then_the_repository(env, monkeypatch, tmp_path):
    monkeypatch.setattr(build, "PACKAGE_KERNELS_DIR", tmp_path / "not-installed")
    assert build.kernels_dir() == build.REPO_KERNELS_DIR == REPO / "kernels"  # an editable install
    installed = tmp_path / "site" / "pagedwindow" / "kernels"
    installed.mkdir(parents=True)
    for name in build.SOURCES:
        (installed / name).write_text("")
    monkeypatch.setattr(build, "PACKAGE_KERNELS_DIR", installed)
    assert build.kernels_dir() == installed  # the installed package wins over the repository
    assert [p.parent for p in build.source_paths()] == [installed] * len(build.SOURCES)
    monkeypatch.setenv("PAGEDWINDOW_KERNELS_DIR", str(REPO / "kernels"))
    assert build.kernels_dir() == REPO / "kernels"  # and the override over both


def test_missing_sources_name_every_place_looked(env, monkeypatch, tmp_path):
    monkeypatch.setattr(build, "PACKAGE_KERNELS_DIR", tmp_path / "nowhere")
    monkeypatch.setattr(build, "REPO_KERNELS_DIR", tmp_path / "neither")
    with pytest.raises(BuildError, match="nowhere.*neither.*PAGEDWINDOW_KERNELS_DIR"):
        build.source_paths()
    monkeypatch.setenv("PAGEDWINDOW_KERNELS_DIR", str(tmp_path / "empty"))
    with pytest.raises(BuildError, match="missing"):  # an override never falls back silently
        build.source_paths()


# -- the key --------------------------------------------------------------------------------------------------------


def test_the_key_changes_with_every_input_of_the_build(env, monkeypatch, tmp_path):
    kernels = tmp_path / "kernels"
    shutil.copytree(REPO / "kernels", kernels)
    monkeypatch.setenv("PAGEDWINDOW_KERNELS_DIR", str(kernels))
    nvcc = write_script(tmp_path / "nvcc", 'echo "Cuda compilation tools, release 13.0, V13.0.88"\n')
    key = lambda target=TARGET, compiler=nvcc: build.build_key(target, str(compiler))  # noqa: E731
    seen = {key()}

    def changes(what):
        new = key()
        assert new not in seen, f"the key did not change with {what}"
        seen.add(new)

    assert key() == key()  # stable when nothing changes
    monkeypatch.setenv("SOME_UNRELATED_VARIABLE", "1")
    assert key() in seen
    for name in ("PAGEDWINDOW_NVCC_FLAGS", *build.NVCC_ENVIRONMENT):
        monkeypatch.setenv(name, "-DPW_KEY_TEST=1")
        changes(name)
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-DPW_KEY_TEST=2")
    changes("NVCC_APPEND_FLAGS's value")
    for path in sorted([*kernels.glob("*.cu"), *kernels.glob("*.cuh")]):
        path.write_text(path.read_text() + "\n// edited\n")
        changes(path.name)
    (kernels / "new_header.cuh").write_text("#pragma once\n")
    changes("a new header")
    assert key("sm_90a") not in seen and key("sm_89") != key("sm_90a")
    write_script(nvcc, 'echo "Cuda compilation tools, release 13.1, V13.1.0"\n')
    changes("nvcc's version")
    other = write_script(tmp_path / "other" / "nvcc", f'exec {nvcc} "$@"\n')
    assert key(compiler=other) not in seen, "the key did not change with nvcc's path"


def test_flags_are_read_at_build_time(stub, nvcc_log, monkeypatch):
    first = build.build_shared_library(TARGET)
    monkeypatch.setenv("PAGEDWINDOW_NVCC_FLAGS", "-DPW_LATE_FLAG=1")
    assert "-DPW_LATE_FLAG=1" in build.nvcc_flags()
    second = build.build_shared_library(TARGET)
    assert second.parent != first.parent and builds(nvcc_log) == 2
    assert "-DPW_LATE_FLAG=1" in nvcc_log.read_text().splitlines()[-1]
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-DPW_APPENDED=1")  # nvcc reads it itself; only the key shows it
    third = build.build_shared_library(TARGET)
    assert third.parent not in (first.parent, second.parent) and builds(nvcc_log) == 3
    assert manifest_of(third)["inputs"]["environment"]["NVCC_APPEND_FLAGS"] == "-DPW_APPENDED=1"
    monkeypatch.delenv("NVCC_APPEND_FLAGS")
    monkeypatch.delenv("PAGEDWINDOW_NVCC_FLAGS")
    assert build.build_shared_library(TARGET) == first and builds(nvcc_log) == 3  # back to the first entry


# -- a cache that heals ----------------------------------------------------------------------------------------------


def test_a_build_publishes_a_verified_library_and_later_calls_hit_the_cache(stub, nvcc_log):
    library = build.build_shared_library(TARGET)
    assert_verified(library)
    assert library.parent == entry_dir() and (library.parent / "ptxas.txt").is_file()
    assert staging_dirs() == []
    assert ctypes.CDLL(str(library)).pw_stub() == 42
    assert build.build_shared_library(TARGET) == library and builds(nvcc_log) == 1


def _truncate(library):
    library.write_bytes(library.read_bytes()[: library.stat().st_size // 2])


def _flip_a_byte(library):
    data = bytearray(library.read_bytes())
    data[len(data) // 2] ^= 0xFF
    library.write_bytes(bytes(data))


def _foreign_manifest(library):
    manifest = manifest_of(library)
    manifest["key"] = "0" * 20  # an entry copied from another build
    (library.parent / build.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "damage",
    [
        _truncate,
        _flip_a_byte,
        _foreign_manifest,
        lambda library: (library.parent / build.MANIFEST).unlink(),
        lambda library: (library.parent / build.MANIFEST).write_text("{not json"),
        lambda library: library.unlink(),
    ],
    ids=["truncated", "modified", "foreign-manifest", "no-manifest", "garbled-manifest", "no-library"],
)
def test_a_damaged_entry_is_rebuilt(stub, nvcc_log, damage):
    library = build.build_shared_library(TARGET)
    damage(library)
    healed = build.build_shared_library(TARGET)
    assert builds(nvcc_log) == 2, "nvcc did not run again"
    assert_verified(healed)
    assert healed.parent == library.parent and staging_dirs() == []
    assert ctypes.CDLL(str(healed)).pw_stub() == 42
    assert build.build_shared_library(TARGET) == healed and builds(nvcc_log) == 2  # and stays healed


def test_a_directory_without_its_library_is_replaced(stub, nvcc_log):
    entry = entry_dir()
    (entry / "junk").mkdir(parents=True)  # not empty: os.replace onto it would fail with ENOTEMPTY
    (entry / "ptxas.txt").write_text("from a build that never finished\n")
    library = build.build_shared_library(TARGET)
    assert_verified(library)
    assert sorted(p.name for p in entry.iterdir()) == sorted([library.name, build.MANIFEST, "ptxas.txt"])


def test_a_killed_builds_staging_directory_never_blocks_a_build(stub, nvcc_log):
    entry = entry_dir()
    leftover = entry.with_name(f".{entry.name}-killed")
    leftover.mkdir(parents=True)
    (leftover / f"{build.LIBRARY_STEM}.so").write_bytes(b"\x7fELF half written")
    library = build.build_shared_library(TARGET)
    assert_verified(library)
    assert staging_dirs() == []  # swept under the lock: no one else was building this key


def test_a_failed_build_publishes_nothing_and_a_fixed_source_builds(stub, nvcc_log):
    (stub / "stub.cu").write_text("this is not C++\n")
    with pytest.raises(BuildError, match="nvcc failed"):
        build.build_shared_library(TARGET)
    assert [p for p in build.cache_root().iterdir() if p.is_dir()] == []
    (stub / "stub.cu").write_text('#include "stub.cuh"\n' + STUB)
    assert_verified(build.build_shared_library(TARGET))


def forge_entry(target: str, tmp_path: Path) -> Path:
    """Put a library with no kernels in it (but a manifest that matches it) where ``target``'s entry belongs:
    the cache verifies it, and only loading it can tell."""
    source = tmp_path / "empty.c"
    source.write_text("int pw_nothing_here;\n")
    empty = tmp_path / "empty.so"
    subprocess.run([c_compiler(), "-shared", "-fPIC", "-o", str(empty), str(source)], check=True)
    nvcc = build.find_nvcc()
    inputs = build.build_inputs(target, nvcc)
    entry = build.cache_root() / f"{target}-{build.build_key(target, nvcc)}"
    entry.mkdir(parents=True)
    library = entry / f"{build.LIBRARY_STEM}-{hashlib.sha256(empty.read_bytes()).hexdigest()[:16]}.so"
    shutil.copyfile(empty, library)
    build.write_manifest(entry, library, build.build_key(target, nvcc), inputs)
    assert build.build_shared_library(target) == library  # it passes the cache's own check
    return library


def test_a_library_that_does_not_load_is_rebuilt_once(stub, nvcc_log, tmp_path):
    forged = forge_entry(TARGET, tmp_path)
    loads = []

    def loader(path):
        loads.append(path)
        return ctypes.CDLL(str(path)).pw_stub  # AttributeError on the forged one: no such symbol

    assert build.load_verified(TARGET, loader)() == 42
    # a new path: for the path it has already opened, dlopen would hand back the forged library again
    assert loads[0] == forged and loads[1] != forged and builds(nvcc_log) == 1
    assert_verified(loads[1])


def test_a_library_that_never_loads_raises_oserror_after_one_rebuild(stub, nvcc_log):
    def loader(path):
        raise OSError(f"{path}: cannot load")

    with pytest.raises(OSError, match="even after a rebuild"):
        build.load_verified(TARGET, loader)
    assert builds(nvcc_log) == 2  # the first build, then exactly one rebuild


@pytest.fixture
def fake_gpu(monkeypatch):
    """``ops.library`` and ``cuda.available`` as on a machine with an sm_80 GPU, with nothing loaded yet."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(ops, "_libraries", {})
    monkeypatch.setattr(ops, "_by_device", {})
    monkeypatch.setattr(cuda, "_load_state", {})


@pytest.mark.slow
def test_ops_library_heals_a_cached_library_that_lacks_the_kernels(
    env, nvcc_log, fake_gpu, tmp_path, caplog, monkeypatch
):
    forged = forge_entry(TARGET, tmp_path)
    lib = ops.library(torch.device("cuda", 0))
    assert builds(nvcc_log) == 1, "the forged library was not rebuilt"
    assert lib.pw_prefill_launch_size() == ctypes.sizeof(ops.PrefillLaunch)
    assert lib.prefill.__name__ == "pw_prefill_hd256_bf16"
    healed = build.build_shared_library(TARGET)
    assert healed != forged and not forged.exists()
    assert_verified(healed)
    # the backend's first look at the kernels logs which prefill kernel this device runs, and why
    monkeypatch.delenv("PAGEDWINDOW_PREFILL_KERNEL", raising=False)
    caplog.set_level(logging.INFO, logger="pagedwindow")
    assert cuda.unavailable_reason() is None
    assert messages(caplog, "pagedwindow.cuda") == [
        "CUDA kernels loaded for cuda:0; prefill kernel: mma.sync (the default for this architecture)"
    ]


# -- auto's fallback is visible ---------------------------------------------------------------------------------------


def test_a_failed_build_is_the_reason_the_kernels_are_unavailable(env, fake_gpu, monkeypatch):
    broken = write_script(
        env / "nvcc",
        """\
        case "$*" in *--version*) echo "Cuda compilation tools, release 13.0"; exit 0;; esac
        echo "nvcc fatal   : pretend the toolkit is broken" >&2; exit 1
        """,
    )
    monkeypatch.setenv("PAGEDWINDOW_NVCC", str(broken))
    reason = cuda.unavailable_reason()
    assert reason is not None and "pretend the toolkit is broken" in reason
    assert not cuda.available()
    with pytest.raises(pagedwindow.PagedWindowError, match="pretend the toolkit is broken"):
        cuda.require()


def test_a_library_that_does_not_load_is_the_reason(env, fake_gpu, monkeypatch):
    fake = write_script(
        env / "nvcc",
        f"""\
        case "$*" in *--version*) echo "Cuda compilation tools, release 13.0"; exit 0;; esac
        for a in "$@"; do case "$prev" in -o) out="$a";; esac; prev="$a"; done
        echo 'int pw_nothing_here;' > "$out.c" && exec {c_compiler()} -shared -fPIC -o "$out" "$out.c"
        """,
    )  # "builds" a library without the kernels' symbols
    monkeypatch.setenv("PAGEDWINDOW_NVCC", str(fake))
    reason = cuda.unavailable_reason()
    assert reason is not None and "even after a rebuild" in reason and "pw_prefill_hd256_bf16" in reason


# -- what the "pagedwindow" loggers say --------------------------------------------------------------------------------


def messages(caplog, logger: str, level: int = logging.DEBUG) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno >= level]


def test_the_package_logger_is_silent_unless_configured():
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("pagedwindow").handlers)


def test_a_build_its_time_and_a_cache_hit_are_logged(stub, nvcc_log, caplog):
    caplog.set_level(logging.DEBUG, logger="pagedwindow")
    library = build.build_shared_library(TARGET)
    logged = messages(caplog, "pagedwindow.cuda.build", logging.INFO)
    assert len(logged) == 3 and logged[0].startswith(f"kernel cache miss: no {library.parent.name} in ")
    assert logged[1].startswith(f"building the kernels for {TARGET} with ")
    assert re.fullmatch(rf"built the kernels for {TARGET} in \d+\.\d s: {re.escape(str(library))}", logged[2])
    caplog.clear()
    assert build.build_shared_library(TARGET) == library and builds(nvcc_log) == 1
    assert messages(caplog, "pagedwindow.cuda.build") == [f"kernel cache hit: {library}"]


def test_healing_a_broken_cache_entry_is_logged(stub, nvcc_log, caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="pagedwindow")
    _truncate(build.build_shared_library(TARGET))
    caplog.clear()
    build.build_shared_library(TARGET)
    assert "does not match its manifest" in messages(caplog, "pagedwindow.cuda.build", logging.WARNING)[0]
    shutil.rmtree(build.cache_root())
    forged = forge_entry(TARGET, tmp_path)
    caplog.clear()
    build.load_verified(TARGET, lambda path: ctypes.CDLL(str(path)).pw_stub)
    warned = messages(caplog, "pagedwindow.cuda.build", logging.WARNING)
    assert len(warned) == 1 and warned[0].startswith(f"kernel cache: {forged} does not load (")
    assert f"kernel cache: discarding {forged}, which failed to load" in messages(caplog, "pagedwindow.cuda.build")


@pytest.fixture
def broken_nvcc(env, monkeypatch):
    """``$PAGEDWINDOW_NVCC``: an nvcc that reports a version and fails every build."""
    broken = write_script(
        env / "nvcc",
        """\
        case "$*" in *--version*) echo "Cuda compilation tools, release 13.0"; exit 0;; esac
        echo "nvcc fatal   : pretend the toolkit is broken" >&2; exit 1
        """,
    )
    monkeypatch.setenv("PAGEDWINDOW_NVCC", str(broken))


def test_a_failed_build_and_autos_fallback_are_logged(env, fake_gpu, broken_nvcc, monkeypatch, caplog):
    """A kernel build that fails makes backend "auto" run the reference: the failure, its time, the fallback
    and its reason are logged (once each; later fallbacks at DEBUG)."""
    monkeypatch.setattr(api, "_fallbacks_warned", set())
    caplog.set_level(logging.DEBUG, logger="pagedwindow")
    plan = pagedwindow.PrefillPagedPlan.single(
        [0], 4, 0, 4, num_qo_heads=2, num_kv_heads=1, head_dim=256, page_size=16, cta_tile_q=16
    )  # a tile: no device to ask
    choose = functools.partial(
        api._resolve_backend,
        "batch_prefill_paged_window",
        "auto",
        plan,
        torch.device("cuda", 0),
        torch.bfloat16,
        [0],
        0,
    )  # the device is all the choice reads first
    with pytest.warns(RuntimeWarning, match="runs the PyTorch reference on cuda:0"):
        assert choose() == "reference"
    assert re.fullmatch(
        r"building the kernels for sm_80 failed after \d+\.\d s",
        messages(caplog, "pagedwindow.cuda.build", logging.WARNING)[0],
    )
    (unavailable,) = messages(caplog, "pagedwindow.cuda", logging.WARNING)
    assert "backend 'cuda' is unavailable" in unavailable and "pretend the toolkit is broken" in unavailable
    (fallback,) = messages(caplog, "pagedwindow.api", logging.WARNING)
    assert fallback.startswith(
        "batch_prefill_paged_window: backend 'auto' runs the PyTorch reference on cuda:0: "
        "the CUDA kernels could not be built or loaded"
    )
    caplog.clear()
    assert choose() == "reference"
    assert messages(caplog, "pagedwindow.api", logging.WARNING) == []
    assert messages(caplog, "pagedwindow.api") == [fallback]  # at DEBUG from the second time on


def test_the_plans_fallback_to_the_numpy_pass_is_logged(env, fake_gpu, broken_nvcc, monkeypatch, caplog):
    monkeypatch.setattr(host_pass, "_failed", set())
    caplog.set_level(logging.WARNING, logger="pagedwindow")
    assert host_pass.library(torch.device("cuda", 0)) is None
    (logged,) = messages(caplog, "pagedwindow.cuda.host_pass")
    assert logged.startswith("the compiled plan pass is unavailable on cuda:0 (plans use the numpy pass): ")
    assert "pretend the toolkit is broken" in logged


# -- kernels ship in the package ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_built_wheel_ships_the_kernels_and_compiles_them(tmp_path):
    tree = tmp_path / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    for name in ("pyproject.toml", "README.md"):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tree / name)
    shutil.copytree(REPO / "src", tree / "src", ignore=ignore)
    shutil.copytree(REPO / "kernels", tree / "kernels", ignore=ignore)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    offline = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []  # else pip fetches it
    subprocess.run(
        [*pip, "wheel", "--no-deps", *offline, "-w", str(tmp_path / "wheels"), str(tree)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "wheels").glob("pagedwindow-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    package = REPO / "src" / "pagedwindow"
    modules = {
        f"pagedwindow/{p.relative_to(package).as_posix()}"
        for p in package.rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert modules <= names, (
        f"modules missing from the wheel (list new subpackages in pyproject.toml): {sorted(modules - names)}"
    )
    kernels = {p.name for p in (REPO / "kernels").iterdir() if p.suffix in (".cu", ".cuh", ".cpp")}
    assert {n.removeprefix("pagedwindow/kernels/") for n in names if n.startswith("pagedwindow/kernels/")} == kernels
    for name in kernels:
        assert zipfile.ZipFile(wheel).read(f"pagedwindow/kernels/{name}") == (REPO / "kernels" / name).read_bytes()

    site = tmp_path / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    environ = {k: v for k, v in os.environ.items() if k != "PAGEDWINDOW_KERNELS_DIR"}
    environ.update(PYTHONPATH=str(site), PAGEDWINDOW_CACHE_DIR=str(tmp_path / "cache"))

    def installed(code: str):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=environ)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1])

    found = installed(
        "import json, pagedwindow; from pagedwindow.cuda import build; "
        "print(json.dumps([pagedwindow.__file__, [str(p) for p in build.source_paths()]]))"
    )
    assert Path(found[0]).is_relative_to(site), f"the subprocess imported {found[0]}, not the installed wheel"
    assert found[1] and all(Path(p).is_relative_to(site / "pagedwindow" / "kernels") for p in found[1]), found[1]

    if shutil.which("nvcc") is None and settings.nvcc() is None:
        pytest.skip("nvcc is not installed: the installed sources resolve, but compiling them needs nvcc")
    resources = installed(
        "import json; from pagedwindow.cuda.build import compile_for_targets; "
        "r, report = compile_for_targets(['sm_80']); "
        "print(json.dumps([[x.target, x.function] for x in r]))"
    )
    functions = [f for t, f in resources if t == "sm_80"]
    assert any("prefill" in f for f in functions) and any("append" in f for f in functions), functions
