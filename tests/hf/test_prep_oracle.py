"""Prep oracle: prepare_paged_qkv (through a paged pool and a plan) against HF's own q/k/v norms and RoPE."""

import dataclasses

import pytest
import torch

import pagedwindow as pw
import pagedwindow.hf.prep_oracle as prep_oracle
import pagedwindow.reference as reference
from pagedwindow.hf._compat import sliding_prep
from pagedwindow.hf.models import gemma3_config, keep_rotary_fp32, randomize_norms, tiny_gemma3, tiny_gemma4
from pagedwindow.hf.prep_oracle import PrepCase, default_prep_cases, run_prep_case

from .conftest import BF16_BACKENDS, FAMILIES, FP32_DEVICES, device_of, tiny

CASES = default_prep_cases(16)
CASE_IDS = [c.name for c in CASES]
RAGGED = CASES[1]


def _assert_passed(result):
    assert result.errors and result.layers == [0, 1]  # the tiny models' sliding layers
    assert {(e.layer, e.tensor) for e in result.errors} == {(la, t) for la in (0, 1) for t in "qkv"}
    for e in result.errors:
        assert e.tokens == sum(result.case.prompt_lens)
        assert e.gate.passed, f"layer {e.layer} {e.tensor}: {e.gate.value:.3g} > {e.gate.limit:.3g} ({e.gate.rule})"
    assert result.passed and not result.failures()


def test_the_cases_feed_cached_prefixes_of_a_ragged_batch():
    assert CASES[0].schedule() == [[53]]
    steps = RAGGED.schedule()
    assert len(set(RAGGED.prompt_lens)) == 4 and len(steps) == 3
    starts = {sum(c[:s]) for c in RAGGED.chunks for s in range(1, len(c))}
    assert min(starts) >= 1 and len(starts) >= 3  # later chunks start at 1, 3, 4, W + 2


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("device", FP32_DEVICES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_fp32_prep_within_rel_1e_5_of_hf(family, device, case):
    backend = "cuda" if device == "cuda" else "reference"
    result = run_prep_case(tiny(family, torch.float32, device), case, backend=backend, seed=3)
    _assert_passed(result)
    for e in result.errors:
        assert e.ours.max_rel <= 1e-5 and e.floor.max_abs == 0.0  # fp32: the reference is HF itself
        assert e.ours.ref_max > 0.5


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", BF16_BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_bf16_prep_within_hfs_own_floor_against_hf_in_fp32(family, backend, case):
    result = run_prep_case(tiny(family, torch.bfloat16, device_of(backend)), case, backend=backend, seed=3)
    _assert_passed(result)
    for e in result.errors:
        # ours rounds once from fp32: within half an ulp of the largest element (2**-8 relative)
        assert e.ours.max_abs <= 2**-8 * e.ours.ref_max * 1.01, e.row()
        assert e.ours_vs_hf.max_abs <= e.ours.max_abs + e.floor.max_abs
        if e.tensor in "qk" or family == "gemma4":
            assert e.floor.max_abs > 0  # a measured floor: HF's bf16 prep rounds (Gemma 3's v is not normed)
        else:
            assert e.floor.max_abs == e.ours.max_abs == 0.0  # Gemma 3 writes v as projected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "wrong",
    ["theta", "norm_style", "position_plus_one"],
)
def test_a_wrong_prep_fails_the_gate(monkeypatch, dtype, wrong):
    """Negative controls: the full layers' RoPE base (1e6) on the sliding layers, the other family's norm, or
    positions off by one all fail by more than 2x, in fp32 and in bf16, on the ragged batch with cached prefixes."""
    original = prep_oracle.sliding_prep

    def broken(model):
        params = original(model)
        if wrong == "theta":
            return {k: dataclasses.replace(p, rope_theta=1e6) for k, p in params.items()}
        if wrong == "norm_style":
            return {k: dataclasses.replace(p, norm_style="gemma3") for k, p in params.items()}
        return params

    monkeypatch.setattr(prep_oracle, "sliding_prep", broken)
    if wrong == "position_plus_one":
        positions = reference._token_positions
        monkeypatch.setattr(reference, "_token_positions", lambda plan, device: positions(plan, device) + 1)
    result = run_prep_case(tiny("gemma4", dtype), RAGGED, backend="reference", seed=3)
    failed = {e.tensor for e in result.errors if not e.gate.passed and e.gate.value > 2 * e.gate.limit}
    assert not result.passed
    assert failed == ({"q", "k", "v"} if wrong == "norm_style" else {"q", "k"})  # RoPE does not touch v


def test_rows_and_params_are_reported():
    result = run_prep_case(tiny("gemma3"), PrepCase("mini", (5, 2), 3, ((2, 3), (2,))), backend="reference")
    rows = result.rows()
    assert len(rows) == 2 * 3
    assert {"layer", "tensor", "ours_max_abs", "ours_vs_hf_max_abs", "floor_max_abs", "gate_limit"} <= set(rows[0])
    assert result.params[0] == {"norm_style": "gemma3", "eps": 1e-6, "rope_theta": 10000.0, "factor": 1.0}
    assert result.worst().gate.passed


