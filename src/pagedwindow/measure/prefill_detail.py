"""Notebook 01's measurements: a prompt prefilled through the paged path (optionally chunked) against HF.

The gate is the oracle's: ``pagedwindow.hf.run_layer_case`` (ours vs HF eager per layer, HF sdpa vs eager on the
same inputs as the floor, the dtype's calibrated rule from ``pagedwindow.hf.tolerance``). On top of it, for the
plots, :func:`prefill_detail` captures the same prompt once more and keeps what the oracle reduces away: errors
per head and per query row, histograms of every element's error, and the attention weights each layer used
(:func:`pagedwindow.measure.paged_replay.probe_weights`). A weight on a key beyond the window's edge must be exactly 0;
that is part of the gate too.

The prep panel: :func:`prep_metrics` reduces a ``pagedwindow.hf.prep_oracle.run_prep_case`` result (the same
batch's q/k/v projections through ``prepare_paged_qkv``, against HF's own norms and RoPE) to the ``prep`` entry
of ``metrics.json``; :func:`prefill_metrics` makes it part of the gate when given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..semantics import window_left_from_sliding_window
from .paged_replay import WeightProbe, probe_weights, replay_capture

HIST_EDGES = torch.logspace(-10, 1, 67, dtype=torch.float64)  # |error| bins (exact zeros counted apart)


def _histogram(err: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Counts of ``err`` (flattened, float64) over :data:`HIST_EDGES` (clamped into the outer bins), zeros apart."""
    err = err.flatten().double().cpu()
    zeros = int((err == 0).sum())
    nonzero = err[err > 0].clamp(HIST_EDGES[0], HIST_EDGES[-1])
    counts = torch.histogram(nonzero, bins=HIST_EDGES).hist
    return counts, zeros


@dataclass
class LayerDetail:
    """One layer: ours and HF sdpa (the floor) against HF eager, kept per head and per query row."""

    layer: int
    layer_type: str
    window_left: int
    sm_scale: float
    head_err: torch.Tensor  # [Hq] max |ours − eager|
    head_floor: torch.Tensor  # [Hq] max |sdpa − eager|
    row_err: torch.Tensor  # [L] max over heads and head_dim
    row_floor: torch.Tensor  # [L]
    hist_err: torch.Tensor  # [bins] counts of |ours − eager| (non-zero)
    hist_floor: torch.Tensor  # [bins]
    zeros_err: int
    zeros_floor: int
    ref_max: float  # max |eager|
    probe: WeightProbe | None = None


@dataclass
class PrefillDetail:
    prompt_len: int
    chunks: tuple
    page_size: int
    layers: list = field(default_factory=list)
    hist_edges: torch.Tensor = field(default_factory=lambda: HIST_EDGES.clone())
    dtype: torch.dtype | None = None  # the model's dtype (the plots' error scale is anchored at its eps)


@torch.no_grad()
def prefill_detail(
    model,
    prompt: list,
    *,
    chunks,
    page_size: int,
    backend: str,
    seed: int = 0,
    probe: bool = True,
    progress: bool = True,
) -> PrefillDetail:
    """Capture ``prompt`` (HF eager driving, sdpa on the same inputs), replay it through the paged path in
    ``chunks`` and collect per-layer detail (see the module docstring)."""
    from ..hf.capture import capture_attention

    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    cap = capture_attention(model, torch.tensor([prompt], device=device), driver="eager", compare=("sdpa",))
    ours_all = replay_capture(cap, chunks=chunks, page_size=page_size, backend=backend, seed=seed)
    detail = PrefillDetail(prompt_len=len(prompt), chunks=tuple(chunks), page_size=page_size, dtype=dtype)
    calls = sorted(cap.calls, key=lambda c: c.layer_idx)
    for call, ours in tqdm(list(zip(calls, ours_all)), desc="layers", disable=not progress, leave=False):
        eager = call.outputs["eager"][0].double()  # [L, Hq, D]
        sdpa = call.outputs["sdpa"][0].double()
        err = (ours.double() - eager).abs()
        floor = (sdpa - eager).abs()
        hist_err, zeros_err = _histogram(err)
        hist_floor, zeros_floor = _histogram(floor)
        detail.layers.append(
            LayerDetail(
                layer=int(call.layer_idx),
                layer_type=call.layer_type,
                window_left=window_left_from_sliding_window(call.sliding_window),
                sm_scale=call.scaling,
                head_err=err.amax(dim=(0, 2)).cpu(),
                head_floor=floor.amax(dim=(0, 2)).cpu(),
                row_err=err.amax(dim=(1, 2)).cpu(),
                row_floor=floor.amax(dim=(1, 2)).cpu(),
                hist_err=hist_err,
                hist_floor=hist_floor,
                zeros_err=zeros_err,
                zeros_floor=zeros_floor,
                ref_max=float(eager.abs().max()),
                probe=probe_weights(call, chunks=chunks, page_size=page_size, backend=backend, seed=seed)
                if probe
                else None,
            )
        )
    return detail


