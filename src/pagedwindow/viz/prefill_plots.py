"""Notebook 01's plots: weight error against key distance (window edge marked), error across page boundaries,
per-head heatmaps, the error histogram against HF's backend floor, and the prep's error per sliding layer
against HF's own floor. Each returns a matplotlib figure."""

from __future__ import annotations

import math

import torch

from ..measure.prefill_detail import PrefillDetail
from .figures import error_log_range, new_figure, zero_floor


def _layer_label(d) -> str:
    return f"L{d.layer} {'sliding' if d.window_left >= 0 else 'full'}"


def plot_error_vs_distance(detail: PrefillDetail):
    """Left: max |P_ours − P_fp64| of the attention weights against key distance ``q_pos − k``. Right: the mean
    weight at each distance (fp64 solid, ours dashed) — it must drop to exactly 0 past the window's edge."""
    fig, (left, right) = new_figure(ncols=2, width=6.2, height=3.8)
    edges = set()
    probes = [d.probe for d in detail.layers if d.probe is not None]
    err_zero = zero_floor(*(p.distance_max_err for p in probes))
    weight_zero = zero_floor(*(t for p in probes for t in (p.distance_mean_weight, p.distance_mean_ours)))
    for i, d in enumerate(detail.layers):
        if d.probe is None:
            continue
        x = torch.arange(d.probe.span).numpy()
        left.plot(x, d.probe.distance_max_err.clamp_min(err_zero).numpy(), lw=0.9, color=f"C{i}", label=_layer_label(d))
        right.plot(
            x,
            d.probe.distance_mean_weight.clamp_min(weight_zero).numpy(),
            lw=1.0,
            color=f"C{i}",
            label=f"{_layer_label(d)} fp64",
        )
        right.plot(x, d.probe.distance_mean_ours.clamp_min(weight_zero).numpy(), lw=1.0, ls="--", color=f"C{i}")
        if d.window_left >= 0:
            edges.add(d.window_left)
    for ax in (left, right):
        for e in sorted(edges):
            ax.axvline(e + 0.5, color="#cb181d", ls="--", lw=1.0, label=f"window edge (window_left {e})")
        ax.set_yscale("log")
        ax.set_xlabel("key distance from the query, q_pos − k")
    left.set_ylabel(f"max |P_ours − P_fp64| (exact 0 drawn at {err_zero:.0e})")
    left.set_title("attention-weight error by distance", fontsize=9)
    right.set_ylabel(f"mean attention weight (exact 0 drawn at {weight_zero:.0e})")
    right.set_title("weight profile: fp64 solid, ours dashed", fontsize=9)
    left.legend(fontsize=7)
    right.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return fig


