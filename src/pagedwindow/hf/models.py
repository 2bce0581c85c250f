"""Tiny random Gemma 4 / Gemma 3 causal LMs built from configs (never from downloaded weights).

Seeded and reproducible: the same ``seed`` gives bit-identical weights in every process (the global RNG is forked,
so building a model does not disturb the caller's random state). Random init leaves every RMSNorm at identity and
Gemma 4's ``layer_scalar`` at 1, which would hide wiring bugs (a q/k norm applied twice, a missing scalar), so
:func:`randomize_norms` draws them. Models come back in eval mode, in ``dtype`` (built in fp32, then cast, so an
fp32 and a bf16 model of one seed share weights up to bf16 rounding). The rotary modules' inverse frequencies
(``*inv_freq`` buffers) stay fp32 in every dtype, as ``from_pretrained(dtype=torch.bfloat16)`` leaves them: a plain
``model.to(torch.bfloat16)`` would round them to bf16 and move every RoPE angle (at position 100 by up to ~0.1 rad).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..errors import PagedWindowError
from ._compat import attention_geometry, require_transformers

if TYPE_CHECKING:
    from transformers import Gemma3TextConfig, Gemma4TextConfig, PreTrainedConfig

# Multipliers drawn for the RMSNorm weights: hidden-state norms in HIDDEN_NORM_RANGE; the q/k norms are drawn
# around a centre chosen from the layer's own scale and head_dim so that the attention logits (sm_scale * q.k,
# q and k RMS-normalised) have a standard deviation near ATTN_LOGIT_STD whatever the family: Gemma 4 (sm_scale 1)
# gets small multipliers (~0.3), Gemma 3 (sm_scale 1/16) larger ones (~1.2). Soft but structured attention: every
# key in the window carries weight, so a window or position bug moves the output well above the bf16 floor
# (one-hot attention would hide an edge key), and HF's bf16 eager rounding of the logits stays small.
HIDDEN_NORM_RANGE = (0.5, 1.5)
QK_NORM_SPREAD = (0.5, 1.5)  # times the centre
ATTN_LOGIT_STD = 1.5
LAYER_SCALAR_RANGE = (0.5, 1.5)


DEFAULT_SLIDING_WINDOW_PATTERN = 3  # the tiny models' mix: sliding, sliding, full, ...
GEMMA_SLIDING_WINDOW_PATTERN = 6  # Gemma 3 and Gemma 4: 5 sliding layers, then 1 full (transformers' default)
MAX_POSITION_EMBEDDINGS = 32768  # room for prompts past 4096 tokens (the rotary embeddings used do not depend on it)


def default_layer_types(num_layers: int, sliding_window_pattern: int = DEFAULT_SLIDING_WINDOW_PATTERN) -> list[str]:
    """Layer ``i`` is full attention when ``(i + 1) % sliding_window_pattern == 0``, sliding otherwise, and the
    last layer is full (Gemma 4 requires it) — transformers' own rule, whose default pattern is 6 (5 sliding : 1
    full, :data:`GEMMA_SLIDING_WINDOW_PATTERN`). The tiny models default to 3."""
    if num_layers < 1:
        raise PagedWindowError(f"num_layers = {num_layers} must be >= 1")
    if sliding_window_pattern < 1:
        raise PagedWindowError(f"sliding_window_pattern = {sliding_window_pattern} must be >= 1")
    types = [
        "full_attention" if (i + 1) % sliding_window_pattern == 0 else "sliding_attention" for i in range(num_layers)
    ]
    types[-1] = "full_attention"
    return types


def _layer_types(layer_types, num_layers: int, sliding_window_pattern: int) -> list[str]:
    """The given layer types (one per layer) or :func:`default_layer_types`."""
    types = list(layer_types) if layer_types is not None else default_layer_types(num_layers, sliding_window_pattern)
    if len(types) != num_layers:
        raise PagedWindowError(f"layer_types has {len(types)} entries for num_layers = {num_layers}")
    return types


def _norm_weight(norm: torch.nn.Module) -> torch.Tensor:
    """An RMSNorm's ``weight`` parameter (``[dim]``)."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise PagedWindowError(f"{type(norm).__name__} has no weight tensor")
    return weight


def _norm_uses_offset(norm: torch.nn.Module) -> bool:
    """Whether an RMSNorm scales by ``1 + weight`` (Gemma 3) rather than ``weight`` (Gemma 4): probe it."""
    weight = _norm_weight(norm)
    with torch.no_grad():
        saved = weight.detach().clone()
        weight.zero_()
        probe = norm(torch.ones(1, weight.shape[0], dtype=weight.dtype, device=weight.device))
        weight.copy_(saved)
    return bool(probe.abs().max() > 0.5)


