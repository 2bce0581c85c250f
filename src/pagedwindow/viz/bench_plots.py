"""Benchmark plots: useful TF/s per workload and system (the GEMM rate marked), pagedwindow's speed-up over
each peer (log axis), each system's output error against the bound the gate applied, and the prep suite's achieved
GB/s against the HBM copy bandwidth. Missing systems are drawn as labelled gaps, never silently dropped."""

from __future__ import annotations

import math

from ..measure.bench_results import PREP_SYSTEMS, BenchResults, applied_bound
from .figures import new_figure, zero_floor

AXIS_LABELS = {  # a sweep slice's axis name (bench_sweep.SweepSlice.x, .y) -> its label on the heat map
    "batch": "requests",
    "new_tokens": "new tokens per request",
    "cached": "cached keys per request",
    "kv_len": "keys per request",
    "page_size": "page size",
    "window_left": "window_left (-1: none)",
    "shape": "batch shape",
}


def plot_throughput(results: BenchResults):
    """Grouped bars: useful TF/s of every system on every workload; ``missing`` where ms is null."""
    workloads, systems = results.workloads, results.systems
    fig, (ax,) = new_figure(width=max(6.0, 1.6 * len(workloads) + 2), height=4.0)
    width = 0.8 / max(1, len(systems))
    top = max([r["useful_tflops"] or 0 for r in results.records] + [1.0])
    labelled = set()
    for j, s in enumerate(systems):
        for i, w in enumerate(workloads):
            r = results.record(w, s)
            x = i - 0.4 + width * (j + 0.5)
            value = r.get("useful_tflops") if r else None
            if value is None:
                ax.text(x, top * 0.02, "missing", rotation=90, ha="center", va="bottom", fontsize=6, color="grey")
            else:
                ax.bar(x, value, width, color=f"C{j}", label=None if s in labelled else s)
                labelled.add(s)
    if labelled:
        ax.legend(fontsize=7)
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads, fontsize=8, rotation=15)
    ax.set_ylabel("useful TF/s (visible pairs only)")
    right = ax.secondary_yaxis(
        "right", functions=(lambda t: 100 * t / results.peak_bf16_tflops, lambda p: p * results.peak_bf16_tflops / 100)
    )
    right.set_ylabel(f"% of the bf16 GEMM rate ({results.peak_bf16_tflops:.0f} TF/s)")
    ax.set_title(f"{results.gpu} — {results.date or results.path.name}", fontsize=9)
    fig.tight_layout()
    return fig


