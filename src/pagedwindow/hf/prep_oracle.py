"""Prep oracle: ``pagedwindow.prepare_paged_qkv`` against HF's own q/k/v prep (norms and RoPE), per sliding layer.

For each request (prompt) HF runs alone (B = 1, no padding) under eager; every sliding layer's q/k/v projections
(``q_proj`` / ``k_proj`` / ``v_proj`` outputs, ``[S, H, D]``) and what HF hands its attention function (q and k
after their norms and RoPE, v after v_norm) are captured (:func:`~pagedwindow.hf.capture.capture_attention`).
Our side puts all requests of a case in one :class:`~pagedwindow.kv_state.PagedKvState` of the sliding layers
(shuffled page ids, the case's page size) and feeds the projections in the case's chunk schedule through
:meth:`~pagedwindow.kv_state.PagedKvState.prepare` — ``prepare_paged_qkv`` with the layer's q_norm / k_norm
weights, the norms' eps and the sliding RoPE base, all read and checked by
:func:`~pagedwindow.hf._compat.sliding_prep` (theta must reproduce the rotary module's frequencies bit for bit,
attention scaling 1). A chunk starting at position p > 0 (a cached prefix) rotates its rows at p, p + 1, ...: the
positions come from the paged state. Compared: the q the op returns, and the K and V read back from the pool
slots after the last step (:meth:`~pagedwindow.kv_state.PagedKvState.read_kv`), against HF's.

Reference and gate, per layer and tensor (q, k, v); ``ref`` = HF's prep in fp32 on the same projections:

- fp32 model: ``ref`` is HF's own output; ``max |ours - ref| <= 1e-5 * max |ref|`` (:data:`FP32_PREP_REL_TOL`).
- bf16 / fp16 model: ``ref`` is HF's prep run in fp32 on the captured projections upcast (an fp32 copy of the
  model whose sliding projections are replaced by them: HF's own code, the norm weights upcast), and the
  *floor* is HF's own error, ``max |HF_bf16 - ref|``. Rule: ``max |ours - ref| <= max(floor, eps * max |ref|)``
  (eps = 2**-7 for bf16: between one and two ulps at ``max |ref|``). Ours rounds once from fp32, so it should sit
  near half an ulp; HF's bf16 path rounds after the norm and again in the rotation. ``max |ours - HF_bf16|``
  is reported too (it is at most ours + floor).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

import torch

from .. import PagedWindowError
from ..kv_state import PagedKvState, chunk_steps, prompt_chunks
from ._compat import SLIDING, LayerPrep, attention_geometry, attention_modules, model_dtype_device, sliding_prep
from .capture import AttentionCapture, capture_attention
from .models import random_prompts
from .tolerance import ErrorStats, GateResult, dtype_eps, error_stats

FP32_PREP_REL_TOL = 1e-5
TENSORS = ("q", "k", "v")


@dataclass(frozen=True)
class PrepCase:
    """One prep-oracle scenario: prompts (one per request), the page size, and per request the chunks its prompt
    is fed in (``None``: one chunk each; a later chunk sits on a cached prefix, positions >= 1)."""

    name: str
    prompt_lens: tuple
    page_size: int = 16
    chunks: tuple | None = None
    description: str = ""

    def schedule(self) -> list:
        return chunk_steps(prompt_chunks(self.prompt_lens, self.chunks, what=f"prep case {self.name}: "))


def default_prep_cases(sliding_window: int = 16) -> list[PrepCase]:
    """The CI scenarios: one prompt in one step, and a ragged batch whose later chunks sit on cached prefixes."""
    w = sliding_window
    return [
        PrepCase("one_shot", (3 * w + 5,), 16, description="one prompt, positions 0 .. 3W + 4, one step"),
        PrepCase(
            "ragged_prefix",
            (2 * w + 7, w + 3, 7, 1),
            5,
            ((w + 2, w + 5), (1, w + 2), (3, 1, 3), (1,)),
            description="a ragged batch; later chunks on cached prefixes (start 1, 3, 4, W + 2), page 5",
        ),
    ]


@dataclass
class PrepError:
    """One tensor (q, k or v) of one sliding layer: ours against the fp32 reference, next to HF's own error."""

    case: str
    layer: int
    tensor: str
    tokens: int
    ours: ErrorStats  # ours vs ref (HF's prep in fp32 on the same projections; HF itself for fp32 models)
    ours_vs_hf: ErrorStats  # ours vs HF in the model's dtype
    floor: ErrorStats  # HF in the model's dtype vs ref (zero for fp32 models)
    gate: GateResult

    def row(self) -> dict:
        out = {"case": self.case, "layer": self.layer, "tensor": self.tensor, "tokens": self.tokens}
        for name in ("ours", "ours_vs_hf", "floor"):
            stats = getattr(self, name)
            out[f"{name}_max_abs"] = stats.max_abs
            out[f"{name}_max_rel"] = stats.max_rel
        out["ref_max"] = self.ours.ref_max
        out.update({f"gate_{k}": v for k, v in asdict(self.gate).items()})
        return out


