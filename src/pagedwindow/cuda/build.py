"""JIT build of the CUDA kernels: plain nvcc (no torch headers), a content-keyed cache that checks itself.

Sources come from ``$PAGEDWINDOW_KERNELS_DIR`` when set, else the installed package (``pagedwindow/kernels/``, what
a wheel ships), else the repository's ``kernels/`` (an editable install). One shared library holds every kernel.

The cache lives in ``$PAGEDWINDOW_CACHE_DIR`` (default ``~/.cache/pagedwindow``), one directory per build,
``<target>-<key>/``: ``libpagedwindow_kernels-<sha>.so``, ``manifest.json`` (the library's name, size and sha256,
and every input of the key) and ``ptxas.txt`` (the command and ptxas's resource report). The key hashes every
source and header, the nvcc flags (``$PAGEDWINDOW_NVCC_FLAGS`` included), the environment nvcc reads
(``NVCC_PREPEND_FLAGS``, ``NVCC_APPEND_FLAGS``, ``NVCC_CCBIN``), nvcc's path and version, and the target.

A build takes a file lock, compiles into a staging directory (``.<target>-<key>-*``), fsyncs the library and its
manifest there and publishes the directory with an atomic rename. A cached library is used only when its manifest
matches (size and sha256); anything else (truncated, modified, foreign, no manifest, no library, a killed build's
staging directory) is rebuilt. The library's name carries its hash, so a rebuilt library never aliases one this
process has already ``dlopen``-ed. ``$PAGEDWINDOW_NVCC`` names the compiler.

The logger ``pagedwindow.cuda.build`` records each build (its start, and its end with the seconds it took, or
its failure), cache hits (DEBUG) and misses, and every entry healed: one that does not match its manifest, one
that does not load, a killed build's staging directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from filelock import FileLock

from .. import settings

PACKAGE_KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"
"""Where a (non-editable) install puts the sources: ``pagedwindow/kernels/``, package data of the wheel."""
REPO_KERNELS_DIR = Path(__file__).resolve().parents[3] / "kernels"
"""The repository's ``kernels/``, the one copy of the sources (an editable install reads it directly)."""
SOURCES = (
    "prefill_hd256.cu",
    "prefill_hd256_sm90.cu",
    "decode_hd256.cu",
    "append_paged_kv.cu",
    "prepare_qkv.cu",
    "plan_check.cu",
    "plan_pack.cpp",
)
BASE_FLAGS = ("-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr", "-Xptxas=-v,--warn-on-spills")
NVCC_ENVIRONMENT = tuple(s.name for s in settings.NVCC_VARIABLES)
"""Environment variables nvcc itself reads; they change what it builds, so they are part of the cache key."""
CI_TARGETS = ("sm_80", "sm_89", "sm_90a")
LIBRARY_STEM = "libpagedwindow_kernels"
MANIFEST = "manifest.json"
CACHE_FORMAT = 2  # bump when the cache layout changes: every key changes with it

T = TypeVar("T")
_log = logging.getLogger(__name__)


class BuildError(RuntimeError):
    """nvcc or the kernel sources are missing, or nvcc failed; the message carries its output."""


def gencode(target: str) -> str:
    """``sm_90a`` -> ``-gencode=arch=compute_90a,code=sm_90a`` (the form that assembles wgmma/setmaxnreg)."""
    num = target.removeprefix("sm_")
    return f"-gencode=arch=compute_{num},code=sm_{num}"


def target_for_capability(major: int, minor: int) -> str:
    """The running GPU's target; Hopper gets the arch-specific ``sm_90a``."""
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


def nvcc_flags() -> list[str]:
    """The flags of every build, read now: ``BASE_FLAGS`` then ``$PAGEDWINDOW_NVCC_FLAGS`` (e.g. a kernel
    variant's -D for a benchmark)."""
    return [*BASE_FLAGS, *settings.nvcc_flags()]


def find_nvcc() -> str:
    candidates = [settings.nvcc(), shutil.which("nvcc"), str(settings.cuda_home() / "bin" / "nvcc")]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    raise BuildError("nvcc not found: set PAGEDWINDOW_NVCC or CUDA_HOME, or put nvcc on PATH")


def nvcc_version(nvcc: str) -> str:
    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        raise BuildError(f"{nvcc} --version failed: {exc}") from exc


def kernels_dir() -> Path:
    """The directory the sources are read from: ``$PAGEDWINDOW_KERNELS_DIR``, else the installed package's
    ``kernels/``, else the repository's."""
    override = settings.kernels_dir()
    if override is not None:
        return override
    for directory in (PACKAGE_KERNELS_DIR, REPO_KERNELS_DIR):
        if all((directory / name).is_file() for name in SOURCES):
            return directory
    raise BuildError(
        f"kernel sources {SOURCES} not found in {PACKAGE_KERNELS_DIR} (installed package) or "
        f"{REPO_KERNELS_DIR} (repository); set PAGEDWINDOW_KERNELS_DIR"
    )


