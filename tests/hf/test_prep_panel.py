"""Notebook 01's prep panel: the ``prep`` entry of metrics.json (pagedwindow.measure.prefill_detail.prep_metrics),
its place in the gate, and the drawing (pagedwindow.viz.prefill_plots.plot_prep_errors)."""

import json
from types import SimpleNamespace

import pytest
import torch

from pagedwindow.hf.prep_oracle import PrepCase, PrepError, PrepResult, prep_gate
from pagedwindow.hf.tolerance import ErrorStats, GateResult
from pagedwindow.measure import prefill_detail
from pagedwindow.viz import figures, prefill_plots


def _result(dtype="bfloat16", *, fail=None, style="gemma4"):
    torch_dtype = getattr(torch, dtype)
    result = PrepResult(
        case=PrepCase("prefill", (9, 4)),
        dtype=dtype,
        backend="reference",
        params={la: {"norm_style": style, "eps": 1e-6, "rope_theta": 10000.0, "factor": 1.0} for la in (0, 1)},
    )
    for layer in (0, 1):
        for i, tensor in enumerate("qkv"):
            zero = dtype == "float32"
            ours = ErrorStats(0.0 if zero else 0.004 * (i + 1), 0.0 if zero else 0.002 * (i + 1), 2.0)
            if (layer, tensor) == fail:
                ours = ErrorStats(0.5, 0.25, 2.0)
            floor = ErrorStats(0.0 if zero else 0.01, 0.0 if zero else 0.005, 2.0)
            result.errors.append(
                PrepError("prefill", layer, tensor, 13, ours, ours, floor, prep_gate(ours, floor, torch_dtype))
            )
    return result


def test_prep_metrics_reduce_the_oracle_and_are_json():
    m = prefill_detail.prep_metrics(_result())
    assert m["passed"] is True and m["failures"] == []
    assert m["max_rel_err"] == pytest.approx({"q": 0.002, "k": 0.004, "v": 0.006})
    assert m["floor_max_rel"] == {"q": 0.005, "k": 0.005, "v": 0.005}
    assert m["rule"] == "max_abs <= max(floor, eps * max|ref|)" and m["params"]["1"]["rope_theta"] == 10000.0
    assert len(m["layers"]) == 6 and m["layers"][0]["tensor"] == "q"
    assert m["summary"].startswith("prep (norms + RoPE, paged K/V write): max |ours − ref| / max|ref| q 0.002")
    json.dumps(m)


def test_a_failing_prep_fails_notebook_01s_gate():
    failing = _result(fail=(1, "k"))
    m = prefill_detail.prep_metrics(failing)
    assert m["passed"] is False and m["worst_layer"] == 1 and m["worst_tensor"] == "k"
    assert m["failures"] == ["layer 1 k: max_abs <= max(floor, eps * max|ref|) fails: 0.5 > 0.0156"]
    ok_gate = GateResult(True, 0.1, 1.0, "rule")
    layer = SimpleNamespace(
        layer=0,
        layer_type="sliding_attention",
        gate=ok_gate,
        ours=ErrorStats(0.1, 0.1, 1.0),
        floor=ErrorStats(0.1, 0.1, 1),
    )
    oracle = SimpleNamespace(layers=[layer], fused_layers=[0], rows=lambda: [{"layer": 0}], worst=lambda: layer)
    detail = prefill_detail.PrefillDetail(prompt_len=9, chunks=(9,), page_size=4)
    assert prefill_detail.prefill_metrics(oracle, detail)["passed"] is True
    metrics = prefill_detail.prefill_metrics(oracle, detail, failing)
    assert metrics["passed"] is False
    assert metrics["failures"] == ["prep: layer 1 k: max_abs <= max(floor, eps * max|ref|) fails: 0.5 > 0.0156"]
    assert "Prep (norms + RoPE" in metrics["gate_summary"] and metrics["prep"]["worst_tensor"] == "k"
    assert metrics["floor_name"] == "sdpa vs eager; fused layers: eager vs fp64 of their projections"


@pytest.mark.parametrize(
    "dtype,style,fail", [("bfloat16", "gemma4", None), ("float32", "gemma3", None), ("bfloat16", "gemma3", (0, "q"))]
)
def test_the_prep_panel_draws(tmp_path, dtype, style, fail):
    fig = prefill_plots.plot_prep_errors(_result(dtype, fail=fail, style=style))
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["q (norm + RoPE)", "k (norm + RoPE)", "v (as projected)" if style == "gemma3" else "v (norm)"]
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    if dtype == "float32":  # exact zeros, no floor to draw
        assert labels == ["gate limit", "ours vs ref (gated)"] and "exact 0 drawn at 1e-06" in fig.axes[0].get_ylabel()
    else:
        assert labels == ["gate limit", "HF vs ref (HF's floor)", "ours vs HF (same dtype)", "ours vs ref (gated)"]
    assert any(t.get_text() == "FAIL" for t in fig.axes[0].texts) == (fail is not None)
    path = figures.save_figure(fig, tmp_path, "prep")
    figures.plt.close(fig)
    assert path.stat().st_size > 1000