@dataclass
class PrepResult:
    case: PrepCase
    dtype: str
    backend: str
    errors: list = field(default_factory=list)  # PrepError per (sliding layer, tensor)
    params: dict = field(default_factory=dict)  # per sliding layer: norm style, eps, rope theta / factor

    @property
    def passed(self) -> bool:
        return bool(self.errors) and all(e.gate.passed for e in self.errors)

    @property
    def layers(self) -> list:
        return sorted({e.layer for e in self.errors})

    def rows(self) -> list:
        return [dict(e.row(), dtype=self.dtype, backend=self.backend) for e in self.errors]

    def worst(self) -> PrepError:
        return max(self.errors, key=lambda e: e.gate.value / e.gate.limit if e.gate.limit > 0 else float("inf"))

    def failures(self) -> list[str]:
        out = [
            f"layer {e.layer} {e.tensor}: {e.gate.rule} fails: {e.gate.value:.3g} > {e.gate.limit:.3g}"
            for e in self.errors
            if not e.gate.passed
        ]
        return out or ([] if self.errors else ["the model has no sliding layer: nothing was compared"])


def prep_gate(ours: ErrorStats, floor: ErrorStats, dtype: torch.dtype) -> GateResult:
    """The prep's rule (module docstring): fp32 ``max_abs <= 1e-5 * max|ref|``; bf16 / fp16
    ``max_abs <= max(floor, eps * max|ref|)``."""
    if dtype in (torch.float32, torch.float64):
        limit = FP32_PREP_REL_TOL * ours.ref_max
        return GateResult(ours.max_abs <= limit, ours.max_abs, limit, "max_abs <= 1e-5 * max|ref|")
    limit = max(floor.max_abs, dtype_eps(dtype) * ours.ref_max)
    return GateResult(ours.max_abs <= limit, ours.max_abs, limit, "max_abs <= max(floor, eps * max|ref|)")


def _replay_hooks(model, captures: dict) -> list:
    """Forward hooks making each sliding layer's projections return ``captures[layer][name]`` (``[B, S, H, D]``,
    cast to the module's dtype) instead of their own output."""
    handles = []
    for m in attention_modules(model):
        layer = int(m.layer_idx)
        if layer not in captures:
            continue
        sources = [("q", m.q_proj), ("k", m.k_proj)]
        if getattr(m, "v_proj", None) is not None:
            sources.append(("v", m.v_proj))
        for name, proj in sources:

            def hook(_mod, _inp, out, tensor=captures[layer][name]):
                return tensor.reshape(out.shape).to(out.dtype)

            handles.append(proj.register_forward_hook(hook))
    return handles


@torch.no_grad()
def hf_prep_fp32(model, input_ids: torch.Tensor, capture: AttentionCapture, layers) -> dict:
    """HF's prep run in fp32 on the captured projections of ``layers``: an fp32 copy of ``model`` (same weights,
    upcast) whose sliding projections return the captured ones upcast; returns ``{layer: (q, k, v)}`` as HF
    hands them to attention (``[B, H, S, D]`` fp32)."""
    ref_model = copy.deepcopy(model).float()
    replay = {
        c.layer_idx: {"q": c.q_proj.float(), "k": c.k_proj.float(), "v": c.v_proj.float()}
        for c in capture.calls
        if c.layer_idx in layers
    }
    handles = _replay_hooks(ref_model, replay)
    try:
        ref = capture_attention(ref_model, input_ids, driver="eager", compare=())
    finally:
        for h in handles:
            h.remove()
        del ref_model
    return {layer: (ref.layer(layer).q, ref.layer(layer).k, ref.layer(layer).v) for layer in layers}


