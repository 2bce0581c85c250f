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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .. import PagedWindowError, window_left_from_sliding_window
from ..kv_state import PagedKvState, chunk_steps, prompt_chunks
from ..testing import dense_attention_of_request
from ._compat import attention_geometry, model_dtype_device
from .capture import capture_attention
from .models import random_prompts
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
    floor: ErrorStats  # HF sdpa vs HF eager (same inputs)
    ours_vs_truth: ErrorStats
    eager_vs_truth: ErrorStats
    sdpa_vs_truth: ErrorStats
    gate: GateResult

    def row(self) -> dict:
        """A flat dict (one table row) for notebooks / CSV."""
        out = {
            "case": self.case,
            "layer": self.layer,
            "layer_type": self.layer_type,
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
    model, case: LayerCase, *, backend: str = "auto", seed: int = 0, prompts: list | None = None
) -> LayerCaseResult:
    """Run one :class:`LayerCase` on ``model`` (any dtype / device). See the module docstring."""
    dtype, device = model_dtype_device(model)
    geometry = attention_geometry(model)
    if prompts is None:
        prompts = random_prompts(case.prompt_lens, vocab_size=model.config.vocab_size, seed=seed)
    if [len(p) for p in prompts] != list(case.prompt_lens):
        raise PagedWindowError(f"case {case.name}: prompt lengths {[len(p) for p in prompts]} != {case.prompt_lens}")
    captures = [
        capture_attention(model, torch.tensor([p], device=device), driver="eager", compare=("sdpa",)) for p in prompts
    ]
    state = PagedKvState(
        [(g.num_kv_heads, g.head_dim) for g in geometry], page_size=case.page_size, backend=backend, seed=seed
    )
    state.reset(len(prompts))
    ours_rows = [[[] for _ in geometry] for _ in prompts]  # request -> layer -> list of [n, Hq, D]
    result = LayerCaseResult(case=case, dtype=str(dtype).replace("torch.", ""), backend=backend)
    for seq in case.schedule():
        step = state.begin_step(seq)
        for g in geometry:
            calls = [cap.layer(g.layer_idx) for cap in captures]
            window_left = window_left_from_sliding_window(calls[0].sliding_window)
            sm_scale = calls[0].scaling
            act = step.active
            q = torch.cat([calls[i].q[0, :, step.start[i] : step.start[i] + step.seq[i]].transpose(0, 1) for i in act])
            k = torch.cat([calls[i].k[0, :, step.start[i] : step.start[i] + step.seq[i]].transpose(0, 1) for i in act])
            v = torch.cat([calls[i].v[0, :, step.start[i] : step.start[i] + step.seq[i]].transpose(0, 1) for i in act])
            out = state.attend(g.layer_idx, q, k, v, sm_scale=sm_scale, window_left=window_left)
            at = 0
            for i in act:
                ours_rows[i][g.layer_idx].append(out[at : at + step.seq[i]])
                at += step.seq[i]
        plan = state.plan_for(geometry[0].num_qo_heads, geometry[0].num_kv_heads, geometry[0].head_dim)
        result.plan_summaries.append(plan.to_dict())

    for g in geometry:
        calls = [cap.layer(g.layer_idx) for cap in captures]
        window_left = window_left_from_sliding_window(calls[0].sliding_window)
        ours_all, eager_all, sdpa_all, truth_all = [], [], [], []
        for i, call in enumerate(calls):
            ours = torch.cat(ours_rows[i][g.layer_idx])  # [L, Hq, D]
            eager = call.outputs["eager"][0]  # [L, Hq, D]
            sdpa = call.outputs["sdpa"][0]
            truth = dense_attention_of_request(
                call.q[0].transpose(0, 1),
                call.k[0].transpose(0, 1),
                call.v[0].transpose(0, 1),
                sm_scale=call.scaling,
                window_left=window_left,
            )
            ours_all.append(ours.reshape(-1))
            eager_all.append(eager.reshape(-1))
            sdpa_all.append(sdpa.reshape(-1))
            truth_all.append(truth.reshape(-1))
            if len(result.err_by_position) <= i:
                result.err_by_position.append([])
                result.floor_by_position.append([])
            result.err_by_position[i].append((ours.double() - eager.double()).abs().amax(dim=(1, 2)).cpu())
            result.floor_by_position[i].append((sdpa.double() - eager.double()).abs().amax(dim=(1, 2)).cpu())
        ours_cat, eager_cat, sdpa_cat = torch.cat(ours_all), torch.cat(eager_all), torch.cat(sdpa_all)
        truth_cat = torch.cat(truth_all)
        ours_stats = error_stats(ours_cat, eager_cat)
        floor_stats = error_stats(sdpa_cat, eager_cat)
        result.layers.append(
            LayerError(
                case=case.name,
                layer=g.layer_idx,
                layer_type=g.layer_type,
                window_left=window_left,
                sm_scale=calls[0].scaling,
                tokens=int(ours_cat.numel() // (g.num_qo_heads * g.head_dim)),
                ours=ours_stats,
                floor=floor_stats,
                ours_vs_truth=error_stats(ours_cat, truth_cat.to(ours_cat.device)),
                eager_vs_truth=error_stats(eager_cat, truth_cat.to(eager_cat.device)),
                sdpa_vs_truth=error_stats(sdpa_cat, truth_cat.to(sdpa_cat.device)),
                gate=gate(ours_stats, floor_stats, dtype),
            )
        )
    return result
