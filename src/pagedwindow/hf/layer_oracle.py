"""Layer oracle: HF's captured per-layer q/k/v fed through pagedwindow, compared with HF's attention output.

For each request (prompt) HF runs alone (B = 1, no padding) under eager; every layer's q/k/v and output are
captured, and HF's sdpa is evaluated on the very same q/k/v (the floor). Our side puts all requests of a case in
one :class:`~pagedwindow.kv_state.PagedKvState` (shuffled page ids, the case's page size) and replays the
prompts in the case's chunk schedule: each step appends the new rows' K/V with ``append_paged_kv`` and reads
them through a ``PrefillPagedPlan`` with ``batch_prefill_paged_window`` — sm_scale from HF's ``scaling``,
window_left from HF's ``sliding_window`` via ``pw.window_left_from_sliding_window`` (full layers: -1). A chunk
that starts at position p > 0 is a chunked prefill on a cached prefix; HF's one-shot causal output row for that
position is the reference (causal attention makes the two the same function).

Also computed: the dense float64 attention of ``pagedwindow.testing`` on the same q/k/v (``truth``), so every
backend's own error can be plotted against a common yardstick.

``fused_prep=True``: the sliding layers are fed HF's q/k/v *projections* (before the norms) through
``PagedKvState.prepare_and_attend`` — ``prepare_paged_qkv`` with the layer's parameters
(:func:`~pagedwindow.hf._compat.sliding_prep`), then the same attention read — so our q/k/v are our own prep's,
not HF's. HF eager stays the reference and the gate's rule is unchanged, but on those layers HF's sdpa floor
(same q/k/v as HF eager) no longer measures the noise between the two sides: ours and HF differ already in the
prep's rounding. There the *floor* is HF eager's own error on the inputs we are given, ``max |HF eager - truth|``
with ``truth`` the float64 attention of HF's prep run in fp32 on the same projections
(:func:`~pagedwindow.hf.prep_oracle.hf_prep_fp32`; for an fp32 model, HF's own q/k/v): if ours is no further
from the truth than HF, ``|ours - HF| <= 2 * floor``. ``ours_vs_truth`` etc. are against that truth too. Full
layers are unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .. import PagedWindowError, window_left_from_sliding_window
from ..kv_state import PagedKvState, chunk_steps, prompt_chunks
from ..testing import dense_attention_of_request
from ._compat import attention_geometry, model_dtype_device, sliding_prep
from .capture import capture_attention
from .models import random_prompts
from .prep_oracle import hf_prep_fp32
from .tolerance import ErrorStats, GateResult, error_stats, gate


@dataclass(frozen=True)
class LayerCase:
    """One layer-oracle scenario.

    prompt_lens: one prompt per request. chunks: per request, the chunk sizes its prompt is fed in (summing to
    its length); ``None`` = each prompt in one step. Step s feeds chunk s of every request that has one.
    """

    name: str
    prompt_lens: tuple
    page_size: int = 16
    chunks: tuple | None = None
    description: str = ""

    def schedule(self) -> list:
        """Per step, per request, the number of new tokens."""
        return chunk_steps(prompt_chunks(self.prompt_lens, self.chunks, what=f"case {self.name}: "))


def default_layer_cases(sliding_window: int = 16) -> list[LayerCase]:
    """The standard scenarios (sized for a window of ``sliding_window``; tiny enough for CPU CI)."""
    w = sliding_window
    return [
        LayerCase("short", (w - 6,), 16, description="prompt shorter than the window"),
        LayerCase("crossing", (3 * w + 5,), 16, description="prompt crossing the window several times"),
        LayerCase(
            "chunked",
            (2 * w + 13,),
            16,
            ((w + 7, w + 6),),
            description="chunked prefill: second step on a cached prefix (start_pos > 0)",
        ),
        LayerCase(
            "decode_steps",
            (w + 8,),
            16,
            ((w + 4, 1, 1, 1, 1),),
            description="prefill then single-row steps past the window edge",
        ),
        LayerCase("page5", (2 * w + 9,), 5, description="page_size 5 does not divide the window"),
        LayerCase(
            "page3_chunked",
            (2 * w + 5,),
            3,
            ((w + 1, w + 4),),
            description="page_size 3, chunked, window edge inside pages",
        ),
        LayerCase("page1", (w + 5,), 1, description="page_size 1"),
        LayerCase(
            "ragged_batch",
            (7, 2 * w + 1, w + 2, 1),
            5,
            ((3, 4), (w, 1, w), (w + 2,), (1,)),
            description="ragged batch of prompts, mixed chunking, one single-token prompt",
        ),
    ]


@dataclass
class LayerError:
    """One layer of one case: ours and HF sdpa against HF eager, and everyone against the fp64 truth."""

    case: str
    layer: int
    layer_type: str
    window_left: int
    sm_scale: float
    tokens: int
    ours: ErrorStats  # ours vs HF eager
    floor: ErrorStats  # HF sdpa vs HF eager (same inputs); fused layers: HF eager vs the truth of the projections
    ours_vs_truth: ErrorStats
    eager_vs_truth: ErrorStats
    sdpa_vs_truth: ErrorStats
    gate: GateResult
    fused: bool = False  # fed through our prep (``fused_prep``)

    def row(self) -> dict:
        """A flat dict (one table row) for notebooks / CSV."""
        out = {
            "case": self.case,
            "layer": self.layer,
            "layer_type": self.layer_type,
            "fused": self.fused,
            "window_left": self.window_left,
            "sm_scale": self.sm_scale,
            "tokens": self.tokens,
        }
        for name in ("ours", "floor", "ours_vs_truth", "eager_vs_truth", "sdpa_vs_truth"):
            stats = getattr(self, name)
            out[f"{name}_max_abs"] = stats.max_abs
            out[f"{name}_max_rel"] = stats.max_rel
        out.update({f"gate_{k}": v for k, v in asdict(self.gate).items()})
        return out


@dataclass
class LayerCaseResult:
    case: LayerCase
    dtype: str
    backend: str
    fused_layers: list = field(default_factory=list)  # layers fed through our prep (``fused_prep``)
    layers: list = field(default_factory=list)  # LayerError per layer
    # per request, per layer: |ours - eager| max over heads and dims, per query position [L] (for plots)
    err_by_position: list = field(default_factory=list)
    floor_by_position: list = field(default_factory=list)
    plan_summaries: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(e.gate.passed for e in self.layers)

    def rows(self) -> list:
        return [dict(e.row(), dtype=self.dtype, backend=self.backend) for e in self.layers]

    def worst(self) -> LayerError:
        return max(self.layers, key=lambda e: e.gate.value / e.gate.limit if e.gate.limit > 0 else float("inf"))


@torch.no_grad()
def run_layer_case(
    model,
    case: LayerCase,
    *,
    backend: str = "auto",
    seed: int = 0,
    prompts: list | None = None,
    fused_prep: bool = False,
) -> LayerCaseResult:
    """Run one :class:`LayerCase` on ``model`` (any dtype / device). See the module docstring. ``fused_prep``:
    the sliding layers are fed HF's q/k/v *projections* through ``PagedKvState.prepare_and_attend`` (our prep,
    then our attention) instead of HF's normed, rotated q/k/v."""
    dtype, device = model_dtype_device(model)
    geometry = attention_geometry(model)
    prep = sliding_prep(model) if fused_prep else {}
    if prompts is None:
        prompts = random_prompts(case.prompt_lens, vocab_size=model.config.vocab_size, seed=seed)
    if [len(p) for p in prompts] != list(case.prompt_lens):
        raise PagedWindowError(f"case {case.name}: prompt lengths {[len(p) for p in prompts]} != {case.prompt_lens}")
    captures = [
        capture_attention(
            model, torch.tensor([p], device=device), driver="eager", compare=("sdpa",), projections=fused_prep
        )
        for p in prompts
    ]
    state = PagedKvState(
        [(g.num_kv_heads, g.head_dim) for g in geometry], page_size=case.page_size, backend=backend, seed=seed
    )
    state.reset(len(prompts))
    # request -> layer -> list of [n, Hq, D]
    ours_rows: list[list[list[torch.Tensor]]] = [[[] for _ in geometry] for _ in prompts]
    result = LayerCaseResult(
        case=case, dtype=str(dtype).replace("torch.", ""), backend=backend, fused_layers=sorted(prep)
    )
    for seq in case.schedule():
        step = state.begin_step(seq)
        for g in geometry:
            calls = [cap.layer(g.layer_idx) for cap in captures]
            window_left = window_left_from_sliding_window(calls[0].sliding_window)
            sm_scale = calls[0].scaling
            act = step.active
            spans = [(step.start[i], step.start[i] + step.seq[i]) for i in act]
            if g.layer_idx in prep:  # the projections [1, L, H, D] through our prep, then our attention
                q, k, v = (
                    torch.cat([getattr(calls[i], name)[0, lo:hi] for i, (lo, hi) in zip(act, spans)])
                    for name in ("q_proj", "k_proj", "v_proj")
                )  # [T, H, D] each
                out = state.prepare_and_attend(
                    g.layer_idx,
                    q,
                    k,
                    v,
                    **prep[g.layer_idx].prep_kwargs(),
                    sm_scale=sm_scale,
                    window_left=window_left,
                )
            else:  # HF's q/k/v [1, H, L, D] after its norms and RoPE
                q, k, v = (
                    torch.cat([getattr(calls[i], name)[0, :, lo:hi].transpose(0, 1) for i, (lo, hi) in zip(act, spans)])
                    for name in ("q", "k", "v")
                )  # [T, H, D] each
                out = state.attend(g.layer_idx, q, k, v, sm_scale=sm_scale, window_left=window_left)
            at = 0
            for i in act:
                ours_rows[i][g.layer_idx].append(out[at : at + step.seq[i]])
                at += step.seq[i]
        plan = state.plan_for(geometry[0].num_qo_heads, geometry[0].num_kv_heads, geometry[0].head_dim)
        result.plan_summaries.append(plan.to_dict())

    # fused layers in a low precision: the truth starts from the projections, prepped by HF in fp32
    low_precision = dtype not in (torch.float32, torch.float64)
    prepped = (
        [hf_prep_fp32(model, torch.tensor([p], device=device), cap, sorted(prep)) for p, cap in zip(prompts, captures)]
        if prep and low_precision
        else None
    )
    for g in geometry:
        calls = [cap.layer(g.layer_idx) for cap in captures]
        window_left = window_left_from_sliding_window(calls[0].sliding_window)
        fused = g.layer_idx in prep
        ours_all, eager_all, sdpa_all, truth_all = [], [], [], []
        for i, call in enumerate(calls):
            ours = torch.cat(ours_rows[i][g.layer_idx])  # [L, Hq, D]
            eager = call.outputs["eager"][0]  # [L, Hq, D]
            sdpa = call.outputs["sdpa"][0]
            q, k, v = prepped[i][g.layer_idx] if fused and prepped is not None else (call.q, call.k, call.v)
            truth = dense_attention_of_request(
                q[0].transpose(0, 1),
                k[0].transpose(0, 1),
                v[0].transpose(0, 1),
                sm_scale=call.scaling,
                window_left=window_left,
            )  # [L, Hq, D] float64
            ours_all.append(ours.reshape(-1))
            eager_all.append(eager.reshape(-1))
            sdpa_all.append(sdpa.reshape(-1))
            truth_all.append(truth.reshape(-1))
            if len(result.err_by_position) <= i:
                result.err_by_position.append([])
                result.floor_by_position.append([])
            result.err_by_position[i].append((ours.double() - eager.double()).abs().amax(dim=(1, 2)).cpu())
            floor_ref = truth.to(eager.device) if fused else sdpa
            result.floor_by_position[i].append((floor_ref.double() - eager.double()).abs().amax(dim=(1, 2)).cpu())
        ours_cat, eager_cat, sdpa_cat = torch.cat(ours_all), torch.cat(eager_all), torch.cat(sdpa_all)
        truth_cat = torch.cat(truth_all)
        ours_stats = error_stats(ours_cat, eager_cat)
        # the floor: HF's own error on the inputs we are given (module docstring)
        floor_stats = (
            error_stats(eager_cat, truth_cat.to(eager_cat.device)) if fused else error_stats(sdpa_cat, eager_cat)
        )
        result.layers.append(
            LayerError(
                case=case.name,
                layer=g.layer_idx,
                layer_type=g.layer_type,
                window_left=window_left,
                sm_scale=calls[0].scaling,
                tokens=int(ours_cat.numel() // (g.num_qo_heads * g.head_dim)),
                fused=fused,
                ours=ours_stats,
                floor=floor_stats,
                ours_vs_truth=error_stats(ours_cat, truth_cat.to(ours_cat.device)),
                eager_vs_truth=error_stats(eager_cat, truth_cat.to(eager_cat.device)),
                sdpa_vs_truth=error_stats(sdpa_cat, truth_cat.to(sdpa_cat.device)),
                gate=gate(ours_stats, floor_stats, dtype),
            )
        )
    return result