def source_paths() -> list[Path]:
    """The sources compiled into the library (``.cu`` kernels, the ``.cpp`` host pass)."""
    directory = kernels_dir()
    paths = [directory / name for name in SOURCES]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise BuildError(f"kernel sources missing: {missing}")
    return paths


def cache_root() -> Path:
    return settings.cache_dir()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def build_inputs(target: str, nvcc: str) -> dict:
    """Everything the build depends on (hashed into the key and recorded in the manifest)."""
    directory = source_paths()[0].parent
    files = sorted([*directory.glob("*.cu"), *directory.glob("*.cuh"), *directory.glob("*.cpp")])  # every source
    return {
        "format": CACHE_FORMAT,
        "target": target,
        "nvcc": str(Path(nvcc).resolve()),
        "nvcc_version": nvcc_version(nvcc),
        "flags": nvcc_flags(),
        "environment": settings.nvcc_environment(),
        "files": file_hashes(files),
    }


def _key_of(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]


def cache_key(inputs: dict) -> str:
    """The cache key of a build whose inputs (sources' hashes, tools, flags) are ``inputs``."""
    return _key_of(inputs)


def file_hashes(paths) -> dict[str, str]:
    """``{name: sha256}`` of each file, for a build's inputs."""
    return {p.name: _sha256(p) for p in paths}


def build_key(target: str, nvcc: str) -> str:
    """The cache key of a build for ``target`` with ``nvcc`` (see ``build_inputs``)."""
    return _key_of(build_inputs(target, nvcc))


