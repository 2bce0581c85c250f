"""What differs between the transformers versions we support, in one place (5.17 on the GPU machine, newer on PyPI).

Handled here:
- the cache keyword: ``past_key_values=`` (5.17) became ``cache=`` (later 5.x; the old name is deprecated, still
  accepted until 5.40) — :func:`cache_kwarg` picks the one the installed model's ``forward`` declares;
- Gemma 4's ``global_head_dim`` / ``num_global_key_value_heads``: top-level config fields in the first Gemma 4
  releases, per-layer overrides (``per_layer_config``) since — the builders pass them as keywords (accepted by
  both) and then *verify* every layer's geometry on the built model (:func:`attention_geometry`) instead of
  trusting a version number;
- the cache-update call site moved (``past_key_values.update(...)`` in the attention module, later
  ``cache.update(..., kwargs=...)``): it happens before the attention function in every version, so we never
  depend on it — the attention function always takes the new K/V as the last ``q_len`` rows it is handed.

Also here: the accessors of a built model every oracle module uses (its decoder stack, attention modules and
functions, mask builders, dtype and device), and :func:`attention_implementation`, the one way this package
switches a model's HF attention implementation for a block and brings the previous one back.

transformers is imported lazily (inside functions) everywhere in ``pagedwindow.hf``.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass

import torch

from ..errors import PagedWindowError

MIN_TRANSFORMERS = (5, 5)


def transformers_version() -> tuple[int, int, int]:
    import transformers

    parts = []
    for piece in transformers.__version__.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)


def require_transformers() -> None:
    """Fail with a clear message unless transformers >= 5.5 (the first release with Gemma 4) is importable."""
    try:
        version = transformers_version()
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise PagedWindowError("pagedwindow.hf needs transformers >= 5.5: pip install 'pagedwindow[hf]'") from exc
    if version[:2] < MIN_TRANSFORMERS:
        raise PagedWindowError(f"pagedwindow.hf needs transformers >= 5.5, found {'.'.join(map(str, version))}")


_registered_names: set[str] = set()


def register_attention(name: str, attention_fn, mask_fn) -> str:
    """Register ``attention_fn`` with ``AttentionInterface`` and ``mask_fn`` with ``AttentionMaskInterface`` under
    ``name`` (idempotent). Both are needed: under a custom name without a mask function HF passes
    ``attention_mask=None``, silently dropping the causal mask and the window."""
    require_transformers()
    if name not in _registered_names:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(name, attention_fn)
        AttentionMaskInterface.register(name, mask_fn)
        _registered_names.add(name)
    return name


def decoder(model):
    """The decoder stack (``Gemma4TextModel`` / ``Gemma3TextModel``) of a causal LM or of the stack itself."""
    base = getattr(model, "model", None)
    if base is not None and hasattr(base, "layers"):
        return base
    if hasattr(model, "layers"):
        return model
    raise PagedWindowError(f"{type(model).__name__} has no decoder stack with .layers (not a Gemma text model?)")


def attention_modules(model) -> list:
    """Every decoder layer's self-attention module, in layer order."""
    return [layer.self_attn for layer in decoder(model).layers]


def eager_attention_function(module):
    """The model family's own eager attention (``eager_attention_forward`` of the module's modeling file).

    "eager" is not in ``ALL_ATTENTION_FUNCTIONS``: each modeling file passes its own as the default.
    """
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise PagedWindowError(f"{type(module).__module__} defines no eager_attention_forward")
    return fn


def attention_function(module, impl: str):
    """HF's attention function for ``impl`` ("eager", "sdpa", or any registered name)."""
    if impl == "eager":
        return eager_attention_function(module)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[impl]


@contextlib.contextmanager
def attention_implementation(model, impl: str):
    """Run ``model`` under HF attention implementation ``impl`` inside the block; the previous one comes back
    after it, also on error."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(impl)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


def mask_function(impl: str):
    """HF's mask builder for ``impl`` ("eager", "sdpa", ...)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS[impl]


def cache_kwarg(model) -> str:
    """The keyword the installed model's ``forward`` takes its KV cache by: ``cache`` or ``past_key_values``."""
    params = inspect.signature(type(model).forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise PagedWindowError(f"{type(model).__name__}.forward takes neither cache= nor past_key_values=")


def new_dynamic_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # pragma: no cover - older signature
        return DynamicCache()


@dataclass(frozen=True)
class LayerGeometry:
    """One attention layer as HF built it."""

    layer_idx: int
    layer_type: str  # "sliding_attention" | "full_attention"
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None  # HF's W (keys including the query); None on full layers
    scaling: float


def attention_geometry(model) -> list[LayerGeometry]:
    """Read every layer's heads, head_dim, window and scale off the built modules (not off the config keys,
    which moved between versions)."""
    out = []
    for module in attention_modules(model):
        q_out = module.q_proj.out_features
        k_proj = getattr(module, "k_proj", None)
        head_dim = int(module.head_dim)
        if k_proj is None:
            raise PagedWindowError(
                f"layer {module.layer_idx} shares another layer's K/V (num_kv_shared_layers > 0):"
                " not supported by the pagedwindow HF integration"
            )
        layer_type = getattr(module, "layer_type", None) or model.config.layer_types[module.layer_idx]
        out.append(
            LayerGeometry(
                layer_idx=int(module.layer_idx),
                layer_type=layer_type,
                num_qo_heads=q_out // head_dim,
                num_kv_heads=k_proj.out_features // head_dim,
                head_dim=head_dim,
                sliding_window=getattr(module, "sliding_window", None),
                scaling=float(module.scaling),
            )
        )
    return out


def model_dtype_device(model) -> tuple[torch.dtype, torch.device]:
    p = next(model.parameters())
    return p.dtype, p.device