def _uniform(gen: torch.Generator, shape, lo: float, hi: float) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float32)


def randomize_norms(model, seed: int) -> None:
    """Draw every RMSNorm weight and every ``layer_scalar`` (in place, reproducibly from ``seed``).

    A norm's effective multiplier is drawn from :data:`HIDDEN_NORM_RANGE` (q/k norms: see
    :data:`ATTN_LOGIT_STD`), whatever the family's convention (``w`` or ``1 + w``); norms without a weight
    (Gemma 4's ``v_norm``) stay as they are.
    """
    gen = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, module in sorted(modules.items(), key=lambda item: item[0]):
            if type(module).__name__.endswith("RMSNorm") and isinstance(
                getattr(module, "weight", None), torch.nn.Parameter
            ):
                parent, _, last = name.rpartition(".")
                if last in ("q_norm", "k_norm"):
                    attn = modules[parent]
                    # std(scale * q.k) ~ scale * sqrt(head_dim) * m**2 for unit-RMS q, k scaled by m
                    centre = (ATTN_LOGIT_STD / (float(attn.scaling) * float(attn.head_dim) ** 0.5)) ** 0.5
                    lo, hi = centre * QK_NORM_SPREAD[0], centre * QK_NORM_SPREAD[1]
                else:
                    lo, hi = HIDDEN_NORM_RANGE
                mult = _uniform(gen, module.weight.shape, lo, hi)
                value = mult - 1.0 if _norm_uses_offset(module) else mult
                module.weight.copy_(value.to(module.weight.dtype))
            scalar = getattr(module, "layer_scalar", None)
            if isinstance(scalar, torch.Tensor):
                scalar.copy_(_uniform(gen, scalar.shape, *LAYER_SCALAR_RANGE).to(scalar.dtype))


def _rotary_buffers(model) -> dict:
    """Every rotary module's inverse-frequency buffers, ``{(module name, buffer name): tensor}``."""
    return {
        (name, buf): tensor
        for name, module in model.named_modules()
        if type(module).__name__.endswith("RotaryEmbedding")
        for buf, tensor in module.named_buffers(recurse=False)
        if buf.endswith("inv_freq")
    }


def keep_rotary_fp32(model, dtype: torch.dtype, device=None):
    """``model.to(device=device, dtype=dtype)``, the rotary inverse frequencies kept as they were (fp32), as
    ``from_pretrained`` in a low precision leaves them. Returns the model."""
    saved = {key: t.detach().clone() for key, t in _rotary_buffers(model).items()}
    model = model.to(device=device, dtype=dtype)
    modules = dict(model.named_modules())
    for (name, buf), value in saved.items():
        modules[name]._buffers[buf] = value.to(device=modules[name]._buffers[buf].device)
    return model


def _finish(model, *, seed: int, dtype: torch.dtype, device, expect: dict):
    randomize_norms(model, seed + 1)
    model = keep_rotary_fp32(model, dtype, device).eval()
    for g in attention_geometry(model):
        got = {"num_qo_heads": g.num_qo_heads, "num_kv_heads": g.num_kv_heads, "head_dim": g.head_dim}
        want = dict(expect)
        if got != want:
            raise PagedWindowError(
                f"tiny model layer {g.layer_idx} ({g.layer_type}) was built with {got}, expected {want}: "
                "this transformers version reads the config keys differently"
            )
    return model


def gemma4_config(
    *,
    sliding_window: int | None = 16,
    num_layers: int = 4,
    layer_types: list[str] | None = None,
    sliding_window_pattern: int = DEFAULT_SLIDING_WINDOW_PATTERN,
    attn_implementation: str = "eager",
    vocab_size: int = 512,
    hidden_size: int = 256,
    intermediate_size: int = 512,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 256,
    attention_k_eq_v: bool = True,
    max_position_embeddings: int = MAX_POSITION_EMBEDDINGS,
    tie_word_embeddings: bool = True,
) -> Gemma4TextConfig:
    """The ``Gemma4TextConfig`` :func:`tiny_gemma4` builds from (no weights: cheap at any width).
    ``tie_word_embeddings=False`` gives the model its own random output head (see :func:`tiny_model`)."""
    require_transformers()
    from transformers import Gemma4TextConfig

    types = _layer_types(layer_types, num_layers, sliding_window_pattern)
    return Gemma4TextConfig(  # type: ignore[call-arg]  # global_head_dim, attn_implementation: **kwargs at runtime
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        global_head_dim=head_dim,
        sliding_window=sliding_window if sliding_window is not None else 1 << 30,
        layer_types=types,
        hidden_size_per_layer_input=0,
        attention_k_eq_v=attention_k_eq_v,
        attn_implementation=attn_implementation,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
    )


