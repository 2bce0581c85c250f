"""Notebook 03's measurement: the case and model its checked parameters (``params.check_greedy_decode``) describe,
and the gate's verdict and headline numbers of a ``pagedwindow.hf.decode_oracle.DecodeResult`` (its
``metrics.json``)."""

from __future__ import annotations

VOCAB_SIZE = 512  # small: the logits and the embedding stay cheap at any width


def model_kwargs(params: dict) -> dict:
    """The ``pagedwindow.hf.tiny_model`` / ``tiny_config`` keywords (less seed, dtype, device) of checked
    parameters: the MLP twice as wide as the model, a :data:`VOCAB_SIZE` vocabulary."""
    p = params
    return {
        "sliding_window": p["sliding_window"],
        "num_layers": p["num_layers"],
        "sliding_window_pattern": p["sliding_window_pattern"],
        "num_attention_heads": p["num_qo_heads"],
        "num_key_value_heads": p["num_kv_heads"],
        "head_dim": p["head_dim"],
        "hidden_size": p["hidden_size"],
        "intermediate_size": 2 * p["hidden_size"],
        "vocab_size": VOCAB_SIZE,
        "tie_word_embeddings": p["tie_word_embeddings"],
    }


def decode_case(params: dict):
    """The ``DecodeCase`` of checked parameters: prompts ``[prompt_len, *extra_prompt_lens]`` as one (ragged)
    batch, each prefilled as ``prefix_len`` tokens then the rest (one chunk when ``prefix_len`` is 0)."""
    from ..hf.decode_oracle import DecodeCase
    from ..kv_state import prefix_chunks

    p = params
    lens = (p["prompt_len"], *p["extra_prompt_lens"])
    prefix = p["prefix_len"]
    chunks = tuple(prefix_chunks(n, prefix) for n in lens) if prefix else None
    return DecodeCase(
        "notebook", lens, p["max_new_tokens"], chunks, page_size=p["page_size"], min_clear_steps=p["min_clear_steps"]
    )


def decode_metrics(result) -> dict:
    """Notebook 03's metrics.json: the oracle's verdict (``"passed"`` | ``"failed"`` | ``"inconclusive"``;
    ``passed`` is true only for ``"passed"``), what failed or why it is inconclusive (``failures``), a one-line
    ``gate_summary``, and the headline numbers (logits vs HF eager, HF's floor, the tolerance, the steps compared,
    how many had a clear margin, how many matched). ``hf_copy_steps``: steps where HF's token repeats the token
    just fed (a model that only copies says little through its tokens); ``clear_copy_steps``: those clear."""
    reqs = result.requests
    failures = list(result.failures)
    if result.inconclusive_reason is not None:
        failures.append(result.inconclusive_reason)
    verdict = result.verdict
    steps, clear = result.compared_steps, result.clear_steps
    tf_matches = sum(a == t for r in reqs for a, t in zip(r.ours_tf_argmax, r.hf_tokens))
    tf_clear_matches = sum(a == t for r in reqs for a, t, c in zip(r.ours_tf_argmax, r.hf_tokens, r.clear) if c)
    free_compared = sum(r.first_unclear for r in reqs)
    copies = [[t == fed for t, fed in zip(r.hf_tokens, [r.prompt[-1], *r.hf_tokens[:-1]])] for r in reqs]
    metrics = {
        "passed": verdict == "passed",
        "verdict": verdict,
        "failures": failures,
        "max_abs_err": max(r.logits.max_abs for r in reqs),
        "max_rel_err": max(r.logits.max_rel for r in reqs),
        "floor_max_abs_err": max(r.floor.max_abs for r in reqs),
        "tolerance": min(r.tol for r in reqs),
        "gate_rule": reqs[0].logits_gate.rule,
        "requests_compared": len(reqs),
        "steps": steps,
        "clear_steps": clear,
        "min_clear_steps": result.case.min_clear_steps,
        "teacher_forced_matches": tf_matches,
        "clear_step_matches": tf_clear_matches,
        "hf_copy_steps": sum(map(sum, copies)),
        "clear_copy_steps": sum(k and c for r, cp in zip(reqs, copies) for k, c in zip(cp, r.clear)),
        "free_running_compared": free_compared,
        "free_running_matches": sum(a == t for r in reqs for a, t in zip(r.ours_tokens, r.hf_tokens)),
        "first_unclear_step": min(r.first_unclear for r in reqs),
        "requests": result.summary(),
    }
    worst = max(reqs, key=lambda r: r.logits_gate.value / r.logits_gate.limit if r.logits_gate.limit else 0.0)
    metrics["gate_summary"] = (
        f"{verdict.upper()}: logits max |ours − HF| {worst.logits_gate.value:.3g} (limit "
        f"{worst.logits_gate.limit:.3g}: {'ok' if all(r.logits_gate.passed for r in reqs) else 'exceeded'}); "
        f"tokens equal at "
        f"{tf_clear_matches}/{clear} clear-margin steps of {steps} compared (need ≥ {result.case.min_clear_steps}"
        f" clear); free-running equal up to the first unclear step: "
        f"{'yes' if all(r.free_tokens_ok for r in reqs) else 'no'}"
    )
    return metrics
