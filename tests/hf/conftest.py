"""Shared fixtures of the HF oracle suite: tiny models built once per session, and the backend / device matrix.

``backend`` parameters: "reference" runs on the CPU; "cuda" (marked ``cuda``: skipped without a GPU by the
top-level conftest) runs the model on the GPU in bf16 with pagedwindow's CUDA kernels. fp32 tests use the
reference backend (the kernels are bf16); on a GPU they also run there (``device`` "cuda", marked ``cuda``).
"""

from __future__ import annotations

import pytest
import torch

from pagedwindow.hf.models import tiny_gemma3, tiny_gemma4

BUILDERS = {"gemma4": tiny_gemma4, "gemma3": tiny_gemma3}
FAMILIES = list(BUILDERS)
BF16_BACKENDS = ["reference", pytest.param("cuda", marks=pytest.mark.cuda)]
FP32_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

_MODELS: dict = {}


def tiny(family: str, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    """A session-cached tiny model (the oracles restore the model's attention implementation after each use)."""
    key = (family, dtype, device, seed)
    if key not in _MODELS:
        _MODELS[key] = BUILDERS[family](seed, dtype=dtype, device=device)
    model = _MODELS[key]
    assert model.config._attn_implementation == "eager", "a previous test left the cached model switched"
    assert getattr(model, "_pagedwindow_session", None) is None, "a previous test left pagedwindow enabled"
    return model


def device_of(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"
