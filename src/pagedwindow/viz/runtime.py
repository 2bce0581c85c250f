"""Device and dtype names as notebook parameters spell them, a summary of the environment a run used, and which
backend actually ran (``observe_backends``: ``backend="auto"`` decides per call)."""

from __future__ import annotations

import contextlib
import platform
import sys
from collections import Counter

import torch

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


def environment(device: torch.device | None = None) -> dict:
    """Versions and hardware of this run (for metrics.json and the report)."""
    env = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
           "cuda_available": torch.cuda.is_available()}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if device is not None:
        env["device"] = str(device)
        if device.type == "cuda":
            env["gpu"] = torch.cuda.get_device_name(device)
    return env


@contextlib.contextmanager
def observe_backends():
    """Count, inside the block, the prefill launches each backend ran: yields a Counter ``{"reference": n,
    "cuda": m}``. It watches the backends' entry points (``pagedwindow.reference`` and, when loaded,
    ``pagedwindow.cuda``), so it reports what actually ran under ``backend="auto"``. Not thread-safe."""
    from .. import reference

    counts: Counter = Counter()
    modules = {"reference": reference}
    if "pagedwindow.cuda" in sys.modules or torch.cuda.is_available():
        from .. import cuda

        modules["cuda"] = cuda
    saved = {name: module.batch_prefill_paged_window for name, module in modules.items()}

    def counting(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    for name, module in modules.items():
        module.batch_prefill_paged_window = counting(name, saved[name])
    try:
        yield counts
    finally:
        for name, module in modules.items():
            module.batch_prefill_paged_window = saved[name]


def backend_label(counts: Counter) -> str:
    """``"reference"``, ``"cuda"``, ``"cuda+reference"`` (auto mixed them) or ``"none"``, from
    :func:`observe_backends`."""
    used = sorted(name for name, n in counts.items() if n > 0)
    return "+".join(sorted(used, key=lambda n: n != "cuda")) if used else "none"
