"""Capture what HF hands its attention function, per layer: q (after q_norm and RoPE), k (after k_norm and RoPE),
v (after v_norm), HF's attention output before o_proj, ``scaling`` and ``sliding_window``.

How: a capturing attention function and its mask builder are registered under :data:`CAPTURE_IMPL`; during a
capture the model runs under that name. The *driving* implementation ("eager" or "sdpa") computes the output the
model continues with (so the trajectory is exactly HF's own under that implementation); each implementation in
``compare`` is evaluated on the very same q/k/v with its own HF-built mask, and recorded next to it — that is the
backend floor "on the same inputs". Each implementation gets the mask HF builds for it (``eager_mask`` /
``sdpa_mask``), never a mask translated by us.

With ``projections=True`` each layer's q/k/v projections (the outputs of ``q_proj`` / ``k_proj`` / ``v_proj``
before any norm, ``[B, S, H, D]``; a layer without ``v_proj`` — Gemma 4's full layers with ``attention_k_eq_v`` —
takes its value from the key projection, as HF does) are recorded too, from forward hooks on those modules.

The model is run without a KV cache (``use_cache=False``), so the k/v a layer receives are exactly the prompt's
rows; the model's previous attention implementation is restored afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import PagedWindowError
from ._compat import (
    attention_function,
    attention_implementation,
    attention_modules,
    mask_function,
    register_attention,
)

CAPTURE_IMPL = "pagedwindow_capture"
_ACTIVE_IMPLS: dict = {}  # id(config) -> implementations of the capture running on that model


@dataclass
class LayerCall:
    """One call of one layer's attention function. Tensors are detached copies in the model's dtype."""

    layer_idx: int
    layer_type: str
    q: torch.Tensor  # [B, Hq, S, D]
    k: torch.Tensor  # [B, Hkv, Skv, D]
    v: torch.Tensor  # [B, Hkv, Skv, D]
    outputs: dict  # impl -> [B, S, Hq, D], HF's attention output (before o_proj) under that impl, same q/k/v
    scaling: float
    sliding_window: int | None
    position_ids: torch.Tensor | None  # [B or 1, S]
    driver: str
    q_proj: torch.Tensor | None = None  # [B, S, Hq, D], before q_norm (``projections=True``)
    k_proj: torch.Tensor | None = None  # [B, S, Hkv, D], before k_norm
    v_proj: torch.Tensor | None = None  # [B, S, Hkv, D], before v_norm (the key projection without v_proj)

    @property
    def out(self) -> torch.Tensor:
        """The driving implementation's output (what the model continued with)."""
        return self.outputs[self.driver]


@dataclass
class AttentionCapture:
    """Every attention call of one forward, and the forward's logits."""

    driver: str
    compare: tuple
    calls: list = field(default_factory=list)
    logits: torch.Tensor | None = None  # [B, S, V]

    def layer(self, layer_idx: int) -> LayerCall:
        found = [c for c in self.calls if c.layer_idx == layer_idx]
        if len(found) != 1:
            raise PagedWindowError(f"capture holds {len(found)} calls for layer {layer_idx}, expected 1")
        return found[0]

    @property
    def num_layers(self) -> int:
        return len({c.layer_idx for c in self.calls})


class _Masks:
    """The masks HF builds for each implementation of one capture (one builder call per mask type)."""

    def __init__(self, masks: dict):
        self.masks = masks


class _CaptureContext:
    def __init__(self, driver: str, compare: tuple):
        self.capture = AttentionCapture(driver=driver, compare=compare)
        self.impls = (driver, *compare)


def _capture_mask(**kwargs):
    ctx_impls = _ACTIVE_IMPLS.get(id(kwargs.get("config")))
    if ctx_impls is None:
        raise PagedWindowError(f"{CAPTURE_IMPL} masks were requested outside capture_attention()")
    masks = {}
    for impl in ctx_impls:
        masks[impl] = mask_function(impl)(**dict(kwargs))
    return _Masks(masks)


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    ctx = getattr(module, "_pagedwindow_capture", None)
    if ctx is None:
        raise PagedWindowError(f"{CAPTURE_IMPL} attention was called outside capture_attention()")
    if not isinstance(attention_mask, _Masks):
        raise PagedWindowError(f"{CAPTURE_IMPL}: expected the capture masks, got {type(attention_mask).__name__}")
    outputs = {}
    for impl in ctx.impls:
        out, _ = attention_function(module, impl)(module, query, key, value, attention_mask.masks[impl], **kwargs)
        outputs[impl] = out.detach().clone()
    layer_type = getattr(module, "layer_type", None) or module.config.layer_types[module.layer_idx]
    pos = kwargs.get("position_ids")
    ctx.capture.calls.append(
        LayerCall(
            layer_idx=int(module.layer_idx),
            layer_type=layer_type,
            q=query.detach().clone(),
            k=key.detach().clone(),
            v=value.detach().clone(),
            outputs=outputs,
            scaling=float(kwargs["scaling"]) if kwargs.get("scaling") is not None else float(module.scaling),
            sliding_window=kwargs.get("sliding_window"),
            position_ids=pos.detach().clone() if isinstance(pos, torch.Tensor) else None,
            driver=ctx.impls[0],
        )
    )
    return outputs[ctx.impls[0]], None