def _fsync(path: Path) -> None:
    """fsync a file, or a directory (best effort: some file systems refuse that)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def write_manifest(directory: Path, library: Path, key: str, inputs: dict) -> None:
    """Record ``library``'s name, size and sha256 (and the build's key and inputs) in ``directory``; fsynced."""
    manifest = {
        "library": library.name,
        "size": library.stat().st_size,
        "sha256": _sha256(library),
        "key": key,
        "inputs": inputs,
    }
    with open(directory / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def verified_library(directory: Path, key: str) -> Path | None:
    """The library in ``directory`` if its manifest is for ``key`` and its size and sha256 match; else None."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        name = manifest["library"]
        library = directory / name
        if manifest["key"] != key or Path(name).name != name or library.stat().st_size != manifest["size"]:
            return None
        return library if _sha256(library) == manifest["sha256"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _compile(nvcc: str, target: str, staging: Path, key: str, inputs: dict) -> Path:
    """Build the library into ``staging`` with its manifest and ptxas report, all fsynced; returns its path."""
    out = staging / f"{LIBRARY_STEM}.so"
    cmd = [
        nvcc,
        *inputs["flags"],
        gencode(target),
        "-shared",
        "-Xcompiler",
        "-fPIC",
        "-o",
        str(out),
        *map(str, source_paths()),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (staging / "ptxas.txt").write_text(shlex.join(cmd) + "\n" + proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise BuildError(f"nvcc failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    if not out.is_file():
        raise BuildError(f"nvcc exited 0 but wrote no {out.name}:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return seal(staging, out.rename(staging / f"{LIBRARY_STEM}-{_sha256(out)[:16]}.so"), key, inputs)


def seal(staging: Path, artifact: Path, key: str, inputs: dict) -> Path:
    """A staged build's last step: ``artifact`` fsynced, its manifest written beside it, the staging directory
    fsynced; returns ``artifact`` (what :func:`cached_build`'s ``compile_into`` returns)."""
    _fsync(artifact)
    write_manifest(staging, artifact, key, inputs)
    _fsync(staging)
    return artifact


def _publish(staging: Path, final: Path) -> None:
    """Make ``staging`` the cache entry ``final`` with an atomic rename. Whatever sits at ``final`` (a broken
    entry) is first renamed aside, so readers see the old entry or the new one, never a half-removed one."""
    if final.exists() or final.is_symlink():
        aside = final.with_name(f".{final.name}-stale-{uuid.uuid4().hex[:8]}")
        os.replace(final, aside)
        os.replace(staging, final)
        _remove(aside)
    else:
        os.replace(staging, final)
    _fsync(final.parent)


def build_shared_library(target: str, *, discard: Path | None = None) -> Path:
    """The kernels' shared library for ``target``: the cached one when it verifies, else a fresh build.

    ``discard`` is a library that failed to load: it is rebuilt unless another process already replaced it.
    """
    nvcc = find_nvcc()
    inputs = build_inputs(target, nvcc)
    key = _key_of(inputs)
    return cached_build(
        f"{target}-{key}",
        key,
        lambda staging: _compile(nvcc, target, staging, key, inputs),
        label="kernel",
        what=f"the kernels for {target}",
        tool=nvcc,
        discard=discard,
    )


def cached_build(
    entry: str,
    key: str,
    compile_into: Callable[[Path], Path],
    *,
    label: str,
    what: str,
    tool: str,
    discard: Path | None = None,
) -> Path:
    """The artifact of the cache entry ``<cache root>/<entry>`` when its manifest is for ``key`` and it verifies,
    else a fresh build: under the entry's file lock, ``compile_into(staging)`` builds into a staging directory
    (``.<entry>-*``: the artifact and its manifest, fsynced; it returns the artifact's path there), which is then
    published with an atomic rename. The protocol of every cached build (the kernels, the call gate). ``discard``:
    an artifact that failed to load, rebuilt unless another process already replaced it. ``label`` names the
    cache in the log ("kernel cache ..."), ``what`` and ``tool`` the build ("building <what> with <tool>")."""
    root = cache_root()
    final = root / entry
    artifact = verified_library(final, key)
    if artifact is not None and artifact != discard:
        _log.debug("%s cache hit: %s", label, artifact)
        return artifact
    if artifact is not None:
        _log.info("%s cache: discarding %s, which failed to load", label, artifact)
    elif final.exists():
        _log.warning(
            "%s cache: %s does not match its manifest (truncated, modified or incomplete); rebuilding it", label, final
        )
    else:
        _log.info("%s cache miss: no %s in %s", label, final.name, root)
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{entry}.lock")):
        artifact = verified_library(final, key)
        if artifact is not None and artifact != discard:  # another process built it while we waited
            _log.info("%s cache hit after waiting for another process's build: %s", label, artifact)
            return artifact
        for leftover in root.glob(f".{entry}-*"):  # a killed build's: no one else builds this key now
            _log.info("%s cache: removing %s, left by a build that did not finish", label, leftover)
            _remove(leftover)
        staging = Path(tempfile.mkdtemp(prefix=f".{entry}-", dir=root))
        _log.info("building %s with %s", what, tool)
        started = time.perf_counter()
        try:
            artifact = compile_into(staging)
            _publish(staging, final)
        except Exception:
            _log.warning("building %s failed after %.1f s", what, time.perf_counter() - started)
            raise
        finally:
            _remove(staging)  # already gone after a publish
    _log.info("built %s in %.1f s: %s", what, time.perf_counter() - started, final / artifact.name)
    return final / artifact.name


def load_verified(target: str, loader: Callable[[Path], T]) -> T:
    """``loader(build_shared_library(target))``, healing once: a library that fails to load (``OSError``, or
    ``AttributeError`` for a missing symbol) is rebuilt and loaded again. A second failure raises ``OSError``."""
    library = build_shared_library(target)
    try:
        return loader(library)
    except (OSError, AttributeError) as first:
        _log.warning("kernel cache: %s does not load (%s); rebuilding it once", library, first)
        rebuilt = build_shared_library(target, discard=library)
        try:
            return loader(rebuilt)
        except (OSError, AttributeError) as exc:
            raise OSError(
                f"{rebuilt} does not load even after a rebuild: {exc} (before the rebuild, {library}: {first})"
            ) from exc


@dataclass(frozen=True)
class KernelResources:
    """One kernel's ptxas report line for one target."""

    target: str
    function: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    shared_bytes: int


_FUNCTION = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_report(text: str) -> list[KernelResources]:
    """Resources per entry function from ``-Xptxas -v`` output."""
    found, current, frame = [], None, None
    for line in text.splitlines():
        if m := _FUNCTION.search(line):
            current, frame = (m.group(1), m.group(2)), None
        elif (m := _FRAME.search(line)) and current:
            frame = tuple(int(x) for x in m.groups())
        elif (m := _USED.search(line)) and current and frame:
            found.append(
                KernelResources(
                    current[1], current[0], int(m.group(1)), frame[1], frame[2], frame[0], int(m.group(2) or 0)
                )
            )
            current = None
    return found


def compile_for_targets(targets=CI_TARGETS, out_dir: Path | None = None) -> tuple[list[KernelResources], str]:
    """Compile every kernel to a cubin per target (the CI gate); returns the resources and the raw report."""
    nvcc = find_nvcc()
    flags = nvcc_flags()
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="pagedwindow-gate-"))
    report, resources = [], []
    for target in targets:
        for path in source_paths():
            cmd = [
                nvcc,
                *flags,
                gencode(target),
                "-cubin",
                "-o",
                str(out_dir / f"{path.stem}.{target}.cubin"),
                str(path),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            text = proc.stdout + proc.stderr
            report.append(f"$ {shlex.join(cmd)}\n{text}")
            if proc.returncode != 0:
                raise BuildError(f"nvcc failed for {path.name} on {target}:\n{text[-4000:]}")
            resources.extend(parse_ptxas_report(text))
    return resources, "\n".join(report)
