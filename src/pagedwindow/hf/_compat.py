"""What differs between the transformers versions we support, in one place (5.17 on the GPU machine, newer on PyPI).

Handled here:
- the cache keyword: ``past_key_values=`` (5.17) became ``cache=`` (later 5.x; the old name is deprecated, still
  accepted until 5.40) — :func:`cache_kwarg` picks the one the installed model's ``forward`` declares;
- Gemma 4's ``global_head_dim`` / ``num_global_key_value_heads``: top-level config fields in the first Gemma 4
  releases, per-layer overrides (``per_layer_config``) since — the builders pass them as keywords (accepted by
  both) and then *verify* every layer's geometry on the built model (:func:`attention_geometry`) instead of
  trusting a version number;
- the sliding layers' RoPE base: ``config.rope_parameters["sliding_attention"]["rope_theta"]`` in every 5.x
  (Gemma 3's old ``rope_local_base_freq`` is folded into it by the config), read by :func:`sliding_prep`, which
  then *verifies* it against the built rotary module's ``sliding_attention_inv_freq`` bit for bit (5.17
  computes the angles as a matmul, later releases as a product: one fp32 product either way);
- RMSNorm's epsilon: ``eps`` up to 5.24, ``variance_epsilon`` from 5.25 (:func:`norm_eps`);
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
    return parts[0], parts[1], parts[2]


def require_transformers() -> None:
    """Fail with a clear message unless transformers >= 5.5 (the first release with Gemma 4) is importable."""
    try:
        version = transformers_version()
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise PagedWindowError("pagedwindow.hf needs transformers >= 5.5: pip install 'pagedwindow[hf]'") from exc
    if version[:2] < MIN_TRANSFORMERS:
        raise PagedWindowError(f"pagedwindow.hf needs transformers >= 5.5, found {'.'.join(map(str, version))}")


def norm_eps(norm) -> float:
    """An RMSNorm module's epsilon: ``eps`` up to transformers 5.24, ``variance_epsilon`` from 5.25."""
    for name in ("eps", "variance_epsilon"):
        value = getattr(norm, name, None)
        if value is not None:
            return float(value)
    raise PagedWindowError(f"{type(norm).__name__} has neither eps nor variance_epsilon")


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
        layer_type = getattr(module, "layer_type", None)
        if layer_type is None:
            layer_types = getattr(model.config, "layer_types", None)
            if layer_types is None:
                raise PagedWindowError(
                    f"{type(model.config).__name__} names no layer_types (sliding or full attention per layer):"
                    " not a Gemma 4 / Gemma 3 text model"
                )
            layer_type = layer_types[module.layer_idx]
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


NORM_STYLE_OF_MODEL_TYPE = {"gemma4_text": "gemma4", "gemma3_text": "gemma3"}
"""HF ``config.model_type`` -> the ``norm_style`` of ``pagedwindow.prepare_paged_qkv``."""
_NORM_CLASS = {"gemma4": "Gemma4RMSNorm", "gemma3": "Gemma3RMSNorm"}
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class LayerPrep:
    """What ``prepare_paged_qkv`` needs to reproduce one sliding layer's q/k/v prep, read off the built model.

    ``q_norm_weight`` / ``k_norm_weight`` are the modules' parameters themselves (``[head_dim]``, the model's
    dtype; the op reads them detached)."""

    layer_idx: int
    norm_style: str  # "gemma4" | "gemma3"
    q_norm_weight: torch.Tensor  # [head_dim]
    k_norm_weight: torch.Tensor  # [head_dim]
    eps: float
    rope_theta: float
    rope_position_factor: float
    sm_scale: float  # the module's ``scaling``
    sliding_window: int  # HF's W

    def prep_kwargs(self) -> dict:
        """The keywords of ``prepare_paged_qkv`` / ``PagedKvState.prepare``."""
        return {
            "q_norm_weight": self.q_norm_weight,
            "k_norm_weight": self.k_norm_weight,
            "eps": self.eps,
            "rope_theta": self.rope_theta,
            "norm_style": self.norm_style,
            "rope_position_factor": self.rope_position_factor,
        }


