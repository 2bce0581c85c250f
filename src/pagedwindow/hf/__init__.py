"""pagedwindow's Hugging Face Gemma oracle (needs ``transformers >= 5.5``; random weights from configs only).

Modules (one concept each):
- ``models``: tiny seeded Gemma 4 / Gemma 3 causal LMs with randomised norms and layer scalars;
- ``capture``: per-layer capture of what HF hands its attention function (q, k, v, output, scaling, window),
  with HF's other backend evaluated on the same inputs (the floor);
- ``prep_oracle``: captured q/k/v projections through ``prepare_paged_qkv`` (a paged pool, a plan) vs HF's own
  norms and RoPE, per sliding layer, against HF's prep in fp32 (the bf16 floor);
- ``layer_oracle``: captured q/k/v through pagedwindow vs HF eager, per layer, next to HF's sdpa floor;
- ``integration``: ``use_pagedwindow(model)`` / ``restore(model)`` — an HF model running every layer through
  pagedwindow (registered with ``AttentionInterface`` and ``AttentionMaskInterface``);
- ``decode_oracle``: greedy decode through the paged path vs HF ``generate``, teacher-forced logits and tokens;
- ``tolerance``: metrics and the calibrated gates;
- ``summary``: the error table of every case (``python -m pagedwindow.hf.summary``).

The paged KV state the oracle drives, ``PagedKvState`` / ``StepInfo``, lives in the core
(``pagedwindow.kv_state``) and is re-exported here.

transformers is imported lazily: ``import pagedwindow`` never needs it, and neither does importing this package;
the names below load their module on first access.
"""

from __future__ import annotations

import importlib

# name -> its module, relative to this package (".kv_state": a module of pagedwindow itself)
_EXPORTS = {
    "tiny_gemma4": "models",
    "tiny_gemma3": "models",
    "tiny_model": "models",
    "random_prompts": "models",
    "randomize_norms": "models",
    "default_layer_types": "models",
    "tiny_config": "models",
    "gemma4_config": "models",
    "gemma3_config": "models",
    "capture_attention": "capture",
    "forward_logits": "capture",
    "AttentionCapture": "capture",
    "LayerCall": "capture",
    "PagedKvState": ".kv_state",
    "StepInfo": ".kv_state",  # pagedwindow.kv_state (the core)
    "PrepCase": "prep_oracle",
    "PrepError": "prep_oracle",
    "PrepResult": "prep_oracle",
    "default_prep_cases": "prep_oracle",
    "run_prep_case": "prep_oracle",
    "sliding_prep": "_compat",
    "LayerPrep": "_compat",
    "keep_rotary_fp32": "models",
    "LayerCase": "layer_oracle",
    "LayerCaseResult": "layer_oracle",
    "LayerError": "layer_oracle",
    "default_layer_cases": "layer_oracle",
    "run_layer_case": "layer_oracle",
    "use_pagedwindow": "integration",
    "restore": "integration",
    "pagedwindow_attention": "integration",
    "PagedWindowSession": "integration",
    "register": "integration",
    "ATTN_IMPL": "integration",
    "PagedRows": "integration",
    "DecodeCase": "decode_oracle",
    "DecodeResult": "decode_oracle",
    "RequestDecode": "decode_oracle",
    "default_decode_cases": "decode_oracle",
    "run_decode_case": "decode_oracle",
    "step_logits": "decode_oracle",
    "hf_generate": "decode_oracle",
    "ErrorStats": "tolerance",
    "GateResult": "tolerance",
    "error_stats": "tolerance",
    "gate": "tolerance",
    "tolerance": "tolerance",
    "top2_margin": "tolerance",
    "margin_is_clear": "tolerance",
    "oracle_table": "summary",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedwindow.hf' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
