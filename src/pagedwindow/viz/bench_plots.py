"""Benchmark plots: useful TF/s per workload and system (the GEMM rate marked), pagedwindow's speed-up over
each peer, and each system's output error. Missing systems are drawn as labelled gaps, never silently dropped."""

from __future__ import annotations

from .bench_results import BenchResults
from .figures import new_figure


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
    right = ax.secondary_yaxis("right", functions=(lambda t: 100 * t / results.peak_bf16_tflops,
                                                   lambda p: p * results.peak_bf16_tflops / 100))
    right.set_ylabel(f"% of the bf16 GEMM rate ({results.peak_bf16_tflops:.0f} TF/s)")
    ax.set_title(f"{results.gpu} — {results.date or results.path.name}", fontsize=9)
    fig.tight_layout()
    return fig


def plot_speedup(results: BenchResults):
    """pagedwindow's speed-up over each peer per workload (peer ms / ours; > 1: we are faster)."""
    workloads = results.workloads
    peers = [s for s in results.systems if s != "pagedwindow"]
    fig, (ax,) = new_figure(width=max(6.0, 1.6 * len(workloads) + 2), height=3.6)
    width = 0.8 / max(1, len(peers))
    labelled = set()
    for j, s in enumerate(peers):
        for i, w in enumerate(workloads):
            ours, peer = results.record(w, "pagedwindow"), results.record(w, s)
            x = i - 0.4 + width * (j + 0.5)
            if ours and peer and ours.get("ms") and peer.get("ms"):
                ax.bar(x, peer["ms"] / ours["ms"], width, color=f"C{j + 1}", label=None if s in labelled else s)
                labelled.add(s)
            else:
                ax.text(x, 0.05, "n/a", rotation=90, ha="center", va="bottom", fontsize=6, color="grey")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads, fontsize=8, rotation=15)
    ax.set_ylabel("peer ms / pagedwindow ms")
    ax.set_title("pagedwindow speed-up over each peer (same run)", fontsize=9)
    if ax.containers:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_errors(results: BenchResults, *, limit: float | None = None):
    """Each system's max |output − reference| per workload (log scale), the gate's limit dashed."""
    fig, (ax,) = new_figure(width=max(6.0, 1.6 * len(results.workloads) + 2), height=3.6)
    for j, s in enumerate(results.systems):
        xs, ys = [], []
        for i, w in enumerate(results.workloads):
            r = results.record(w, s)
            if r and r.get("max_abs_err") is not None and r["max_abs_err"] > 0:
                xs.append(i)
                ys.append(r["max_abs_err"])
        if xs:
            ax.plot(xs, ys, marker="o", lw=0.8, color=f"C{j}", label=s)
    if limit is not None:
        ax.axhline(limit, color="#cb181d", ls="--", lw=1.0, label=f"limit {limit:g}")
    ax.set_yscale("log")
    ax.set_xticks(range(len(results.workloads)))
    ax.set_xticklabels(results.workloads, fontsize=8, rotation=15)
    ax.set_ylabel("max |out − reference|")
    ax.set_title("output error checked before timing", fontsize=9)
    if ax.lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
