"""Notebook 03's views of a ``pagedwindow.hf.decode_oracle.DecodeResult``: the run described in a line, the token
table, the per-step logit difference against HF (with the floor and the tolerance) and HF's top1 − top2 margin
next to it, and the closing verdict of its ``metrics.json`` (``pagedwindow.measure.decode``)."""

from __future__ import annotations

from .figures import new_figure

TINY = 1e-12


def run_description(params: dict, model, case, *, backend: str, device) -> str:
    """One Markdown line: the model (family, layers and their mix, heads, width, head, window), the paging, the
    dtype, device and the backend that ran, the prompts and their chunks, the decode steps."""
    p, types = params, list(model.config.layer_types)
    chunks = [list(c) for c in case.prefill_chunks] if case.prefill_chunks else "one step each"
    return (
        f"**{p['family']}**, {p['num_layers']} layers ({types.count('sliding_attention')} sliding : "
        f"{types.count('full_attention')} full), {p['num_qo_heads']}/{p['num_kv_heads']} heads × "
        f"{p['head_dim']}, width {p['hidden_size']} ({'tied' if p['tie_word_embeddings'] else 'separate'} "
        f"output head), W = {p['sliding_window']}, page_size {p['page_size']}, {p['dtype']} on {device}, "
        f"backend {backend}: prompts of {list(case.prompt_lens)} tokens (chunks {chunks}), "
        f"{case.max_new_tokens} greedy steps."
    )


def token_rows(result) -> list[dict]:
    """One row per (request, step): HF's token, our teacher-forced argmax and free-running token, whether each
    matches, HF's margin, whether it is clear, and the logit errors."""
    rows = []
    for row in result.rows():
        rows.append(
            {
                "request": row["request"],
                "step": row["step"],
                "hf_token": row["hf_token"],
                "ours_teacher_forced": row["ours_tf_argmax"],
                "tf_match": row["ours_tf_argmax"] == row["hf_token"],
                "ours_free_running": row["ours_token"],
                "free_match": row["ours_token"] == row["hf_token"],
                "margin": row["margin"],
                "clear": row["clear"],
                "logit_err": row["logit_err"],
                "floor_err": row["floor_err"],
                "tol": row["tol"],
                "ok": row["ours_tf_argmax"] == row["hf_token"] or not row["clear"],
            }
        )
    return rows


def plot_decode(result, *, sliding_window: int | None = None):
    """Left: per-step max |ours − HF eager| of the logits (teacher-forced), HF sdpa's floor, the tolerance.
    Right: HF's top1 − top2 margin per step and the clear-margin bar (2 · tol): a token is checked only where
    the margin clears it. Steps where the context passes the window are shaded."""
    fig, (left, right) = new_figure(ncols=2, width=6.2, height=3.6)
    for i, r in enumerate(result.requests):
        steps = list(range(len(r.logit_err)))
        tag = f" (request {i})" if len(result.requests) > 1 else ""
        left.plot(
            steps,
            [max(e, TINY) for e in r.logit_err],
            marker="o",
            ms=3,
            lw=1.0,
            color=f"C{i}",
            label=f"ours vs HF eager{tag}",
        )
        left.plot(
            steps, [max(e, TINY) for e in r.floor_err], ls=":", lw=1.0, color=f"C{i}", label=f"HF sdpa vs eager{tag}"
        )
        left.axhline(r.tol, color="#cb181d", ls="--", lw=0.8, label="tolerance" if i == 0 else None)
        right.plot(steps, r.margin, marker="o", ms=3, lw=1.0, color=f"C{i}", label=f"HF top1 − top2{tag}")
        right.axhline(2 * r.tol, color="#cb181d", ls="--", lw=0.8, label="clear above (2 · tol)" if i == 0 else None)
        unclear = [s for s, c in zip(steps, r.clear) if not c]
        right.scatter(
            unclear,
            [r.margin[s] for s in unclear],
            marker="x",
            color="black",
            zorder=3,
            label="unclear: token not checked" if i == 0 and unclear else None,
        )
        if sliding_window is not None:
            past = [s for s in steps if len(r.prompt) + s > sliding_window]  # more keys than the window holds
            if past:
                for ax in (left, right):
                    ax.axvspan(
                        past[0] - 0.5,
                        steps[-1] + 0.5,
                        color="#fee0d2",
                        alpha=0.3,
                        zorder=0,
                        label="context past the window" if ax is left and i == 0 else None,
                    )
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


def verdict_markdown(metrics: dict) -> str:
    """The notebook's closing lines: the verdict, the gate's numbers, and every failure or the inconclusive
    reason."""
    m = metrics
    lines = [
        f"### {m['verdict'].upper()}",
        f"Logits: max |ours − HF eager| = {m['max_abs_err']:.3g} (rel {m['max_rel_err']:.3g}); HF floor "
        f"{m['floor_max_abs_err']:.3g}; tolerance {m['tolerance']:.3g} ({m['gate_rule']}).",
        f"Tokens, teacher-forced (every step of {m['requests_compared']} request(s) compared, "
        f"{m['steps']} in all): {m['clear_steps']} steps have a clear HF margin (the run needs ≥ "
        f"{m['min_clear_steps']} to be conclusive), our token equals HF's at {m['clear_step_matches']} of "
        f"them ({m['teacher_forced_matches']}/{m['steps']} over all steps, unclear ones included); HF's "
        f"token repeats the one just fed at {m['hf_copy_steps']} steps ({m['clear_copy_steps']} of them clear). "
        f"Free-running: {m['free_running_matches']}/{m['steps']} equal; compared up to each request's first "
        f"unclear step ({m['free_running_compared']} steps; the first unclear step is "
        f"{m['first_unclear_step']}), after which the contexts may legitimately part.",
    ]
    lines += [f"- {f}" for f in m["failures"]]
    return "\n\n".join(lines)
