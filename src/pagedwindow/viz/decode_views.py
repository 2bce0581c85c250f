"""Notebook 03's views of a ``pagedwindow.hf.decode_oracle.DecodeResult``: the token table, the per-step logit
difference against HF (with the floor and the tolerance) and HF's top1 − top2 margin next to it."""

from __future__ import annotations

from .figures import new_figure

TINY = 1e-12


def token_rows(result) -> list[dict]:
    """One row per (request, step): HF's token, our teacher-forced argmax and free-running token, whether each
    matches, HF's margin, whether it is clear, and the logit errors."""
    rows = []
    for row in result.rows():
        rows.append({
            "request": row["request"], "step": row["step"], "hf_token": row["hf_token"],
            "ours_teacher_forced": row["ours_tf_argmax"], "tf_match": row["ours_tf_argmax"] == row["hf_token"],
            "ours_free_running": row["ours_token"], "free_match": row["ours_token"] == row["hf_token"],
            "margin": row["margin"], "clear": row["clear"], "logit_err": row["logit_err"],
            "floor_err": row["floor_err"], "tol": row["tol"],
            "ok": row["ours_tf_argmax"] == row["hf_token"] or not row["clear"],
        })
    return rows


def plot_decode(result, *, sliding_window: int | None = None):
    """Left: per-step max |ours − HF eager| of the logits (teacher-forced), HF sdpa's floor, the tolerance.
    Right: HF's top1 − top2 margin per step and the clear-margin bar (2 · tol): a token is checked only where
    the margin clears it. Steps where the context passes the window are shaded."""
    fig, (left, right) = new_figure(ncols=2, width=6.2, height=3.6)
    for i, r in enumerate(result.requests):
        steps = list(range(len(r.logit_err)))
        tag = f" (request {i})" if len(result.requests) > 1 else ""
        left.plot(steps, [max(e, TINY) for e in r.logit_err], marker="o", ms=3, lw=1.0, color=f"C{i}",
                  label=f"ours vs HF eager{tag}")
        left.plot(steps, [max(e, TINY) for e in r.floor_err], ls=":", lw=1.0, color=f"C{i}",
                  label=f"HF sdpa vs eager{tag}")
        left.axhline(r.tol, color="#cb181d", ls="--", lw=0.8, label="tolerance" if i == 0 else None)
        right.plot(steps, r.margin, marker="o", ms=3, lw=1.0, color=f"C{i}", label=f"HF top1 − top2{tag}")
        right.axhline(2 * r.tol, color="#cb181d", ls="--", lw=0.8, label="clear above (2 · tol)" if i == 0 else None)
        unclear = [s for s, c in zip(steps, r.clear) if not c]
        right.scatter(unclear, [r.margin[s] for s in unclear], marker="x", color="black", zorder=3,
                      label="unclear: token not checked" if i == 0 and unclear else None)
        if sliding_window is not None:
            past = [s for s in steps if len(r.prompt) + s > sliding_window]  # more keys than the window holds
            if past:
                for ax in (left, right):
                    ax.axvspan(past[0] - 0.5, steps[-1] + 0.5, color="#fee0d2", alpha=0.3, zorder=0,
                               label="context past the window" if ax is left and i == 0 else None)
    left.set_yscale("log")
    left.set_xlabel("decode step")
    left.set_ylabel("max |Δ logits|")
    left.set_title("teacher-forced logit difference", fontsize=9)
    left.legend(fontsize=7)
    right.set_xlabel("decode step")
    right.set_ylabel("logit margin")
    right.set_title("HF's top1 − top2 margin", fontsize=9)
    right.legend(fontsize=7)
    fig.tight_layout()
    return fig


def decode_metrics(result) -> dict:
    """Notebook 03's metrics.json: the oracle's gate (``result.passed``), what failed, and the headline numbers
    (logits vs HF eager, HF's floor, the tolerance, how many steps had a clear margin and matched)."""
    failures = []
    for i, r in enumerate(result.requests):
        if not r.logits_gate.passed:
            failures.append(f"request {i}: logits {r.logits_gate.rule} fails: "
                            f"{r.logits_gate.value:.3g} > {r.logits_gate.limit:.3g}")
        bad = [s for s, (a, t, c) in enumerate(zip(r.ours_tf_argmax, r.hf_tokens, r.clear)) if c and a != t]
        if bad:
            failures.append(f"request {i}: teacher-forced token differs from HF's at clear-margin steps {bad}")
        if not r.free_tokens_ok:
            failures.append(f"request {i}: free-running tokens part from HF's before the first unclear step "
                            f"({r.first_unclear})")
    reqs = result.requests
    return {
        "passed": result.passed and not failures,
        "failures": failures,
        "max_abs_err": max(r.logits.max_abs for r in reqs),
        "max_rel_err": max(r.logits.max_rel for r in reqs),
        "floor_max_abs_err": max(r.floor.max_abs for r in reqs),
        "tolerance": min(r.tol for r in reqs),
        "gate_rule": reqs[0].logits_gate.rule,
        "steps": sum(len(r.clear) for r in reqs),
        "clear_steps": sum(sum(r.clear) for r in reqs),
        "teacher_forced_matches": sum(a == t for r in reqs for a, t in zip(r.ours_tf_argmax, r.hf_tokens)),
        "free_running_matches": sum(a == t for r in reqs for a, t in zip(r.ours_tokens, r.hf_tokens)),
        "first_unclear_step": min(r.first_unclear for r in reqs),
        "requests": result.summary(),
    }
