"""Every environment variable pagedwindow reads, in one place.

Each setting is read from ``os.environ`` when its accessor is called, never cached at import: a process (or a
test's ``monkeypatch``) may change it at any time and the next read sees the change. Modules read the
environment only through this module; the report sets some of these variables for the notebooks it runs, by
their names here. The README's table under "Settings and logs" lists the same variables (a test keeps the two
in step).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Setting:
    """One environment variable: its name, its default as the README states it, and what it means."""

    name: str
    default: str
    doc: str

    def get(self) -> str | None:
        """The variable's value now (an empty value as it is), None when it is unset."""
        return os.environ.get(self.name)

    def value(self) -> str | None:
        """The variable's value now, None when it is unset or empty."""
        return os.environ.get(self.name) or None


# -- the kernels: which one runs, how they are built, where they are cached -----------------------------------
PREFILL_KERNEL = Setting(
    "PAGEDWINDOW_PREFILL_KERNEL",
    "auto",
    "the prefill kernel: auto (wgmma on sm_90, mma.sync elsewhere), mma_sync or wgmma",
)
NVCC_FLAGS = Setting(
    "PAGEDWINDOW_NVCC_FLAGS",
    "(none)",
    "extra nvcc flags for every kernel build, split like a shell (e.g. a kernel variant's -D)",
)
NVCC = Setting("PAGEDWINDOW_NVCC", "nvcc on PATH, else $CUDA_HOME/bin/nvcc", "the nvcc that builds the kernels")
CUDA_HOME = Setting(
    "CUDA_HOME", "$CUDA_PATH, else /usr/local/cuda", "the CUDA toolkit whose bin/nvcc is used when nvcc is not on PATH"
)
CUDA_PATH = Setting("CUDA_PATH", "(unset)", "the CUDA toolkit, when CUDA_HOME is unset")
KERNELS_DIR = Setting(
    "PAGEDWINDOW_KERNELS_DIR",
    "the installed package's kernels/, else the repository's",
    "the directory the kernel sources are read from",
)
CACHE_DIR = Setting("PAGEDWINDOW_CACHE_DIR", "~/.cache/pagedwindow", "where built kernel libraries are cached")
CXX = Setting(
    "PAGEDWINDOW_CXX", "c++", "the host C++ compiler that builds the call gate (kernels/launch_gate.cpp) against torch"
)
NVCC_PREPEND_FLAGS = Setting(
    "NVCC_PREPEND_FLAGS", "(unset)", "nvcc's own: flags it puts first; part of the kernel cache key"
)
NVCC_APPEND_FLAGS = Setting(
    "NVCC_APPEND_FLAGS", "(unset)", "nvcc's own: flags it puts last; part of the kernel cache key"
)
NVCC_CCBIN = Setting("NVCC_CCBIN", "(unset)", "nvcc's own: the host compiler; part of the kernel cache key")
NVCC_VARIABLES = (NVCC_PREPEND_FLAGS, NVCC_APPEND_FLAGS, NVCC_CCBIN)
"""The variables nvcc itself reads: they change what it builds, so they are part of the cache key."""

# -- the report and its notebooks ------------------------------------------------------------------------------
NOTEBOOKS = Setting(
    "PAGEDWINDOW_NOTEBOOKS",
    "the checkout's notebooks/, else ./notebooks",
    "where pagedwindow report finds the notebooks and their params/",
)
REPO = Setting(
    "PAGEDWINDOW_REPO",
    "the checkout this package is imported from",
    "the repository notebooks resolve relative paths against (the report sets it for its notebooks)",
)
COMMIT = Setting(
    "PAGEDWINDOW_COMMIT",
    "the checkout's short sha (+dirty)",
    "the commit a report names, for a copy of the tree without .git",
)
MPLBACKEND = Setting(
    "MPLBACKEND",
    "Agg, except inside a notebook kernel",
    "matplotlib's own: when set, pagedwindow.viz keeps it (the report sets the inline backend)",
)

# -- the test suite ------------------------------------------------------------------------------------------
REQUIRE_GPU = Setting(
    "PAGEDWINDOW_REQUIRE_GPU",
    "(unset)",
    "1 makes the test suite fail its cuda tests on a machine without a GPU instead of skipping",
)

SETTINGS = (
    PREFILL_KERNEL,
    NVCC_FLAGS,
    NVCC,
    CUDA_HOME,
    CUDA_PATH,
    KERNELS_DIR,
    CACHE_DIR,
    CXX,
    *NVCC_VARIABLES,
    NOTEBOOKS,
    REPO,
    COMMIT,
    MPLBACKEND,
    REQUIRE_GPU,
)
"""Every setting, in the README's order."""


# -- typed reads (each reads the environment now) ------------------------------------------------------------
def prefill_kernel() -> str:
    """``$PAGEDWINDOW_PREFILL_KERNEL`` as given (``cuda.ops`` checks it), ``"auto"`` when unset."""
    value = PREFILL_KERNEL.get()
    return "auto" if value is None else value


def nvcc_flags() -> list[str]:
    """``$PAGEDWINDOW_NVCC_FLAGS`` split like a shell; empty when unset."""
    return shlex.split(NVCC_FLAGS.get() or "")


def nvcc() -> str | None:
    """``$PAGEDWINDOW_NVCC``, None when unset or empty."""
    return NVCC.value()


def cxx() -> str:
    """``$PAGEDWINDOW_CXX``, ``c++`` when unset or empty."""
    return CXX.value() or "c++"


def cuda_home() -> Path:
    """``$CUDA_HOME``, else ``$CUDA_PATH``, else ``/usr/local/cuda`` (empty values count as unset)."""
    return Path(CUDA_HOME.value() or CUDA_PATH.value() or "/usr/local/cuda")


def kernels_dir() -> Path | None:
    """``$PAGEDWINDOW_KERNELS_DIR``, None when unset or empty (the build then looks in its usual places)."""
    value = KERNELS_DIR.value()
    return None if value is None else Path(value)


def cache_dir() -> Path:
    """``$PAGEDWINDOW_CACHE_DIR`` (as given), else ``~/.cache/pagedwindow`` (the home directory of now)."""
    value = CACHE_DIR.get()
    return Path(value) if value is not None else Path.home() / ".cache" / "pagedwindow"


def nvcc_environment() -> dict[str, str | None]:
    """nvcc's own variables as they are now, by name (None for an unset one): an input of the cache key."""
    return {s.name: s.get() for s in NVCC_VARIABLES}


def notebooks_dir() -> Path | None:
    """``$PAGEDWINDOW_NOTEBOOKS``, None when unset or empty."""
    value = NOTEBOOKS.value()
    return None if value is None else Path(value)


def repo_dir() -> Path | None:
    """``$PAGEDWINDOW_REPO``, None when unset or empty."""
    value = REPO.value()
    return None if value is None else Path(value)


def commit() -> str | None:
    """``$PAGEDWINDOW_COMMIT``, None when unset or empty."""
    return COMMIT.value()


def mpl_backend() -> str | None:
    """``$MPLBACKEND`` as given (set but empty still counts as set), None when unset."""
    return MPLBACKEND.get()


def require_gpu() -> bool:
    """True when ``$PAGEDWINDOW_REQUIRE_GPU`` is ``1``."""
    return REQUIRE_GPU.get() == "1"