def plot_speedup(results: BenchResults):
    """pagedwindow's speed-up over each peer per workload (peer ms / ours; > 1: we are faster) on a log axis, each
    bar growing from parity (1×) and labelled with its value; ``n/a`` where either time is missing."""
    workloads = results.workloads
    peers = [s for s in results.systems if s != "pagedwindow"]
    fig, (ax,) = new_figure(width=max(6.0, 1.6 * len(workloads) + 2), height=3.6)
    width = 0.8 / max(1, len(peers))
    labelled, values = set(), []
    for j, s in enumerate(peers):
        for i, w in enumerate(workloads):
            ours, peer = results.record(w, "pagedwindow"), results.record(w, s)
            x = i - 0.4 + width * (j + 0.5)
            if ours and peer and ours.get("ms") and peer.get("ms"):
                ratio = peer["ms"] / ours["ms"]
                values.append(ratio)
                ax.bar(x, ratio - 1.0, width, bottom=1.0, color=f"C{j + 1}", label=None if s in labelled else s)
                ax.text(x, ratio, f"{ratio:.2g}×", ha="center", va="bottom" if ratio >= 1 else "top", fontsize=6)
                labelled.add(s)
            else:
                ax.text(x, 1.0, "n/a", rotation=90, ha="center", va="bottom", fontsize=6, color="grey")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_yscale("log")
    lo, hi = min(values + [1.0]), max(values + [1.0])
    ax.set_ylim(lo / 1.5, hi * 1.5)
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads, fontsize=8, rotation=15)
    ax.set_ylabel("peer ms / pagedwindow ms (log)")
    ax.set_title("pagedwindow speed-up over each peer (same run; above 1: pagedwindow is faster)", fontsize=9)
    if ax.containers:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_errors(results: BenchResults, *, max_err_limit: float):
    """Each system's max |output − reference| per workload as points (workloads are categories; systems side by
    side), log scale, exact zeros drawn at least a decade below the smallest non-zero error (the axis says where).
    The bound the gate applied to pagedwindow on each workload (:func:`bench_results.applied_bound`: the run's
    own ``err_bound``, else ``max_err_limit``) is drawn as a red bar across that workload."""
    fig, (ax,) = new_figure(width=max(6.0, 1.6 * len(results.workloads) + 2), height=3.6)
    systems = results.systems
    errors = [r["max_abs_err"] for r in results.records if isinstance(r.get("max_abs_err"), (int, float))]
    zero = zero_floor(errors)
    step = 0.7 / max(1, len(systems))
    for j, s in enumerate(systems):
        xs, ys = [], []
        for i, w in enumerate(results.workloads):
            r = results.record(w, s)
            if r and isinstance(r.get("max_abs_err"), (int, float)) and math.isfinite(r["max_abs_err"]):
                xs.append(i - 0.35 + step * (j + 0.5))
                ys.append(max(r["max_abs_err"], zero))
        if xs:
            ax.plot(xs, ys, ls="none", marker="o", ms=5, color=f"C{j}", label=s)
    bounds = [
        (i, applied_bound(results.record(w, "pagedwindow"), max_err_limit=max_err_limit))
        for i, w in enumerate(results.workloads)
    ]
    drawn = [(i, b) for i, b in bounds if b is not None]
    for k, (i, b) in enumerate(drawn):
        ax.hlines(
            b,
            i - 0.45,
            i + 0.45,
            color="#cb181d",
            lw=1.6,
            label="bound applied by the gate (pagedwindow)" if k == 0 else None,
        )
    if drawn and len({b for _, b in drawn}) <= 3:
        for i, b in drawn:
            ax.text(i + 0.45, b, f"{b:.3g}", color="#cb181d", fontsize=6, ha="right", va="bottom")
    ax.set_yscale("log")
    ax.set_xticks(range(len(results.workloads)))
    ax.set_xticklabels(results.workloads, fontsize=8, rotation=15)
    for i in range(1, len(results.workloads)):
        ax.axvline(i - 0.5, color="#d9d9d9", lw=0.6)
    ax.set_xlim(-0.5, len(results.workloads) - 0.5)
    ax.set_ylabel(f"max |out − reference|\n(exact 0 drawn at {zero:.0e})" if 0 in errors else "max |out − reference|")
    ax.set_title("output error checked before timing, and the bound each workload was judged by", fontsize=9)
    if ax.lines or ax.collections:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def plot_prep_bandwidth(result: dict):
    """The prep suite (``pagedwindow bench --prep``): achieved GB/s (minimum traffic over kernel time) of every
    system on every workload as grouped bars, the HBM copy bandwidth of the same run as a line, each bar labelled
    with its kernel ms; ``missing`` where a system was not timed."""
    records = result["records"]
    workloads = list(dict.fromkeys(r["workload"] for r in records))
    seen = list(dict.fromkeys(r["system"] for r in records))
    systems = [s for s in PREP_SYSTEMS if s in seen] + [s for s in seen if s not in PREP_SYSTEMS]
    hbm = result.get("hbm_gbs")
    fig, (ax,) = new_figure(width=max(6.0, 1.8 * len(workloads) + 2), height=4.0)
    width = 0.8 / max(1, len(systems))
    top = max([r.get("gbs") or 0 for r in records] + [hbm or 0, 1.0])
    labelled = set()
    for j, s in enumerate(systems):
        for i, w in enumerate(workloads):
            r = next((r for r in records if r["workload"] == w and r["system"] == s), None)
            x = i - 0.4 + width * (j + 0.5)
            value = r.get("gbs") if r else None
            if value is None:
                ax.text(x, top * 0.02, "missing", rotation=90, ha="center", va="bottom", fontsize=6, color="grey")
                continue
            ax.bar(x, value, width, color=f"C{j}", label=None if s in labelled else s)
            ax.text(x, value, f"{r['ms'] * 1e3:.0f} µs", ha="center", va="bottom", fontsize=6)
            labelled.add(s)
    if hbm:
        ax.axhline(hbm, color="black", lw=0.8, ls="--", label=f"HBM copy {hbm:.0f} GB/s")
    if labelled or hbm:
        ax.legend(fontsize=7)
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads, fontsize=8, rotation=15)
    ax.set_ylabel("GB/s (q, k, v read + q_out, K, V written) / kernel time")
    ax.set_title(f"Gemma prep: norms, RoPE, paged K/V write — {result['gpu']}, {result.get('date', '')}", fontsize=9)
    fig.tight_layout()
    return fig


def plot_sweep(sweep: list[dict]):
    """One heat map per sweep slice (a results JSON's ``"sweep"`` rows): pagedwindow's speed-up over FlashInfer's
    best at each point, coloured on a log2 scale centred on parity (red: slower, blue: faster) and labelled with
    its value; grey ``n/a`` where a time is missing."""
    from matplotlib.colors import TwoSlopeNorm

    slices = list(dict.fromkeys(r["slice"] for r in sweep))
    cols = min(3, max(1, len(slices)))
    rows_n = -(-len(slices) // cols)
    fig, axes = new_figure(cols, rows_n, width=4.6, height=3.4, layout="constrained")
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-1.0, vmax=1.0)  # log2 of the speed-up: 0.5x .. 2x
    image = None
    for ax, name in zip(axes, slices):
        rows = [r for r in sweep if r["slice"] == name]
        xs = list(dict.fromkeys(r["x"] for r in rows))
        ys = list(dict.fromkeys(r["y"] for r in rows))
        grid = [[math.nan] * len(xs) for _ in ys]
        for r in rows:
            i, j = ys.index(r["y"]), xs.index(r["x"])
            speedup = r["speedup"]
            if speedup is None:
                ax.text(j, i, "n/a", ha="center", va="center", fontsize=6, color="grey")
                continue
            grid[i][j] = math.log2(speedup)
            ax.text(j, i, f"{speedup:.2f}", ha="center", va="center", fontsize=6)
        image = ax.imshow(grid, cmap="RdBu", norm=norm, aspect="auto", origin="lower")
        ax.set_xticks(range(len(xs)))
        ax.set_xticklabels([str(x) for x in xs], fontsize=6, rotation=30)
        ax.set_yticks(range(len(ys)))
        ax.set_yticklabels([str(y) for y in ys], fontsize=6)
        ax.set_xlabel(AXIS_LABELS.get(rows[0]["x_axis"], rows[0]["x_axis"]), fontsize=7)
        ax.set_ylabel(AXIS_LABELS.get(rows[0]["y_axis"], rows[0]["y_axis"]), fontsize=7)
        ax.set_title(name, fontsize=8)
    for ax in axes[len(slices) :]:
        ax.set_visible(False)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="log2(FlashInfer best ms / pagedwindow ms)")
    fig.suptitle("Sweep: pagedwindow kernel speed-up over FlashInfer's best backend timed, same run", fontsize=9)
    return fig
