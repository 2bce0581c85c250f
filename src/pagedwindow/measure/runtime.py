"""Device and dtype names as notebook parameters spell them, a summary of the environment a run used, and which
backend actually ran (``observe_backends``, an observer of ``pagedwindow.api``'s dispatch: ``backend="auto"``
decides per call), with the CUDA launches' prefill kernel and K/V copy path."""

from __future__ import annotations

import contextlib
import platform
from collections import Counter

import torch

from .. import api
from ..errors import PagedWindowError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def resolve_dtype(name: str) -> torch.dtype:
    """``"float32"`` | ``"bfloat16"`` | ``"float16"`` | ``"float64"`` -> the torch dtype."""
    try:
        return DTYPES[name]
    except KeyError:
        raise PagedWindowError(f"dtype {name!r} is not one of {sorted(DTYPES)}") from None


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> cuda when a GPU is present, else cpu; anything else is passed to ``torch.device``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PagedWindowError(f"device {name!r} was asked for but no CUDA GPU is available")
    return device


def environment(device: torch.device | None = None, launches: Counter | None = None) -> dict:
    """Versions and hardware of this run (for metrics.json and the report); ``kernels``: what ran
    (:func:`launch_record` of ``launches``, default: every launch :func:`observe_backends` saw in this process)."""
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cuda_available": torch.cuda.is_available(),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if device is not None:
        env["device"] = str(device)
        if device.type == "cuda":
            env["gpu"] = torch.cuda.get_device_name(device)
    env["kernels"] = launch_record(launches)
    return env


class Launches(Counter):
    """Prefill launches per backend (``{"reference": n, "cuda": m}``) and, for the CUDA launches, which prefill
    kernel (``kernels``: ``"wgmma"`` | ``"mma_sync"``) and K/V copy path (``kv_copy_paths``: ``"tma"`` |
    ``"cp.async"``) each one used, as counts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kernels: Counter = Counter()
        self.kv_copy_paths: Counter = Counter()


_PROCESS_LAUNCHES = Launches()  # everything observe_backends saw in this process (what environment() reports)
KERNEL_NAMES = {
    "wgmma": "sm_90a wgmma",
    "mma_sync": "mma.sync",  # how the report names the prefill kernels
    "pw_prefill_hd256_bf16_sm90": "sm_90a wgmma",
    "pw_prefill_hd256_bf16": "mma.sync",
}  # launchers


def _cuda_details(pool, geometry, plan) -> tuple[str, str]:
    """The prefill kernel and K/V copy path of one CUDA launch; ``"unknown"`` where they cannot be asked (under
    ``torch.compile``, or the query itself fails)."""
    if torch.compiler.is_compiling():
        return "unknown", "unknown"
    try:
        from .. import cuda

        return cuda.prefill_kernel(pool.device), cuda.kv_copy_path(pool, geometry, plan.num_kv_heads)
    except Exception:  # recording what ran must never break the run
        return "unknown", "unknown"


_open_blocks = 0  # observe_backends blocks now open


@contextlib.contextmanager
def observe_backends():
    """Count, inside the block, the prefill launches each backend ran: yields a :class:`Launches` (a Counter
    ``{"reference": n, "cuda": m}`` that also records each CUDA launch's kernel and K/V copy path). It registers an
    observer with ``pagedwindow.api`` (``api.prefill_observers``), which tells it the backend each call chose, so
    it reports what actually ran under ``backend="auto"``. What the outermost block sees is also added to this
    process's record, which :func:`environment` reports (nested blocks count a launch there once). Not
    thread-safe."""
    global _open_blocks
    counts = Launches()
    records = (counts,) if _open_blocks else (counts, _PROCESS_LAUNCHES)

    def observe(backend, q, pool, geometry, plan):
        details = _cuda_details(pool, geometry, plan) if backend == "cuda" else None
        for record in records:
            record[backend] += 1
            if details is not None:
                record.kernels[details[0]] += 1
                record.kv_copy_paths[details[1]] += 1

    _open_blocks += 1
    api.prefill_observers.append(observe)
    try:
        yield counts
    finally:
        api.prefill_observers.remove(observe)
        _open_blocks -= 1


def launch_record(launches: Launches | None = None) -> dict:
    """What ran, JSON-ready: ``{"backend": label, "launches": {backend: n}, "prefill_kernels": [...],
    "kv_copy_paths": [...]}`` of ``launches`` (default: everything observed in this process)."""
    launches = _PROCESS_LAUNCHES if launches is None else launches
    return {
        "backend": backend_label(launches),
        "launches": {k: v for k, v in sorted(launches.items()) if v},
        "prefill_kernels": sorted(k for k, v in getattr(launches, "kernels", {}).items() if v),
        "kv_copy_paths": sorted(k for k, v in getattr(launches, "kv_copy_paths", {}).items() if v),
    }


def backend_label(counts: Counter) -> str:
    """``"reference"``, ``"cuda"``, ``"cuda+reference"`` (auto mixed them) or ``"none"``, from
    :func:`observe_backends`."""
    used = sorted(name for name, n in counts.items() if n > 0)
    return "+".join(sorted(used, key=lambda n: n != "cuda")) if used else "none"