def register_capture() -> str:
    """Register the capturing attention function and its mask builder (idempotent); returns the name."""
    return register_attention(CAPTURE_IMPL, _capture_attention, _capture_mask)


def _projection_hooks(modules, store: dict) -> list:
    """Forward hooks recording every layer's q/k/v projections into ``store[layer] = {"q": ..., ...}``
    (``[B, S, H, D]`` copies); returns the hook handles."""
    handles = []
    for m in modules:
        layer, head_dim = int(m.layer_idx), int(m.head_dim)
        sources = {"q": m.q_proj, "k": m.k_proj, "v": m.v_proj if getattr(m, "v_proj", None) is not None else m.k_proj}
        for name, proj in sources.items():

            def hook(_mod, _inp, out, layer=layer, name=name, head_dim=head_dim):
                store.setdefault(layer, {})[name] = out.detach().clone().view(*out.shape[:-1], -1, head_dim)

            # the same module may feed k and v (no v_proj): one hook per (module, name)
            handles.append(proj.register_forward_hook(hook))
    return handles


@torch.no_grad()
def capture_attention(
    model,
    input_ids: torch.Tensor,
    *,
    driver: str = "eager",
    compare=("sdpa",),
    projections: bool = False,
    **forward_kwargs,
) -> AttentionCapture:
    """Run ``model(input_ids)`` once under ``driver`` and capture every layer's attention inputs and outputs.

    input_ids: ``[B, S]`` (use B = 1 per prompt: no padding). ``compare``: implementations evaluated on the same
    inputs (the floor). ``projections``: also record each layer's q/k/v projections (:class:`LayerCall`'s
    ``q_proj`` / ``k_proj`` / ``v_proj``). Returns an :class:`AttentionCapture`; the model's attention
    implementation is restored and the hooks removed.
    """
    register_capture()
    compare = tuple(c for c in compare if c != driver)
    for impl in (driver, *compare):
        if impl not in ("eager", "sdpa"):
            raise PagedWindowError(f"capture_attention: implementation {impl!r} is not 'eager' or 'sdpa'")
    ctx = _CaptureContext(driver, compare)
    modules = attention_modules(model)
    config = model.config
    store: dict = {}
    handles: list = []
    try:
        for m in modules:
            m._pagedwindow_capture = ctx
        _ACTIVE_IMPLS[id(config)] = ctx.impls
        if projections:
            handles = _projection_hooks(modules, store)
        with attention_implementation(model, CAPTURE_IMPL):
            out = model(input_ids=input_ids, use_cache=False, **forward_kwargs)
    finally:
        for h in handles:
            h.remove()
        for m in modules:
            if hasattr(m, "_pagedwindow_capture"):
                del m._pagedwindow_capture
        _ACTIVE_IMPLS.pop(id(config), None)
    for call in ctx.capture.calls:
        if projections:
            got = store.get(call.layer_idx, {})
            if set(got) != {"q", "k", "v"}:
                raise PagedWindowError(f"capture: layer {call.layer_idx} recorded projections {sorted(got)}")
            call.q_proj, call.k_proj, call.v_proj = got["q"], got["k"], got["v"]
    ctx.capture.logits = out.logits.detach().clone()
    if ctx.capture.num_layers != len(modules) or len(ctx.capture.calls) != len(modules):
        raise PagedWindowError(f"capture saw {len(ctx.capture.calls)} attention calls for {len(modules)} layers")
    return ctx.capture


@torch.no_grad()
def forward_logits(model, input_ids: torch.Tensor, *, impl: str, **forward_kwargs) -> torch.Tensor:
    """Logits of one plain forward under HF implementation ``impl`` (restores the previous one)."""
    with attention_implementation(model, impl):
        return model(input_ids=input_ids, use_cache=False, **forward_kwargs).logits.detach().clone()
