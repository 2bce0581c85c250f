"""The decode gate cannot pass vacuously: a run with fewer than ``min_clear_steps`` clear-margin teacher-forced
steps is inconclusive and fails; a failed check is a failure even then; a run with enough clear steps, all
matching, passes. Checked on hand-made results (every rule branch) and on real tiny-model runs."""

import pytest
import torch

from pagedwindow import PagedWindowError
from pagedwindow.hf.decode_oracle import MIN_CLEAR_STEPS, DecodeCase, DecodeResult, RequestDecode, run_decode_case
from pagedwindow.hf.tolerance import ErrorStats, GateResult
from pagedwindow.measure import decode
from pagedwindow.viz import decode_views

from .conftest import tiny

TOL = 0.05


def _request(margins, *, tf_flip_at=(), logits_ok=True, free_flip_at=None):
    """A RequestDecode whose HF tokens are 10, 11, ...; our teacher-forced argmax differs at ``tf_flip_at``, our
    free-running tokens from ``free_flip_at`` on."""
    n = len(margins)
    hf_tokens = [10 + s for s in range(n)]
    tf = [t + 100 if s in tf_flip_at else t for s, t in enumerate(hf_tokens)]
    free = [t + 200 if free_flip_at is not None and s >= free_flip_at else t for s, t in enumerate(hf_tokens)]
    clear = [m > 2 * TOL for m in margins]
    first_unclear = next((s for s, c in enumerate(clear) if not c), n)
    err = 0.02 if logits_ok else 0.5
    return RequestDecode(
        prompt=[3, 4, 5],
        hf_tokens=hf_tokens,
        ours_tokens=free,
        ours_tf_argmax=tf,
        logit_err=[err] * n,
        floor_err=[0.02] * n,
        margin=list(margins),
        clear=clear,
        tol=TOL,
        logits=ErrorStats(err, err / 4, 4.0),
        floor=ErrorStats(0.02, 0.005, 4.0),
        logits_gate=GateResult(err <= TOL, err, TOL, "max_abs <= tol"),
        tf_tokens_ok=all(a == t for a, t, c in zip(tf, hf_tokens, clear) if c),
        free_tokens_ok=free[:first_unclear] == hf_tokens[:first_unclear],
        first_unclear=first_unclear,
    )


def _result(requests, min_clear_steps=MIN_CLEAR_STEPS):
    n = len(requests[0].hf_tokens)
    case = DecodeCase("t", tuple(3 for _ in requests), n, min_clear_steps=min_clear_steps)
    return DecodeResult(case=case, dtype="bfloat16", backend="reference", requests=requests)


UNCLEAR, CLEAR = 0.01, 0.5


def test_too_few_clear_steps_is_inconclusive_and_fails():
    # every check holds (tokens equal wherever compared), but only 3 of 32 steps have a clear margin
    result = _result([_request([UNCLEAR] * 29 + [CLEAR] * 3)])
    assert result.failures == []
    assert (result.clear_steps, result.compared_steps) == (3, 32)
    assert result.verdict == "inconclusive" and not result.passed
    m = decode.decode_metrics(result)
    assert m["passed"] is False and m["verdict"] == "inconclusive"
    assert m["clear_steps"] == 3 and m["min_clear_steps"] == 8 and m["steps"] == 32
    assert any("only 3 of 32" in f and "min_clear_steps = 8" in f for f in m["failures"])
    assert m["gate_summary"].startswith("INCONCLUSIVE:")
    assert "### INCONCLUSIVE" in decode_views.verdict_markdown(m)


def test_the_old_vacuous_shape_no_clear_step_at_all_fails():
    # margins never clear and free-running parts at step 0: every per-step check is vacuously true
    result = _result([_request([UNCLEAR] * 32, tf_flip_at=range(32), free_flip_at=0)])
    assert result.failures == [] and result.clear_steps == 0
    m = decode.decode_metrics(result)
    assert m["passed"] is False and m["verdict"] == "inconclusive" and m["free_running_compared"] == 0


def test_enough_clear_steps_all_matching_passes():
    margins = [CLEAR] * 8 + [UNCLEAR] + [CLEAR] * 3  # a divergence at the unclear step 8 is allowed
    result = _result([_request(margins, tf_flip_at={8}, free_flip_at=9)])
    assert result.verdict == "passed" and result.passed and result.clear_steps == 11
    m = decode.decode_metrics(result)
    assert m["passed"] is True and m["verdict"] == "passed" and m["failures"] == []
    assert m["clear_step_matches"] == 11 and m["teacher_forced_matches"] == 11 and m["free_running_compared"] == 8
    assert m["gate_summary"].startswith("PASSED:")


def test_clear_steps_count_over_every_request_of_the_batch():
    a, b = _request([CLEAR] * 4 + [UNCLEAR] * 6), _request([UNCLEAR] * 6 + [CLEAR] * 4)
    assert _result([a, b], min_clear_steps=8).verdict == "passed"
    assert _result([a, b], min_clear_steps=9).verdict == "inconclusive"


@pytest.mark.parametrize(
    "request_kwargs,needle",
    [
        ({"tf_flip_at": {2}}, "teacher-forced token differs from HF's at clear-margin steps [2]"),
        ({"logits_ok": False}, "logits max_abs <= tol fails: 0.5 > 0.05"),
        ({"free_flip_at": 1}, "free-running tokens part from HF's before the first unclear step (3)"),
    ],
)
def test_a_failed_check_is_a_failure_even_when_inconclusive(request_kwargs, needle):
    result = _result([_request([CLEAR] * 3 + [UNCLEAR] * 9, **request_kwargs)])
    assert not result.conclusive and result.verdict == "failed"
    m = decode.decode_metrics(result)
    assert m["passed"] is False and m["verdict"] == "failed"
    assert any(needle in f for f in m["failures"]), m["failures"]
    assert any(f.startswith("inconclusive: only 3 of 12") for f in m["failures"])  # both reasons are given


@pytest.mark.parametrize("need", [0, 25])
def test_min_clear_steps_must_be_reachable(need):
    with pytest.raises(PagedWindowError, match=f"min_clear_steps = {need} must be in \\[1, 24\\]"):
        DecodeCase("c", (5, 7), 12, min_clear_steps=need)


# -- real runs ---------------------------------------------------------------------------------------------------
def test_a_real_bf16_run_demanding_more_clear_steps_than_it_has_is_inconclusive():
    model = tiny("gemma4", torch.bfloat16)
    case = DecodeCase("c", (10,), 12, page_size=5, min_clear_steps=1)
    loose = run_decode_case(model, case, backend="reference", seed=1)
    assert loose.failures == [] and loose.verdict == "passed"
    clear = loose.clear_steps
    assert 1 <= clear < 12, f"this seed should give some, not all, clear bf16 steps: {clear}"
    strict = DecodeCase("c", (10,), 12, page_size=5, min_clear_steps=clear + 1)
    again = run_decode_case(model, strict, backend="reference", seed=1)
    assert again.clear_steps == clear and again.failures == []
    assert again.verdict == "inconclusive" and not again.passed
    assert decode.decode_metrics(again)["verdict"] == "inconclusive"


def test_a_real_fp32_run_is_conclusive_with_every_step_clear():
    case = DecodeCase("c", (10, 4), 8, ((6, 4), (3, 1)), page_size=5, min_clear_steps=16)
    result = run_decode_case(tiny("gemma3"), case, backend="reference", seed=2)
    assert result.clear_steps == result.compared_steps == 16
    assert result.verdict == "passed"