def gemma3_config(
    *,
    sliding_window: int = 16,
    num_layers: int = 4,
    layer_types: list[str] | None = None,
    sliding_window_pattern: int = DEFAULT_SLIDING_WINDOW_PATTERN,
    attn_implementation: str = "eager",
    vocab_size: int = 512,
    hidden_size: int = 256,
    intermediate_size: int = 512,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 256,
    query_pre_attn_scalar: int = 256,
    max_position_embeddings: int = MAX_POSITION_EMBEDDINGS,
    tie_word_embeddings: bool = True,
) -> Gemma3TextConfig:
    """The ``Gemma3TextConfig`` :func:`tiny_gemma3` builds from (no weights: cheap at any width)."""
    require_transformers()
    from transformers import Gemma3TextConfig

    types = _layer_types(layer_types, num_layers, sliding_window_pattern)
    return Gemma3TextConfig(  # type: ignore[call-arg]  # attn_implementation: **kwargs at runtime
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        sliding_window=sliding_window,
        layer_types=types,
        query_pre_attn_scalar=query_pre_attn_scalar,
        attn_implementation=attn_implementation,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
    )


def _model_class(family: str):
    require_transformers()
    from transformers import Gemma3ForCausalLM, Gemma4ForCausalLM

    return {"gemma4": Gemma4ForCausalLM, "gemma3": Gemma3ForCausalLM}[family]


def _tiny(family: str, seed: int, dtype: torch.dtype, device, kwargs: dict):
    config = CONFIG_BUILDERS[family](**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _model_class(family)(config)
    return _finish(
        model,
        seed=seed,
        dtype=dtype,
        device=device,
        expect={
            "num_qo_heads": config.num_attention_heads,
            "num_kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
        },
    )


def tiny_gemma4(seed: int = 0, *, dtype: torch.dtype = torch.float32, device="cpu", **config):
    """A random ``Gemma4ForCausalLM`` (text only, no per-layer inputs), every layer at ``head_dim``; ``config``:
    the keywords of :func:`gemma4_config`.

    Full layers use ``global_head_dim = head_dim`` and the same KV heads as sliding layers; with
    ``attention_k_eq_v`` the full layers reuse the key projection as value (V = v_norm(k_proj(x)), K = k_norm(...)
    + RoPE, so K != V after the norms). ``sliding_window=None`` makes the sliding layers' W huge (no effective
    window) — kept for experiments; the config field itself must be an int in Gemma 4.
    """
    return _tiny("gemma4", seed, dtype, device, config)


def tiny_gemma3(seed: int = 0, *, dtype: torch.dtype = torch.float32, device="cpu", **config):
    """A random ``Gemma3ForCausalLM``; ``config``: the keywords of :func:`gemma3_config`. Its attention scale is
    ``query_pre_attn_scalar ** -0.5`` (1/16 by default)."""
    return _tiny("gemma3", seed, dtype, device, config)


CONFIG_BUILDERS: dict[str, Callable[..., PreTrainedConfig]] = {"gemma4": gemma4_config, "gemma3": gemma3_config}
TINY_BUILDERS = {"gemma4": tiny_gemma4, "gemma3": tiny_gemma3}


def tiny_model(family: str, seed: int = 0, **kwargs):
    """``tiny_gemma4`` or ``tiny_gemma3`` by name ("gemma4" | "gemma3").

    Output head: tied to the embedding by default, as in Gemma. A wide random tied model mostly repeats its last
    token (the token's own embedding dominates the final hidden state: at hidden 3840 every greedy step is a copy,
    top1 − top2 ≈ 13), which makes a token comparison say little about attention; ``tie_word_embeddings=False``
    draws a separate head, and the greedy tokens then follow the context."""
    try:
        builder = TINY_BUILDERS[family]
    except KeyError:
        raise PagedWindowError(f"unknown tiny model family {family!r}; one of {sorted(TINY_BUILDERS)}") from None
    return builder(seed, **kwargs)


def tiny_config(family: str, **kwargs) -> PreTrainedConfig:
    """The config :func:`tiny_model` would build ``family`` from, given the same keywords (less ``seed``,
    ``dtype``, ``device``): the geometry of a model too large to build where it is checked."""
    try:
        builder = CONFIG_BUILDERS[family]
    except KeyError:
        raise PagedWindowError(f"unknown tiny model family {family!r}; one of {sorted(CONFIG_BUILDERS)}") from None
    return builder(**kwargs)


def random_prompts(lengths, *, vocab_size: int = 512, seed: int = 0) -> list[list[int]]:
    """Reproducible random token prompts (ids 3..vocab-1: never pad/eos/bos)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (int(n),), generator=gen).tolist() for n in lengths]
