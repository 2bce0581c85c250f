"""Greedy decode through the paged path vs HF generate: teacher-forced logits within the calibrated tolerance,
tokens equal wherever HF's top1 - top2 margin is clear."""

import pytest
import torch

import pagedwindow.hf.integration as integration
from pagedwindow.hf.decode_oracle import DecodeCase, default_decode_cases, hf_generate, run_decode_case, step_logits

from .conftest import BF16_BACKENDS, FAMILIES, FP32_DEVICES, device_of, tiny

CASES = default_decode_cases(16)
CASE_IDS = [c.name for c in CASES]


def _assert_decode(result):
    assert result.requests
    for i, r in enumerate(result.requests):
        n = result.case.max_new_tokens
        assert len(r.hf_tokens) == len(r.ours_tokens) == len(r.logit_err) == n
        assert r.logits_gate.passed, (
            f"{result.case.name} request {i}: logits {r.logits_gate.value:.3g} > {r.logits_gate.limit:.3g} "
            f"(floor max_abs {r.floor.max_abs:.3g})"
        )
        assert r.tf_tokens_ok, f"request {i}: teacher-forced argmax {r.ours_tf_argmax} vs HF {r.hf_tokens}"
        assert r.free_tokens_ok, f"request {i}: free-running {r.ours_tokens} vs HF {r.hf_tokens}"
    assert result.passed


def test_cases_cover_the_brief():
    by_name = {c.name: c for c in CASES}
    crossing = by_name["window_crossing"]
    assert crossing.prompt_lens[0] < 16 < crossing.prompt_lens[0] + crossing.max_new_tokens
    assert len(by_name["chunked_prefill"].prefill_chunks[0]) == 2
    assert len(set(by_name["batch_ragged"].prompt_lens)) == 3


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("device", FP32_DEVICES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_fp32_greedy_decode_matches_hf(family, device, case):
    result = run_decode_case(tiny(family, torch.float32, device), case, backend="reference", seed=5)
    _assert_decode(result)
    for r in result.requests:
        assert r.logits.max_rel <= 1e-4
        assert all(r.clear), f"fp32 tolerance {r.tol:.2g} should leave every margin clear: {r.margin}"
        assert r.ours_tokens == r.hf_tokens and r.ours_tf_argmax == r.hf_tokens


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", BF16_BACKENDS)
def test_bf16_greedy_decode_within_the_hf_floor(family, backend):
    model = tiny(family, torch.bfloat16, device_of(backend))
    results = [run_decode_case(model, c, backend=backend, seed=5) for c in CASES]
    for result in results:
        _assert_decode(result)
    # the token check must not be vacuous: measured 60-75% of the steps have a clear margin on these seeds
    clear = sum(sum(r.clear) for res in results for r in res.requests)
    total = sum(len(r.clear) for res in results for r in res.requests)
    assert clear >= total // 3, f"only {clear}/{total} steps have a clear margin: the token check says little"
    assert all(r.floor.max_abs > 0 for res in results for r in res.requests)  # a real, measured floor


def test_session_saw_prefill_decode_and_resets():
    result = run_decode_case(tiny("gemma4"), CASES[2], backend="reference", seed=5)  # batch_ragged
    info = result.session
    n = CASES[2].max_new_tokens
    # teacher-forced: 1 prefill + (n - 1) decode forwards; generate: 1 prefill + (n - 1) decode forwards
    assert info["forward_steps"] == 2 * n and info["resets"] == 1
    assert info["state"]["batch_size"] == 3
    assert info["state"]["kv_lens"] == [p + n - 1 for p in CASES[2].prompt_lens]


def test_step_logits_reproduces_generate():
    model = tiny("gemma3")
    prompt = torch.randint(3, 512, (13,), generator=torch.Generator().manual_seed(9)).tolist()
    tokens, logits = hf_generate(model, prompt, 6)
    tf_tokens, tf_logits = step_logits(model, [prompt], continuations=[tokens], use_cache=True)
    greedy_tokens, _ = step_logits(model, [prompt], max_new_tokens=6, use_cache=True)
    assert tf_tokens[0] == greedy_tokens[0] == tokens
    torch.testing.assert_close(tf_logits[0], logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_wrong_window_in_the_integration_fails_the_oracle(monkeypatch, dtype):
    monkeypatch.setattr(integration, "window_left_from_sliding_window", lambda w: w if w is not None else -1)
    result = run_decode_case(tiny("gemma4", dtype), CASES[0], backend="reference", seed=5)
    assert not result.passed
    assert all(not r.logits_gate.passed for r in result.requests)


def test_rows_are_plottable():
    case = DecodeCase("mini", (4, 9), 3, page_size=2, min_clear_steps=1)
    result = run_decode_case(tiny("gemma4"), case, backend="reference")
    rows = result.rows()
    assert len(rows) == 2 * 3
    assert {"request", "step", "hf_token", "ours_token", "logit_err", "floor_err", "margin", "clear"} <= set(rows[0])
    assert len(result.summary()) == 2


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("device", FP32_DEVICES)
def test_fused_prep_fp32_greedy_decode_matches_hf(family, device):
    model = tiny(family, torch.float32, device)
    for case in CASES:
        result = run_decode_case(model, case, backend="reference", seed=5, fused_prep=True)
        _assert_decode(result)
        assert result.fused_prep and result.session["fused_prep"] and result.session["fused_layers"] == [0, 1]
        # every sliding layer of every forward went through the prep (teacher-forced and free-running)
        assert result.session["state"]["prep_calls"] == 2 * result.session["forward_steps"]
        for r in result.requests:
            assert r.logits.max_rel <= 1e-4 and all(r.clear)
            assert r.ours_tokens == r.hf_tokens and r.ours_tf_argmax == r.hf_tokens


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", BF16_BACKENDS)
def test_fused_prep_bf16_greedy_decode_within_the_hf_floor(family, backend):
    model = tiny(family, torch.bfloat16, device_of(backend))
    results = [run_decode_case(model, c, backend=backend, seed=5, fused_prep=True) for c in CASES]
    for result in results:
        _assert_decode(result)
        assert result.session["state"]["prep_calls"] == 2 * result.session["forward_steps"]
    clear = sum(sum(r.clear) for res in results for r in res.requests)
    total = sum(len(r.clear) for res in results for r in res.requests)
    assert clear >= total // 3, f"only {clear}/{total} steps have a clear margin: the token check says little"


def test_fused_prep_with_a_wrong_window_fails_the_oracle(monkeypatch):
    monkeypatch.setattr(integration, "window_left_from_sliding_window", lambda w: w if w is not None else -1)
    result = run_decode_case(tiny("gemma4"), CASES[0], backend="reference", seed=5, fused_prep=True)
    assert not result.passed and all(not r.logits_gate.passed for r in result.requests)