def _sliding_rope(model) -> tuple[float, float]:
    """(theta, position factor) of the sliding layers' RoPE from the config; only "default" and "linear" RoPE
    are the prep's (anything else rescales or mixes frequencies in ways the op does not)."""
    config = model.config
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(SLIDING), dict):
        params = params[SLIDING]
    elif isinstance(params, dict) and "rope_theta" in params:
        pass  # one dict for every layer type
    elif getattr(config, "rope_local_base_freq", None) is not None:
        params = {"rope_type": "default", "rope_theta": config.rope_local_base_freq}
    else:
        raise PagedWindowError(
            f"fused prep: {type(config).__name__} names no RoPE base for its sliding layers "
            "(rope_parameters['sliding_attention']['rope_theta'] or rope_local_base_freq)"
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        factor = 1.0
    elif rope_type == "linear":
        factor = float(params["factor"])
    else:
        raise PagedWindowError(
            f"fused prep: the sliding layers' RoPE is {rope_type!r}; prepare_paged_qkv does 'default' and 'linear'"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise PagedWindowError(
            f"fused prep: the sliding layers rotate a part of the head (partial_rotary_factor "
            f"{params['partial_rotary_factor']}); prepare_paged_qkv rotates all of it"
        )
    return float(params["rope_theta"]), factor


def _check_rotary(model, head_dim: int, theta: float, factor: float) -> None:
    """The built rotary module's sliding-layer frequencies are exactly ``rope_inv_freq(head_dim, theta, factor)``
    (fp32, bit for bit) and its attention scaling is 1 — else the prep's angles would not be HF's."""
    from ..gemma_prep import rope_inv_freq

    rotary = getattr(decoder(model), "rotary_emb", None)
    inv_freq = getattr(rotary, f"{SLIDING}_inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor):
        raise PagedWindowError(
            f"fused prep: the model's rotary module ({type(rotary).__name__}) has no {SLIDING}_inv_freq buffer"
        )
    ours = torch.tensor(rope_inv_freq(head_dim, theta, factor), dtype=torch.float32)  # [D/2]
    if inv_freq.dtype != torch.float32 or inv_freq.shape != ours.shape or not torch.equal(inv_freq.cpu(), ours):
        differ = (
            f"dtype {inv_freq.dtype}, shape {tuple(inv_freq.shape)}"
            if inv_freq.dtype != torch.float32 or inv_freq.shape != ours.shape
            else f"{int((inv_freq.cpu() != ours).sum())} of {ours.numel()} values differ"
        )
        raise PagedWindowError(
            f"fused prep: rope_theta {theta!r} (factor {factor!r}) does not reproduce the model's "
            f"{SLIDING}_inv_freq bit for bit ({differ}; fp32 [{ours.numel()}] expected). A model cast with "
            "model.to(bfloat16) has its RoPE frequencies rounded to bf16: load it with from_pretrained(dtype=...) "
            "or keep the rotary buffers fp32 (pagedwindow.hf.models.keep_rotary_fp32)"
        )
    scaling = getattr(rotary, f"{SLIDING}_attention_scaling", 1.0)
    if scaling != 1.0:
        raise PagedWindowError(
            f"fused prep: the sliding layers' RoPE attention_scaling is {scaling!r}, not 1 (cos/sin are scaled; "
            "prepare_paged_qkv does not scale them)"
        )


def _layer_prep(module, style: str, theta: float, factor: float) -> LayerPrep:
    layer = int(module.layer_idx)
    norms = {name: getattr(module, name, None) for name in ("q_norm", "k_norm", "v_norm")}
    weights: dict[str, torch.Tensor] = {}  # q_norm, k_norm -> [head_dim]
    for name in ("q_norm", "k_norm"):
        norm = norms[name]
        weight = getattr(norm, "weight", None)
        if type(norm).__name__ != _NORM_CLASS[style] or not isinstance(weight, torch.Tensor):
            raise PagedWindowError(
                f"fused prep: layer {layer}'s {name} is {type(norm).__name__}, not a weighted {_NORM_CLASS[style]}"
            )
        weights[name] = weight
    v_norm = norms["v_norm"]
    if style == "gemma4" and (
        type(v_norm).__name__ != _NORM_CLASS[style] or getattr(v_norm, "weight", None) is not None
    ):
        raise PagedWindowError(
            f"fused prep: layer {layer}'s v_norm must be an unweighted {_NORM_CLASS[style]} (x / rms(x)); "
            f"got {type(v_norm).__name__}{' with a weight' if getattr(v_norm, 'weight', None) is not None else ''}"
        )
    if style == "gemma3" and v_norm is not None:
        raise PagedWindowError(f"fused prep: layer {layer} has a v_norm; Gemma 3's prep leaves v as projected")
    eps = {norm_eps(n) for n in norms.values() if n is not None}
    if len(eps) != 1:
        raise PagedWindowError(f"fused prep: layer {layer}'s q/k/v norms use different eps {sorted(eps)}")
    return LayerPrep(
        layer_idx=layer,
        norm_style=style,
        q_norm_weight=weights["q_norm"],
        k_norm_weight=weights["k_norm"],
        eps=eps.pop(),
        rope_theta=theta,
        rope_position_factor=factor,
        sm_scale=float(module.scaling),
        sliding_window=int(module.sliding_window),
    )


def sliding_prep(model) -> dict[int, LayerPrep]:
    """Per sliding layer (by index), what ``prepare_paged_qkv`` needs to reproduce HF's q/k/v prep, every piece
    checked against the built model: the family's norm style (``config.model_type``) and norm classes, one eps,
    an unweighted v_norm (Gemma 4) or none (Gemma 3), and a RoPE base that reproduces the rotary module's
    frequencies bit for bit with attention scaling 1. Raises ``PagedWindowError`` naming what does not fit."""
    model_type = getattr(model.config, "model_type", None)
    style = NORM_STYLE_OF_MODEL_TYPE.get(model_type) if model_type is not None else None
    if style is None:
        raise PagedWindowError(
            f"fused prep: model_type {model_type!r} is not one of "
            f"{sorted(NORM_STYLE_OF_MODEL_TYPE)} (Gemma 4 / Gemma 3 text models)"
        )
    geometry = {g.layer_idx: g for g in attention_geometry(model)}
    sliding = [m for m in attention_modules(model) if geometry[int(m.layer_idx)].layer_type == SLIDING]
    if not sliding:
        return {}
    head_dims = {geometry[int(m.layer_idx)].head_dim for m in sliding}
    if len(head_dims) != 1:
        raise PagedWindowError(f"fused prep: the sliding layers have head_dims {sorted(head_dims)}")
    theta, factor = _sliding_rope(model)
    _check_rotary(model, head_dims.pop(), theta, factor)
    return {int(m.layer_idx): _layer_prep(m, style, theta, factor) for m in sliding}
