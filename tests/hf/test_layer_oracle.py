"""Layer oracle: HF's captured q/k/v through pagedwindow (shuffled pages, HF's scale and window) vs HF eager."""

import pytest
import torch

import pagedwindow.hf.layer_oracle as layer_oracle
from pagedwindow.hf.layer_oracle import LayerCase, default_layer_cases, run_layer_case

from .conftest import BF16_BACKENDS, FAMILIES, FP32_DEVICES, device_of, tiny

CASES = default_layer_cases(16)
CASE_IDS = [c.name for c in CASES]


def _assert_case(result, dtype):
    assert len(result.layers) == 4
    for e in result.layers:
        assert e.tokens == sum(result.case.prompt_lens)
        assert e.window_left == (15 if e.layer_type == "sliding_attention" else -1)
        assert e.gate.passed, (
            f"{result.case.name} layer {e.layer} ({e.layer_type}): ours max_abs {e.ours.max_abs:.3g} "
            f"rel {e.ours.max_rel:.3g} > limit {e.gate.limit:.3g} (HF sdpa floor {e.floor.max_abs:.3g})"
        )
        if dtype == torch.float32:
            assert e.ours.max_rel <= 1e-4
        else:
            assert e.ours.max_abs <= max(2 * e.floor.max_abs, torch.finfo(dtype).eps * e.ours.ref_max)


def test_cases_cover_the_brief():
    by_name = {c.name: c for c in CASES}
    assert max(by_name["short"].prompt_lens) < 16
    assert by_name["crossing"].prompt_lens[0] >= 3 * 16
    assert any(len(ch) > 1 for ch in by_name["chunked"].chunks)  # a second step on a cached prefix
    assert {c.page_size for c in CASES} >= {16, 5, 3, 1}
    assert len(set(by_name["ragged_batch"].prompt_lens)) == 4


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("device", FP32_DEVICES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_fp32_per_layer_within_rel_1e_4_of_hf_eager(family, device, case):
    result = run_layer_case(tiny(family, torch.float32, device), case, backend="reference", seed=11)
    _assert_case(result, torch.float32)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", BF16_BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_bf16_per_layer_within_the_hf_floor(family, backend, case):
    result = run_layer_case(tiny(family, torch.bfloat16, device_of(backend)), case, backend=backend, seed=11)
    _assert_case(result, torch.bfloat16)
    for e in result.layers:  # honest floor: HF's two backends really differ in bf16 on longer prompts
        if e.tokens >= 16:
            assert e.floor.max_abs > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wrong", ["window_plus_one", "window_minus_one", "no_window"])
def test_a_wrong_window_fails_the_gate(monkeypatch, dtype, wrong):
    """Negative control: the gates are tight enough to catch an off-by-one window, in fp32 and in bf16."""

    def broken(w):
        if w is None:
            return -1
        return {"window_plus_one": w, "window_minus_one": w - 2, "no_window": -1}[wrong]

    monkeypatch.setattr(layer_oracle, "window_left_from_sliding_window", broken)
    result = run_layer_case(tiny("gemma4", dtype), CASES[1], backend="reference", seed=11)  # crossing
    sliding = [e for e in result.layers if e.layer_type == "sliding_attention"]
    full = [e for e in result.layers if e.layer_type == "full_attention"]
    assert all(not e.gate.passed and e.gate.value > 5 * e.gate.limit for e in sliding)
    assert all(e.gate.passed for e in full)


def test_wrong_scale_fails_the_gate(monkeypatch):
    model = tiny("gemma3")
    original = layer_oracle.capture_attention

    def capture_with_wrong_scale(*args, **kwargs):
        cap = original(*args, **kwargs)
        for call in cap.calls:
            call.scaling = 256**-0.5 * 1.01
        return cap

    monkeypatch.setattr(layer_oracle, "capture_attention", capture_with_wrong_scale)
    result = run_layer_case(model, CASES[0], backend="reference")
    assert not any(e.gate.passed for e in result.layers)


def test_the_page_sizes_of_the_cases_do_not_divide_the_window():
    assert {c.page_size for c in CASES} - {16} == {5, 3, 1}
    assert 16 % 5 != 0 and 16 % 3 != 0


def test_results_are_plottable_rows():
    result = run_layer_case(tiny("gemma4"), LayerCase("tiny", (20, 3), page_size=3), backend="reference")
    rows = result.rows()
    assert len(rows) == 4 and {"case", "layer", "ours_max_abs", "floor_max_abs", "gate_passed"} <= set(rows[0])
    assert len(result.err_by_position) == 2 and result.err_by_position[0][0].shape == (20,)
    assert len(result.plan_summaries) == 1


FUSED_CASES = [c for c in CASES if c.name in ("crossing", "chunked", "decode_steps", "ragged_batch")]


def _assert_fused(result, dtype):
    _assert_case(result, dtype)
    assert result.fused_layers == [0, 1]
    assert [e.fused for e in result.layers] == [True, True, False, False]
    for e in result.layers:
        if e.fused and dtype == torch.bfloat16:
            # the rule's premise: our prep + attention is no further from the truth (of the projections) than HF
            assert e.ours_vs_truth.max_abs <= max(e.eager_vs_truth.max_abs, torch.finfo(dtype).eps * e.ours.ref_max)
            assert e.floor.max_abs == e.eager_vs_truth.max_abs > 0  # the fused floor: HF eager's own error


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("device", FP32_DEVICES)
@pytest.mark.parametrize("case", FUSED_CASES, ids=[c.name for c in FUSED_CASES])
def test_fused_prep_fp32_per_layer_within_rel_1e_4_of_hf_eager(family, device, case):
    result = run_layer_case(tiny(family, torch.float32, device), case, backend="reference", seed=11, fused_prep=True)
    _assert_fused(result, torch.float32)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", BF16_BACKENDS)
@pytest.mark.parametrize("case", FUSED_CASES, ids=[c.name for c in FUSED_CASES])
def test_fused_prep_bf16_per_layer_within_the_hf_floor(family, backend, case):
    model = tiny(family, torch.bfloat16, device_of(backend))
    result = run_layer_case(model, case, backend=backend, seed=11, fused_prep=True)
    _assert_fused(result, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_prep_with_the_full_layers_rope_base_fails_the_gate(monkeypatch, dtype):
    """Negative control: the sliding layers rotated with the full layers' base (1e6) fail, full layers pass."""
    import dataclasses

    original = layer_oracle.sliding_prep
    monkeypatch.setattr(
        layer_oracle,
        "sliding_prep",
        lambda model: {k: dataclasses.replace(p, rope_theta=1e6) for k, p in original(model).items()},
    )
    result = run_layer_case(tiny("gemma4", dtype), CASES[1], backend="reference", seed=11, fused_prep=True)
    assert [e.gate.passed for e in result.layers] == [False, False, True, True]
    assert all(e.gate.value > 2 * e.gate.limit for e in result.layers if e.fused)
