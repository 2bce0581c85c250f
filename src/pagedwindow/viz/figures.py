"""Matplotlib set-up: the Agg backend unless something can show figures, and saving PNGs into ``out_dir``.

Importing this module picks the backend before ``pyplot`` is imported anywhere: a notebook kernel keeps its
inline backend (figures render into the notebook and its HTML), ``MPLBACKEND`` is respected, and any other process
(scripts, tests, CI) gets Agg.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import matplotlib
import torch

from .. import settings


def _in_notebook_kernel() -> bool:
    shell = sys.modules.get("IPython")
    if shell is None or "ipykernel" not in sys.modules:
        return False
    ip = shell.get_ipython()
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def ensure_backend() -> str:
    """Select Agg unless running in a notebook kernel or ``MPLBACKEND`` is set; returns the backend in use."""
    if not _in_notebook_kernel() and settings.mpl_backend() is None:
        matplotlib.use("Agg")
    return matplotlib.get_backend()


ensure_backend()

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)


def save_figure(fig, out_dir, name: str, *, dpi: int = 110) -> Path:
    """Save ``fig`` as ``out_dir/name.png`` (tight bounding box); returns the path. The figure stays open."""
    path = Path(out_dir) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return path


def new_figure(ncols: int = 1, nrows: int = 1, *, width: float = 6.0, height: float = 3.6, **kwargs):
    """``plt.subplots`` with a size per panel; returns ``(fig, axes)`` with ``axes`` always a flat list."""
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False, **kwargs)
    return fig, list(axes.flat)


def zero_floor(*values, default: float = 1e-12) -> float:
    """Where exact zeros are drawn on a log axis: the largest power of ten at least one decade below the smallest
    positive finite value among ``values`` (tensors or numbers), so that a single 0 does not stretch the axis;
    ``default`` when there is none. Plots say where zeros were drawn."""
    smallest = math.inf
    for v in values:
        t = torch.as_tensor(v, dtype=torch.float64).flatten()
        t = t[torch.isfinite(t) & (t > 0)]
        if t.numel():
            smallest = min(smallest, float(t.min()))
    return default if smallest == math.inf else 10.0 ** (math.floor(math.log10(smallest)) - 1)


def error_log_range(dtype: torch.dtype) -> tuple[float, float]:
    """A fixed log10 range for absolute errors of ``dtype`` values of order 1: from 1000 times below its eps to 10
    times above it (bf16: -5.1 .. -0.9), so one ulp is a small step of the colour scale, not all of it."""
    eps = torch.finfo(dtype).eps
    return math.log10(eps) - 3.0, math.log10(eps) + 1.0