def plot_page_boundaries(detail: PrefillDetail, *, sliding_window: int | None = None):
    """Left: output error per query row (ours solid, HF floor dotted) against position, page boundaries dotted,
    the chunk boundary solid, the first sliding position dashed. Right: weight error by the key's slot in its
    page (a page-boundary bug shows at slot 0 or page_size − 1)."""
    fig, (left, right) = new_figure(ncols=2, width=6.2, height=3.8)
    ps = detail.page_size
    row_zero = zero_floor(*(t for d in detail.layers for t in (d.row_err, d.row_floor)))
    slot_zero = zero_floor(*(d.probe.slot_max_err for d in detail.layers if d.probe is not None))
    for i, d in enumerate(detail.layers):
        x = torch.arange(len(d.row_err)).numpy()
        left.plot(x, d.row_err.clamp_min(row_zero).numpy(), lw=0.9, color=f"C{i}", label=_layer_label(d))
        left.plot(x, d.row_floor.clamp_min(row_zero).numpy(), lw=0.7, ls=":", color=f"C{i}")
        if d.probe is not None:
            right.plot(
                torch.arange(ps).numpy(),
                d.probe.slot_max_err.clamp_min(slot_zero).numpy(),
                marker="o",
                ms=3,
                lw=0.9,
                color=f"C{i}",
                label=_layer_label(d),
            )
    n_pages = -(-detail.prompt_len // ps)
    every = max(1, n_pages // 48)
    for p in range(every, n_pages, every):
        left.axvline(p * ps - 0.5, color="#969696", lw=0.5, ls=":")
    if len(detail.chunks) > 1:
        left.axvline(detail.chunks[0] - 0.5, color="black", lw=1.2, label=f"chunk boundary ({detail.chunks[0]})")
    if sliding_window is not None and sliding_window < detail.prompt_len:
        left.axvline(
            sliding_window - 0.5,
            color="#cb181d",
            ls="--",
            lw=1.0,
            label=f"window starts sliding (q_pos {sliding_window})",
        )
    left.set_yscale("log")
    left.set_xlabel(f"query position (dotted: page boundaries every {ps * every})")
    left.set_ylabel(f"max |ours − HF eager| (dotted: |sdpa − eager|)\nexact 0 drawn at {row_zero:.0e}")
    left.set_title("output error by query position", fontsize=9)
    left.legend(fontsize=7)
    right.set_yscale("log")
    if ps <= 32:
        right.set_xticks(range(ps))
    right.set_xlabel(f"key slot within its page (page_size {ps})")
    right.set_ylabel(f"max |P_ours − P_fp64| (exact 0 drawn at {slot_zero:.0e})")
    right.set_title("weight error by slot in page", fontsize=9)
    if right.lines:
        right.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_head_heatmap(detail: PrefillDetail, *, dtype: torch.dtype | None = None):
    """Max |ours − HF eager| and max |HF sdpa − eager| per (layer, query head) on one fixed log colour scale
    anchored at the eps of ``dtype`` (default: the detail's; :func:`figures.error_log_range`, widened only
    upwards to take in larger errors), so a difference of one ulp is a small step of the scale, not all of it.
    Exact zeros are drawn at the bottom of the scale."""
    dtype = dtype or detail.dtype or torch.float32
    err = torch.stack([d.head_err for d in detail.layers]).double()  # [layers, Hq]
    floor = torch.stack([d.head_floor for d in detail.layers]).double()  # [layers, Hq]
    lo, hi = error_log_range(dtype)
    finite = torch.cat([err.flatten(), floor.flatten()])
    finite = finite[torch.isfinite(finite) & (finite > 0)]
    if finite.numel():
        hi = max(hi, math.ceil(10 * math.log10(float(finite.max()))) / 10)
    logs = [torch.log10(t.clamp(10.0**lo, 10.0**hi)) for t in (err, floor)]
    fig, axes = new_figure(ncols=2, width=max(4.0, 1.0 + 0.45 * err.shape[1]), height=1.2 + 0.45 * err.shape[0])
    for ax, values, log, title in zip(axes, (err, floor), logs, ("ours vs HF eager", "HF sdpa vs eager (floor)")):
        im = ax.imshow(log.numpy(), cmap="magma", vmin=lo, vmax=hi, aspect="auto")
        if values.numel() <= 256:
            for (r, c), v, lv in zip(
                torch.cartesian_prod(torch.arange(values.shape[0]), torch.arange(values.shape[1])),
                values.flatten(),
                log.flatten(),
            ):
                ax.text(
                    int(c),
                    int(r),
                    f"{float(v):.1e}",
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white" if float(lv) < (lo + hi) / 2 else "black",
                )
        ax.set_yticks(range(len(detail.layers)))
        ax.set_yticklabels([_layer_label(d) for d in detail.layers] if ax is axes[0] else [], fontsize=7)
        ax.set_xticks(range(values.shape[1]))
        ax.set_xlabel("query head")
        ax.set_title(title, fontsize=9)
    eps = torch.finfo(dtype).eps
    fig.colorbar(
        im,
        ax=axes,
        label=f"log10 max |error|\nfixed scale: {str(dtype).removeprefix('torch.')} eps {eps:.1e}; 0 at the bottom",
    )
    return fig


def plot_error_histogram(detail: PrefillDetail, *, limit: float | None = None):
    """Every output element's |ours − HF eager| against |HF sdpa − eager| (the floor), all layers, log bins;
    exact zeros counted in the legend; the tightest absolute tolerance among the layers dashed."""
    fig, (ax,) = new_figure(width=7.0, height=3.8)
    edges = detail.hist_edges
    centers = (edges[:-1] * edges[1:]).sqrt().numpy()
    err = torch.stack([d.hist_err for d in detail.layers]).sum(0)
    floor = torch.stack([d.hist_floor for d in detail.layers]).sum(0)
    zeros_err = sum(d.zeros_err for d in detail.layers)
    zeros_floor = sum(d.zeros_floor for d in detail.layers)
    ax.step(centers, err.numpy(), where="mid", lw=1.2, label=f"ours vs HF eager ({zeros_err} exact zeros)")
    ax.step(
        centers,
        floor.numpy(),
        where="mid",
        lw=1.2,
        color="#969696",
        label=f"HF sdpa vs eager — floor ({zeros_floor} exact zeros)",
    )
    if limit is not None:
        ax.axvline(limit, color="#cb181d", ls="--", lw=1.0, label=f"tolerance {limit:.2g} (tightest layer)")
    nonzero = torch.nonzero((err + floor) > 0).flatten()
    if nonzero.numel():
        hi = float(edges[min(len(edges) - 1, int(nonzero[-1]) + 2)])
        ax.set_xlim(float(edges[max(0, int(nonzero[0]) - 1)]), max(hi, 2 * limit) if limit is not None else hi)
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("|error| of one output element")
    ax.set_ylabel("count")
    ax.set_title("error histogram against the HF backend floor", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def tightest_tolerance(oracle, dtype: torch.dtype) -> float:
    """The smallest absolute tolerance the oracle's gate allows among the layers (for the histogram)."""
    from ..hf.tolerance import tolerance

    return min(tolerance(e.ours.ref_max, e.floor.max_abs, dtype) for e in oracle.layers)


def plot_prep_errors(prep):
    """The prep oracle (``pagedwindow.hf.prep_oracle.PrepResult``) per sliding layer, one panel per tensor (q, k,
    v), relative to ``max |ref|`` on a log axis: ours vs the fp32 reference (the gated value), ours vs HF in
    the model's dtype, HF's own floor (HF in the model's dtype vs the reference; zero for fp32 models), and the
    gate's limit as a bar. Exact zeros are drawn a decade below the smallest non-zero value (the label says
    where)."""
    fig, axes = new_figure(ncols=3, width=3.0, height=3.4, sharey=True)
    rel = {}
    for e in prep.errors:
        scale = e.ours.ref_max if e.ours.ref_max > 0 else 1.0
        rel[(e.layer, e.tensor)] = (
            e.ours.max_abs / scale,
            e.ours_vs_hf.max_abs / scale,
            e.floor.max_abs / scale,
            e.gate.limit / scale,
            e.gate.passed,
        )
    zero = zero_floor(*(v for vals in rel.values() for v in vals[:4]))
    low_precision = prep.dtype not in ("float32", "float64")
    layers = sorted({e.layer for e in prep.errors})
    x = list(range(len(layers)))
    for ax, tensor in zip(axes, ("q", "k", "v")):
        vals = [rel.get((layer, tensor)) for layer in layers]
        if not layers or any(v is None for v in vals):
            ax.set_title(f"{tensor}: not compared", fontsize=9)
            continue

        def series(i, vals=vals):
            return [max(v[i], zero) for v in vals]

        ax.scatter(x, series(3), marker="_", s=400, color="#cb181d", label="gate limit", zorder=2)
        if low_precision:
            ax.scatter(x, series(2), marker="x", color="#969696", label="HF vs ref (HF's floor)", zorder=3)
            ax.scatter(
                x, series(1), marker="o", facecolors="none", edgecolors="C1", label="ours vs HF (same dtype)", zorder=3
            )
        ax.scatter(x, series(0), marker="o", color="C0", label="ours vs ref (gated)", zorder=4)
        for xi, v in zip(x, vals):
            if not v[4]:
                ax.annotate(
                    "FAIL",
                    (xi, max(v[0], zero)),
                    fontsize=7,
                    color="#cb181d",
                    xytext=(4, 4),
                    textcoords="offset points",
                )
        ax.set_xticks(x, [f"L{layer}" for layer in layers])
        ax.set_xlim(-0.6, len(layers) - 0.4)
        ax.set_yscale("log")
        styles = {p.get("norm_style") for p in prep.params.values()}
        what = {"q": "norm + RoPE", "k": "norm + RoPE", "v": "as projected" if styles == {"gemma3"} else "norm"}
        ax.set_title(f"{tensor} ({what[tensor]})", fontsize=9)
        ax.set_xlabel("sliding layer")
    ref = "HF's prep in fp32 on the same projections" if low_precision else "HF fp32"
    axes[0].set_ylabel(f"max |error| / max |ref|  (exact 0 drawn at {zero:.0e})", fontsize=8)
    axes[0].legend(fontsize=6, loc="best")
    fig.suptitle(f"prep error per sliding layer ({prep.dtype}, backend {prep.backend}); ref: {ref}", fontsize=9)
    fig.tight_layout()
    return fig
