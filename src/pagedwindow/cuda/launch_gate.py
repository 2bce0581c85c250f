"""The compiled call gate (``kernels/launch_gate.cpp``): a CPython extension module that checks a call's tensors
and launches it in one C call, built on first use with the host's C++ compiler against the installed torch's
headers (no nvcc, no CUDA headers: it builds on any machine with torch and a compiler).

The gate is a fast path in front of the checked Python path, never a replacement for it: when any of its checks
fails it launches and writes nothing and returns ``REFUSED``, and the caller runs the Python checks, which name
the error. It is at least as strict as those checks (``tests/test_launch_gate.py`` drives each refusal on a CPU,
``tests/test_cuda_launch_gate.py`` the API's calls through both on a GPU). Wherever the gate cannot be built
or loaded (no compiler, no Python headers), :func:`module` returns None once the failure is logged, and every
call takes the Python path.

The build is cached beside the kernels' (``$PAGEDWINDOW_CACHE_DIR``), one directory per key,
``launch-gate-<key>/``: the module, named ``pagedwindow_launch_gate<EXT_SUFFIX>``, and ``manifest.json`` (its size,
sha256 and every input of the key: the gate's sources, the compiler's path and version, the flags, torch's version
and C++ ABI, the Python ABI), built and healed by the kernels' own protocol (``build.cached_build``: a file lock,
a staging directory, an atomic rename; logged to ``pagedwindow.cuda.build``). ``$PAGEDWINDOW_CXX`` names the
compiler (default ``c++``).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import logging
import shlex
import subprocess
import sysconfig
import threading
from pathlib import Path
from types import ModuleType

import torch

from .. import settings
from . import build, ops

MODULE_NAME = "pagedwindow_launch_gate"
SOURCES = ("launch_gate.cpp",)
HEADERS = ("launch_blocks.cuh",)
FLAGS = ("-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden", "-w")
"""``-w``: torch's headers warn under some compilers; the gate's own code is checked by ``make lint``."""

_lock = threading.Lock()
_state: dict = {}  # "module": the loaded gate or None (it cannot be built or loaded here); "error": why
_log = logging.getLogger(__name__)


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        raise build.BuildError(f"{cxx} --version failed: {exc}") from exc


def _torch_dirs() -> tuple[Path, Path]:
    """torch's header and library directories (what ``torch.utils.cpp_extension`` would use)."""
    root = Path(torch.__file__).resolve().parent
    return root / "include", root / "lib"


def build_inputs(cxx: str) -> dict:
    """Everything the gate's build depends on (hashed into its key and recorded in its manifest)."""
    directory = build.kernels_dir()
    files = [directory / name for name in (*SOURCES, *HEADERS)]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise build.BuildError(f"launch gate sources missing: {missing}")
    return {
        "format": build.CACHE_FORMAT,
        "compiler": cxx,
        "compiler_version": _compiler_version(cxx),
        "flags": list(FLAGS),
        "torch": torch.__version__,
        "torch_include": str(_torch_dirs()[0]),
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "python": sysconfig.get_config_var("EXT_SUFFIX"),
        "files": build.file_hashes(files),
    }


def _compile(cxx: str, staging: Path, key: str, inputs: dict) -> Path:
    include, lib = _torch_dirs()
    out = staging / f"{MODULE_NAME}{inputs['python']}"
    cmd = [
        cxx,
        *inputs["flags"],
        f"-D_GLIBCXX_USE_CXX11_ABI={int(inputs['cxx11_abi'])}",
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{include}",
        f"-I{build.kernels_dir()}",
        "-o",
        str(out),
        *(str(build.kernels_dir() / name) for name in SOURCES),
        f"-L{lib}",
        "-lc10",
        "-ltorch_cpu",
        "-ltorch_python",
        f"-Wl,-rpath,{lib}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (staging / "build.txt").write_text(shlex.join(cmd) + "\n" + proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out.is_file():
        raise build.BuildError(f"{cxx} failed ({proc.returncode}) building the launch gate:\n{proc.stderr[-4000:]}")
    return build.seal(staging, out, key, inputs)


def build_module() -> Path:
    """The gate's extension module: the cached build when it verifies, else a fresh one (``BuildError`` when
    the compiler or the sources are missing or the compile fails)."""
    cxx = settings.cxx()
    inputs = build_inputs(cxx)
    key = build.cache_key(inputs)
    return build.cached_build(
        f"launch-gate-{key}",
        key,
        lambda staging: _compile(cxx, staging, key, inputs),
        label="launch gate",
        what="the launch gate",
        tool=cxx,
    )


def _load(path: Path) -> ModuleType:
    """Import the built module and check that it and ``ops`` agree on the launch blocks' sizes."""
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
    gate = importlib.util.module_from_spec(spec)
    loader.exec_module(gate)
    for name, block in (
        ("PREFILL_LAUNCH_BYTES", ops.PrefillLaunch),
        ("APPEND_LAUNCH_BYTES", ops.AppendLaunch),
        ("PREPARE_LAUNCH_BYTES", ops.PrepareLaunch),
    ):
        if getattr(gate, name) != ctypes.sizeof(block):
            raise ImportError(
                f"{path}: {name} = {getattr(gate, name)} but the host's {block.__name__} has "
                f"{ctypes.sizeof(block)} bytes (a stale or foreign build)"
            )
    return gate


def module() -> ModuleType | None:
    """The loaded gate (built on first use), or None when it cannot be built or loaded here (logged once with
    the reason, :func:`unavailable_reason`; every call then takes the checked Python path)."""
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state:
            try:
                _state["module"] = _load(build_module())
            except (build.BuildError, OSError, ImportError) as exc:
                _log.warning("the launch gate is unavailable (calls take the checked Python path): %s", exc)
                _state["error"] = str(exc)
                _state["module"] = None
    return _state["module"]


def unavailable_reason() -> str | None:
    """Why :func:`module` returned None (its build or load error), or None when it loaded or was not tried."""
    return _state.get("error")