def prep_metrics(prep) -> dict:
    """The ``prep`` entry of notebook 01's metrics from a ``PrepResult``: per (sliding layer, tensor) rows, the
    largest relative errors per tensor (ours vs the fp32 reference, ours vs HF in the model's dtype, HF's
    floor), the worst gate and a one-line summary. ``passed`` is the prep oracle's verdict."""
    by_tensor = {t: [e for e in prep.errors if e.tensor == t] for t in ("q", "k", "v")}

    def largest(name: str) -> dict:
        return {t: max((getattr(e, name).max_rel for e in es), default=None) for t, es in by_tensor.items()}

    worst = prep.worst() if prep.errors else None
    ours, floor = largest("ours"), largest("floor")
    summary = (
        "prep (norms + RoPE, paged K/V write): max |ours − ref| / max|ref| "
        + ", ".join(f"{t} {ours[t]:.3g}" for t in ours if ours[t] is not None)
        + "; HF's own floor "
        + ", ".join(f"{t} {floor[t]:.3g}" for t in floor if floor[t] is not None)
        + (
            f"; worst layer {worst.layer} {worst.tensor}: {worst.gate.value:.3g} against {worst.gate.limit:.3g} "
            f"({worst.gate.rule})."
            if worst is not None
            else "; no sliding layer compared."
        )
    )
    return {
        "passed": prep.passed,
        "failures": prep.failures(),
        "summary": summary,
        "dtype": prep.dtype,
        "backend": prep.backend,
        "rule": worst.gate.rule if worst is not None else None,
        "max_rel_err": ours,
        "max_rel_err_vs_hf": largest("ours_vs_hf"),
        "floor_max_rel": floor,
        "worst_layer": worst.layer if worst is not None else None,
        "worst_tensor": worst.tensor if worst is not None else None,
        "worst_gate_value": worst.gate.value if worst is not None else None,
        "worst_gate_limit": worst.gate.limit if worst is not None else None,
        "params": {str(layer): p for layer, p in prep.params.items()},
        "layers": prep.rows(),
    }


def _floor_name(oracle) -> str:
    """What the oracle's floor was measured as (fused layers differ: ``pagedwindow.hf.layer_oracle``)."""
    if getattr(oracle, "fused_layers", None):
        return "sdpa vs eager; fused layers: eager vs fp64 of their projections"
    return "sdpa vs eager"


def prefill_metrics(oracle, detail: PrefillDetail, prep=None) -> dict:
    """Headline metrics and per-layer rows of notebook 01 from the oracle's result and the detail (and the prep
    oracle's result, when given: the ``prep`` entry, :func:`prep_metrics`).

    ``passed``: every layer passes the oracle's gate, no backend weight lies beyond a window's edge, and (with
    ``prep``) every sliding layer's q, k and v pass the prep oracle's gate.
    """
    layers = oracle.layers
    failures = [
        f"layer {e.layer} ({e.layer_type}): {e.gate.rule} fails: {e.gate.value:.3g} > {e.gate.limit:.3g}"
        for e in layers
        if not e.gate.passed
    ]
    by_layer = {d.layer: d for d in detail.layers}
    rows = []
    for row in oracle.rows():
        d = by_layer.get(row["layer"])
        if d is not None and d.probe is not None:
            row.update(
                weight_max_err=d.probe.max_err,
                weight_beyond_window=d.probe.weight_beyond_window,
                weight_sum_err=d.probe.weight_sum_err,
                probe_passes=d.probe.passes,
            )
            if d.probe.weight_beyond_window != 0.0:
                failures.append(
                    f"layer {d.layer}: weight {d.probe.weight_beyond_window:.3g} on a key beyond the "
                    f"window's edge (window_left {d.window_left}); it must be exactly 0"
                )
        rows.append(row)
    probes = [d.probe for d in detail.layers if d.probe is not None]
    worst = oracle.worst()
    beyond = max((p.weight_beyond_window for p in probes), default=None)
    summary = (
        f"max |ours − HF eager| = {max(e.ours.max_abs for e in layers):.3g} (rel "
        f"{max(e.ours.max_rel for e in layers):.3g}); HF floor ({_floor_name(oracle)}) "
        f"{max(e.floor.max_abs for e in layers):.3g}; worst layer {worst.layer}: {worst.gate.value:.3g} "
        f"against {worst.gate.limit:.3g} ({worst.gate.rule}); largest weight beyond the window: "
        f"{'not probed' if beyond is None else f'{beyond:.3g}'} (must be 0)."
    )
    prep_entry = prep_metrics(prep) if prep is not None else None
    if prep_entry is not None:
        failures.extend(f"prep: {f}" for f in prep_entry["failures"])
        summary += " " + prep_entry["summary"][0].upper() + prep_entry["summary"][1:]
    out = {
        "passed": not failures,
        "failures": failures,
        "gate_summary": summary,
        "max_abs_err": max(e.ours.max_abs for e in layers),
        "max_rel_err": max(e.ours.max_rel for e in layers),
        "floor_max_abs_err": max(e.floor.max_abs for e in layers),
        "floor_max_rel_err": max(e.floor.max_rel for e in layers),
        "floor_name": _floor_name(oracle),
        "gate_rule": worst.gate.rule,
        "worst_layer": worst.layer,
        "worst_gate_value": worst.gate.value,
        "worst_gate_limit": worst.gate.limit,
        "weight_max_err": max((p.max_err for p in probes), default=None),
        "weight_beyond_window": beyond,
        "chunks": list(detail.chunks),
        "fused_layers": list(getattr(oracle, "fused_layers", [])),
        "layers": rows,
    }
    if prep_entry is not None:
        out["prep"] = prep_entry
    return out
