"""JIT build of the CUDA kernels in ``kernels/``: plain nvcc (no torch headers), content-hashed cache.

One shared library holds every kernel. Its cache key hashes the sources, the nvcc flags, the target and nvcc's
version, so any change rebuilds. Builds take a file lock, compile into a temporary directory and publish it with
an atomic rename; the ptxas resource report is kept beside the library (``ptxas.txt``). The cache lives in
``$PAGEDWINDOW_CACHE_DIR`` (default ``~/.cache/pagedwindow``); ``$PAGEDWINDOW_NVCC`` names the compiler and
``$PAGEDWINDOW_NVCC_FLAGS`` adds flags.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

KERNELS_DIR = Path(os.environ.get("PAGEDWINDOW_KERNELS_DIR", Path(__file__).resolve().parents[3] / "kernels"))
SOURCES = ("prefill_hd256.cu", "prefill_hd256_sm90.cu", "append_paged_kv.cu")
COMMON_FLAGS = ("-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr", "-Xptxas=-v,--warn-on-spills",
                *os.environ.get("PAGEDWINDOW_NVCC_FLAGS", "").split())
"""nvcc flags of every build; ``$PAGEDWINDOW_NVCC_FLAGS`` appends more (e.g. a kernel variant's -D for a benchmark);
they are part of the cache key."""
CI_TARGETS = ("sm_80", "sm_89", "sm_90a")


class BuildError(RuntimeError):
    """nvcc is missing or failed; the message carries its output."""


def gencode(target: str) -> str:
    """``sm_90a`` -> ``-gencode=arch=compute_90a,code=sm_90a`` (the form that assembles wgmma/setmaxnreg)."""
    num = target.removeprefix("sm_")
    return f"-gencode=arch=compute_{num},code=sm_{num}"


def target_for_capability(major: int, minor: int) -> str:
    """The running GPU's target; Hopper gets the arch-specific ``sm_90a``."""
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


def find_nvcc() -> str:
    candidates = [os.environ.get("PAGEDWINDOW_NVCC"), shutil.which("nvcc")]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidates.append(str(Path(cuda_home) / "bin" / "nvcc"))
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    raise BuildError("nvcc not found: set PAGEDWINDOW_NVCC or CUDA_HOME, or put nvcc on PATH")


def nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout.strip()


def source_paths() -> list[Path]:
    paths = [KERNELS_DIR / name for name in SOURCES]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise BuildError(f"kernel sources missing: {missing}")
    return paths


def cache_root() -> Path:
    return Path(os.environ.get("PAGEDWINDOW_CACHE_DIR", Path.home() / ".cache" / "pagedwindow"))


def build_key(target: str, nvcc: str) -> str:
    h = hashlib.sha256()
    for path in source_paths():
        h.update(path.name.encode())
        h.update(path.read_bytes())
    for header in sorted(KERNELS_DIR.glob("*.cuh")):
        h.update(header.name.encode())
        h.update(header.read_bytes())
    h.update(" ".join(COMMON_FLAGS).encode())
    h.update(target.encode())
    h.update(nvcc_version(nvcc).encode())
    return h.hexdigest()[:20]


def build_shared_library(target: str) -> Path:
    """Build (or find in the cache) the kernels' shared library for ``target``; returns its path."""
    nvcc = find_nvcc()
    key = build_key(target, nvcc)
    final = cache_root() / f"{target}-{key}"
    library = final / "libpagedwindow_kernels.so"
    if library.is_file():
        return library
    cache_root().mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_root() / f"{target}-{key}.lock")):
        if library.is_file():  # another process built it while we waited
            return library
        staging = Path(tempfile.mkdtemp(prefix=f".{target}-{key}-", dir=cache_root()))
        cmd = [nvcc, *COMMON_FLAGS, gencode(target), "-shared", "-Xcompiler", "-fPIC",
               "-o", str(staging / library.name), *map(str, source_paths())]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        (staging / "ptxas.txt").write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
        if proc.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise BuildError(f"nvcc failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        os.replace(staging, final)  # atomic publish: readers see a whole directory or none
    return library


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
            found.append(KernelResources(current[1], current[0], int(m.group(1)), frame[1], frame[2], frame[0],
                                         int(m.group(2) or 0)))
            current = None
    return found


def compile_for_targets(targets=CI_TARGETS, out_dir: Path | None = None) -> tuple[list[KernelResources], str]:
    """Compile every kernel to a cubin per target (the CI gate); returns the resources and the raw report."""
    nvcc = find_nvcc()
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="pagedwindow-gate-"))
    report, resources = [], []
    for target in targets:
        for path in source_paths():
            cmd = [nvcc, *COMMON_FLAGS, gencode(target), "-cubin", "-o", str(out_dir / f"{path.stem}.{target}.cubin"),
                   str(path)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            text = proc.stdout + proc.stderr
            report.append(f"$ {' '.join(cmd)}\n{text}")
            if proc.returncode != 0:
                raise BuildError(f"nvcc failed for {path.name} on {target}:\n{text[-4000:]}")
            resources.extend(parse_ptxas_report(text))
    return resources, "\n".join(report)