def _rows(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Positions ``lo .. hi - 1`` of a captured ``[1, S, H, D]`` projection as ``[n, H, D]``."""
    return t[0, lo:hi]


@torch.no_grad()
def run_prep_case(
    model, case: PrepCase, *, backend: str = "auto", seed: int = 0, prompts: list | None = None
) -> PrepResult:
    """Run one :class:`PrepCase` on ``model`` (any dtype / device; ``backend`` "reference" | "cuda" | "auto").
    See the module docstring. Raises ``PagedWindowError`` when the model's prep is not one ``prepare_paged_qkv``
    reproduces (:func:`~pagedwindow.hf._compat.sliding_prep` says what)."""
    dtype, device = model_dtype_device(model)
    params: dict[int, LayerPrep] = sliding_prep(model)
    layers = sorted(params)
    geometry = {g.layer_idx: g for g in attention_geometry(model) if g.layer_type == SLIDING}
    if prompts is None:
        prompts = random_prompts(case.prompt_lens, vocab_size=model.config.vocab_size, seed=seed)
    if [len(p) for p in prompts] != list(case.prompt_lens):
        raise PagedWindowError(
            f"prep case {case.name}: prompt lengths {[len(p) for p in prompts]} != {case.prompt_lens}"
        )
    schedule = case.schedule()
    result = PrepResult(
        case=case,
        dtype=str(dtype).replace("torch.", ""),
        backend=backend,
        params={
            layer: {
                "norm_style": p.norm_style,
                "eps": p.eps,
                "rope_theta": p.rope_theta,
                "factor": p.rope_position_factor,
            }
            for layer, p in params.items()
        },
    )
    if not layers:
        return result
    ids = [torch.tensor([p], device=device) for p in prompts]
    captures = [capture_attention(model, x, driver="eager", compare=(), projections=True) for x in ids]
    low_precision = dtype not in (torch.float32, torch.float64)
    refs = [hf_prep_fp32(model, x, cap, layers) for x, cap in zip(ids, captures)] if low_precision else None

    state = PagedKvState(
        [(geometry[layer].num_kv_heads, geometry[layer].head_dim) for layer in layers],
        page_size=case.page_size,
        backend=backend,
        seed=seed,
    )
    state.reset(len(prompts))
    # request -> local layer -> [n, Hq, D] per step
    ours_q: list[list[list[torch.Tensor]]] = [[[] for _ in layers] for _ in prompts]
    for seq in schedule:
        step = state.begin_step(seq)
        act = step.active
        for local, layer in enumerate(layers):
            calls = [captures[i].layer(layer) for i in act]
            spans = [(step.start[i], step.start[i] + step.seq[i]) for i in act]
            q = torch.cat([_rows(c.q_proj, lo, hi) for c, (lo, hi) in zip(calls, spans)])  # [T, Hq, D]
            k = torch.cat([_rows(c.k_proj, lo, hi) for c, (lo, hi) in zip(calls, spans)])  # [T, Hkv, D]
            v = torch.cat([_rows(c.v_proj, lo, hi) for c, (lo, hi) in zip(calls, spans)])  # [T, Hkv, D]
            q_rot = state.prepare(local, q, k, v, **params[layer].prep_kwargs())  # [T, Hq, D]
            at = 0
            for i in act:
                ours_q[i][local].append(q_rot[at : at + step.seq[i]])
                at += step.seq[i]

    for local, layer in enumerate(layers):
        ours: dict[str, list[torch.Tensor]] = {name: [] for name in TENSORS}
        hf: dict[str, list[torch.Tensor]] = {name: [] for name in TENSORS}
        ref: dict[str, list[torch.Tensor]] = {name: [] for name in TENSORS}
        for i, cap in enumerate(captures):
            call = cap.layer(layer)
            k_back, v_back = state.read_kv(local, i)  # [L, Hkv, D] each, from the pool slots
            ours["q"].append(torch.cat(ours_q[i][local]))  # [L, Hq, D]
            ours["k"].append(k_back)
            ours["v"].append(v_back)
            hf_qkv = (call.q, call.k, call.v)  # [1, H, L, D] each
            ref_qkv = refs[i][layer] if refs is not None else hf_qkv
            for name, h, r in zip(TENSORS, hf_qkv, ref_qkv):
                hf[name].append(h[0].transpose(0, 1))  # [L, H, D]
                ref[name].append(r[0].transpose(0, 1))
        for name in TENSORS:
            o, h, r = (torch.cat(x[name]).reshape(-1) for x in (ours, hf, ref))
            ours_stats, floor = error_stats(o, r), error_stats(h, r)
            result.errors.append(
                PrepError(
                    case=case.name,
                    layer=layer,
                    tensor=name,
                    tokens=sum(case.prompt_lens),
                    ours=ours_stats,
                    ours_vs_hf=error_stats(o, h),
                    floor=floor,
                    gate=prep_gate(ours_stats, floor, dtype),
                )
            )
    return result