def test_the_prompts_must_fit_the_case():
    with pytest.raises(pw.PagedWindowError, match=r"prep case mini: prompt lengths \[3\] != \(4,\)"):
        run_prep_case(tiny("gemma4"), PrepCase("mini", (4,)), backend="reference", prompts=[[5, 6, 7]])


def test_a_model_without_sliding_layers_compares_nothing_and_does_not_pass():
    model = tiny_gemma4(0, num_layers=2, layer_types=["full_attention"] * 2)
    result = run_prep_case(model, PrepCase("mini", (4,)), backend="reference")
    assert not result.passed and result.failures() == ["the model has no sliding layer: nothing was compared"]


def test_linear_rope_on_the_sliding_layers_is_reproduced():
    from transformers import Gemma3ForCausalLM

    config = gemma3_config()
    config.rope_parameters["sliding_attention"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Gemma3ForCausalLM(config).eval()
    randomize_norms(model, 1)
    assert {p.rope_position_factor for p in sliding_prep(model).values()} == {2.0}
    _assert_passed(run_prep_case(model, CASES[0], backend="reference", seed=3))


# -- what sliding_prep refuses, each with the reason ------------------------------------------------------------


def _fresh(family="gemma4", **kwargs):
    return (tiny_gemma4 if family == "gemma4" else tiny_gemma3)(0, **kwargs)


def test_refuses_rope_frequencies_rounded_by_a_cast():
    model = tiny_gemma4(0).to(torch.bfloat16)  # a plain cast rounds the rotary buffers to bf16
    with pytest.raises(pw.PagedWindowError, match=r"rope_theta 10000.0 \(factor 1.0\) does not reproduce .*bf16"):
        sliding_prep(model)
    keep_rotary_fp32(tiny_gemma4(0), torch.bfloat16)  # the fix the message names
    assert sliding_prep(keep_rotary_fp32(tiny_gemma4(0), torch.bfloat16))


def test_refuses_a_theta_that_does_not_give_the_models_frequencies():
    model = _fresh()
    model.config.rope_parameters["sliding_attention"]["rope_theta"] = 10001.0
    want = r"rope_theta 10001.0 .* \(127 of 128 values differ; fp32 \[128\] expected\)"
    with pytest.raises(pw.PagedWindowError, match=want):
        sliding_prep(model)


def test_refuses_rope_attention_scaling_other_than_one():
    model = _fresh("gemma3")
    model.model.rotary_emb.sliding_attention_attention_scaling = 0.5
    with pytest.raises(pw.PagedWindowError, match=r"attention_scaling is 0.5, not 1"):
        sliding_prep(model)


def test_refuses_rope_types_the_op_does_not_do():
    model = _fresh()
    model.config.rope_parameters["sliding_attention"]["rope_type"] = "yarn"
    with pytest.raises(pw.PagedWindowError, match=r"RoPE is 'yarn'; prepare_paged_qkv does 'default' and 'linear'"):
        sliding_prep(model)
    model.config.rope_parameters["sliding_attention"].update(rope_type="default", partial_rotary_factor=0.25)
    with pytest.raises(pw.PagedWindowError, match=r"partial_rotary_factor 0.25"):
        sliding_prep(model)
    model.config.rope_parameters = None
    with pytest.raises(pw.PagedWindowError, match=r"names no RoPE base for its sliding layers"):
        sliding_prep(model)


def test_refuses_a_rotary_module_without_sliding_frequencies():
    model = _fresh()
    del model.model.rotary_emb._buffers["sliding_attention_inv_freq"]
    with pytest.raises(pw.PagedWindowError, match=r"has no sliding_attention_inv_freq buffer"):
        sliding_prep(model)


def test_refuses_other_model_types_and_norms():
    model = _fresh()
    model.config.model_type = "llama"
    with pytest.raises(pw.PagedWindowError, match=r"model_type 'llama' is not one of \['gemma3_text', 'gemma4_text'\]"):
        sliding_prep(model)
    model = _fresh()
    model.model.layers[1].self_attn.k_norm = torch.nn.RMSNorm(256, eps=1e-6)
    with pytest.raises(pw.PagedWindowError, match=r"layer 1's k_norm is RMSNorm, not a weighted Gemma4RMSNorm"):
        sliding_prep(model)
    model = _fresh()
    model.model.layers[0].self_attn.v_norm.weight = torch.nn.Parameter(torch.ones(256))
    with pytest.raises(pw.PagedWindowError, match=r"layer 0's v_norm must be an unweighted Gemma4RMSNorm .* weight"):
        sliding_prep(model)
    model = _fresh()
    model.model.layers[0].self_attn.k_norm.eps = 1e-5
    with pytest.raises(pw.PagedWindowError, match=r"layer 0's q/k/v norms use different eps \[1e-06, 1e-05\]"):
        sliding_prep(model)
    model = _fresh("gemma3")
    model.model.layers[0].self_attn.v_norm = model.model.layers[0].self_attn.k_norm
    with pytest.raises(pw.PagedWindowError, match=r"layer 0 has a v_norm; Gemma 3's prep leaves v as projected"):
        sliding_prep(model)


def test_refuses_sliding_layers_of_different_head_dims():
    model = _fresh()
    model.model.layers[1].self_attn.head_dim = 128
    with pytest.raises(pw.PagedWindowError, match=r"the sliding layers have head_dims \[128, 256\]"):
        sliding_prep(model)
