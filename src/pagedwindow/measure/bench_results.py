"""Benchmark results files (``benchmarks/results/<gpu>-<date>[-label].json``): found, validated, tabulated, gated.

Schema: ``{"gpu": str, "peak_bf16_tflops": float, "records": [record, ...]}`` (``date``, ``torch``,
``tile_override`` ... optional). A *timing record* has ``system``, ``workload`` and ``ms`` (kernel time; ``null`` =
the system is missing or failed; ``status`` may say why), ``useful_tflops`` and ``max_abs_err`` (numbers or
``null``); newer files add ``e2e_ms`` (back-to-back API calls), ``plan_ms`` / ``update_plan_ms`` (host planning;
``null`` where not applicable), ``plan_ms_host_indptr`` (FlashInfer) and ``plan_ms_host_csr`` /
``update_plan_ms_host_csr`` (pagedwindow from CPU tensors), numbers or ``null`` when present. Records without ``ms``
are auxiliary metrics (e.g. ``{"metric": "allocations_per_10_calls", "value": 0}``) and are listed apart.

The prep suite (``pagedwindow bench --prep``) writes ``<gpu>-<date>-prep[-label].json`` with ``"suite": "prep"``,
the HBM copy bandwidth of the same run (``hbm_gbs``) in place of a GEMM rate, and its own ratios and bars
(:func:`prep_ratios`, :func:`prep_bars`); :func:`newest_results` never picks such a file, nor a measuring tool's
table (a JSON object without ``"records"``: host cost, planning, kernel variants).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

SYSTEMS = ("pagedwindow", "flashinfer_fa2", "flashinfer_fa3", "flex", "sdpa")
FLASHINFER_SYSTEMS = ("flashinfer_fa2", "flashinfer_fa3")
TIMES = (
    "e2e_ms",
    "ms",
    "plan_ms",
    "update_plan_ms",
    "plan_ms_host_indptr",
    "plan_ms_host_csr",
    "update_plan_ms_host_csr",
)
"""A record's times in ms (``ms``: kernel time); each a number or null."""
RESULTS_PATTERN = re.compile(r"^([a-z0-9]+(?:-[a-z0-9]+)*?)-(\d{4}-\d{2}-\d{2})(.*)\.json$")
"""``<gpu-slug>-<date>[-label].json`` (``h200-2026-12-02.json``); group 2 is the date."""


PREP_LABEL = "prep"
"""The label of the prep suite's files: ``<gpu>-<date>-prep[-label].json``."""


def is_prep_results(name: str) -> bool:
    """Whether a results file name is the prep suite's (``<gpu>-<date>-prep[-label].json``)."""
    match = RESULTS_PATTERN.match(name)
    return bool(match) and (match.group(3) == f"-{PREP_LABEL}" or match.group(3).startswith(f"-{PREP_LABEL}-"))


def is_tool_table(path: Path) -> bool:
    """Whether a ``<gpu>-<date>-label.json`` is a table of a measuring tool, not attention results: a JSON object
    without ``"records"`` (``benchmarks/host_cost.py`` and ``plan_profile.py`` write ``{"gpu", "rows"}``,
    ``variant_ab.py`` its rounds). A file that cannot be read as JSON is not one (the reader reports it)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "records" not in data


def newest_results(results_dir) -> Path | None:
    """The ``<gpu>-<date>*.json`` with the latest date in the directory ``results_dir`` (name order breaks ties),
    or None (also for ``results_dir`` None or not a directory); the prep suite's files (:func:`is_prep_results`)
    and the tools' tables (:func:`is_tool_table`) are not attention results and are never picked. A name as a
    user typed it is resolved first by the caller (``pagedwindow.viz.paths.resolve_path``: the working directory,
    then the repository)."""
    if results_dir is None or not Path(results_dir).is_dir():
        return None
    files = [p for p in Path(results_dir).iterdir() if RESULTS_PATTERN.match(p.name) and not is_prep_results(p.name)]
    newest_first = sorted(files, key=lambda p: (RESULTS_PATTERN.match(p.name).group(2), p.name), reverse=True)
    return next((p for p in newest_first if not is_tool_table(p)), None)


@dataclass
class BenchResults:
    path: Path
    gpu: str
    peak_bf16_tflops: float
    records: list  # timing records (dicts with "ms")
    auxiliary: list = field(default_factory=list)  # records without "ms"
    date: str | None = None
    prefill_kernel: str | None = None  # the prefill kernel pagedwindow ran in that run, when the file says

    @property
    def workloads(self) -> list[str]:
        return list(dict.fromkeys(r["workload"] for r in self.records))

    @property
    def systems(self) -> list[str]:
        seen = list(dict.fromkeys(r["system"] for r in self.records))
        return [s for s in SYSTEMS if s in seen] + [s for s in seen if s not in SYSTEMS]

    def record(self, workload: str, system: str) -> dict | None:
        return next((r for r in self.records if r["workload"] == workload and r["system"] == system), None)


def _number_or_null(where: str, name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"{where}: {name} must be a number or null, got {value!r}")


def load_results(path) -> BenchResults:
    """Read and validate one results file; a ValueError names the first field that breaks the schema."""
    path = Path(path)
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path.name}: the top level must be an object")
    if not isinstance(data.get("gpu"), str):
        raise ValueError(f"{path.name}: 'gpu' must be a string, got {data.get('gpu')!r}")
    peak = data.get("peak_bf16_tflops")
    if isinstance(peak, bool) or not isinstance(peak, (int, float)) or not peak > 0:
        raise ValueError(f"{path.name}: 'peak_bf16_tflops' must be a positive number, got {peak!r}")
    if not isinstance(data.get("records"), list):
        raise ValueError(f"{path.name}: 'records' must be a list")
    timing, auxiliary = [], []
    for i, r in enumerate(data["records"]):
        where = f"{path.name}: records[{i}]"
        if not isinstance(r, dict) or not isinstance(r.get("system"), str) or not isinstance(r.get("workload"), str):
            raise ValueError(f"{where} needs string 'system' and 'workload', got {r!r}")
        if "ms" not in r:
            auxiliary.append(r)
            continue
        for name in (*TIMES, "useful_tflops", "max_abs_err"):
            _number_or_null(where, name, r.get(name))
        timing.append(r)
    match = RESULTS_PATTERN.match(path.name)
    return BenchResults(
        path=path,
        gpu=data["gpu"],
        peak_bf16_tflops=float(peak),
        records=timing,
        auxiliary=auxiliary,
        date=data.get("date") or (match.group(2) if match else None),
        prefill_kernel=data.get("prefill_kernel") if isinstance(data.get("prefill_kernel"), str) else None,
    )


def flashinfer_ratios(records: list) -> dict:
    """``{(workload, system): (e2e_ms / FlashInfer's best e2e_ms, ms / FlashInfer's best ms)}``.

    FlashInfer's best is the faster of fa2 / fa3 on that workload (``min`` over their times); a ratio is ``None``
    where either time is missing. Below 1: faster than FlashInfer.
    """

    def best(workload, key):
        return min(
            (
                r[key]
                for r in records
                if r["workload"] == workload and r["system"] in FLASHINFER_SYSTEMS and r.get(key) is not None
            ),
            default=None,
        )

    def ratio(r, key):
        fi = best(r["workload"], key)
        return r[key] / fi if r.get(key) is not None and fi else None

    return {(r["workload"], r["system"]): (ratio(r, "e2e_ms"), ratio(r, "ms")) for r in records}


def summary_rows(results: BenchResults) -> list[dict]:
    """One row per (workload, system): the times, useful TF/s, % of the bf16 GEMM rate measured in the same run,
    pagedwindow's kernel speed-up over that system (its ms / ours), each time over FlashInfer's best,
    max_abs_err and status."""
    rows = []
    ratios = flashinfer_ratios(results.records)
    for w in results.workloads:
        ours = results.record(w, "pagedwindow")
        ours_ms = ours.get("ms") if ours else None
        for s in results.systems:
            r = results.record(w, s)
            if r is None:
                continue
            ms, tflops = r.get("ms"), r.get("useful_tflops")
            e2e_ratio, ms_ratio = ratios[w, s]
            rows.append(
                {
                    "workload": w,
                    "system": s,
                    "e2e_ms": r.get("e2e_ms"),
                    "ms": ms,
                    "plan_ms": r.get("plan_ms"),
                    "update_plan_ms": r.get("update_plan_ms"),
                    "useful_tflops": tflops,
                    "pct_of_gemm": 100 * tflops / results.peak_bf16_tflops if tflops is not None else None,
                    "pagedwindow_speedup": ms / ours_ms if ms is not None and ours_ms else None,
                    "e2e_vs_flashinfer_best": e2e_ratio,
                    "ms_vs_flashinfer_best": ms_ratio,
                    "max_abs_err": r.get("max_abs_err"),
                    "status": r.get("status", "ok" if ms is not None else "missing"),
                }
            )
    return rows


def applied_bound(record: dict | None, *, max_err_limit: float) -> float | None:
    """The bound on ``max_abs_err`` that :func:`bench_gate` applies to a pagedwindow record: the run's own
    ``err_bound`` when the record carries a ``status`` (None when that run recorded no bound: only its status is
    judged), else the fallback ``max_err_limit``."""
    if record is None:
        return None
    if "status" in record:
        return record.get("err_bound")
    return max_err_limit


def bench_gate(results: BenchResults, *, max_err_limit: float) -> list[str]:
    """Failures (empty = pass): pagedwindow must be timed on every workload of the file, and its output must have
    passed the run's own check against the reference. Records carrying ``status`` (the bench's verdict under its
    relative rule, with the reference in hand; ``err_bound`` when recorded) are judged by it; older records
    without one by a finite ``max_abs_err <= max_err_limit`` (:func:`applied_bound` names the bound)."""
    failures = []
    for w in results.workloads:
        r = results.record(w, "pagedwindow")
        if r is None or r.get("ms") is None:
            status = r.get("status", "no record") if r else "no record"
            failures.append(f"{w}: pagedwindow was not timed ({status})")
            continue
        err = r.get("max_abs_err")
        bound = applied_bound(r, max_err_limit=max_err_limit)
        if err is None or not math.isfinite(err):
            failures.append(f"{w}: pagedwindow max_abs_err {err!r} is not a finite number")
        elif "status" in r:
            if r["status"] != "ok" or (bound is not None and err > bound):
                failures.append(
                    f"{w}: pagedwindow output check failed in the run ({r['status']}, "
                    f"max_abs_err {err:g}, bound {bound!r})"
                )
        elif err > bound:
            failures.append(f"{w}: pagedwindow max_abs_err {err!r} exceeds {max_err_limit:g}")
    return failures


def gate_summary(results: BenchResults, failures: list[str], *, max_err_limit: float) -> str:
    """One sentence for the report: how many workloads pagedwindow was timed on and its worst error against the
    bound applied to it (:func:`applied_bound`)."""
    ours = [results.record(w, "pagedwindow") for w in results.workloads]
    timed = [r for r in ours if r is not None and r.get("ms") is not None]
    checked = [
        (r["max_abs_err"], applied_bound(r, max_err_limit=max_err_limit))
        for r in timed
        if isinstance(r.get("max_abs_err"), (int, float))
    ]
    worst = max(checked, key=lambda eb: eb[0] / eb[1] if eb[1] else 0.0, default=None)
    text = (
        f"pagedwindow timed on {len(timed)} of {len(results.workloads)} workloads of {results.path.name} "
        f"({results.gpu}, {results.date})"
    )
    if worst is not None:
        bound = "its run's status only" if worst[1] is None else f"its bound {worst[1]:.3g}"
        text += f"; worst max_abs_err {worst[0]:.3g} against {bound}"
    return text + (f"; {len(failures)} failure(s)" if failures else "") + "."


# -- the prep suite (``pagedwindow bench --prep``) ------------------------------------------------------------------

PREP_SYSTEMS = ("pagedwindow", "hf_torch_append", "flashinfer")
"""The fused op, then the unfused sequences it is measured against."""
PREP_UNFUSED = ("hf_torch_append", "flashinfer")


@dataclass(frozen=True)
class PrepBar:
    """A bar the fused prep must meet on one workload: ``metric`` (a key of :func:`prep_ratios`' rows) at least
    ``threshold``."""

    workload: str
    metric: str
    threshold: float
    text: str


PREP_BARS = (
    PrepBar("prep_8192", "hbm_fraction", 0.80, "kernel time at >= 80 % of the HBM copy bandwidth"),
    PrepBar("prep_8192", "kernel_speedup", 1.3, "kernel time >= 1.3x faster than the fastest unfused sequence"),
    PrepBar("prep_decode_64x1", "e2e_speedup", 2.0, "end to end >= 2x faster than the fastest unfused sequence"),
)


def gbs(nbytes: int, ms: float | None) -> float | None:
    """Decimal GB/s of ``nbytes`` moved in ``ms`` milliseconds (None when ``ms`` is None or not > 0)."""
    return nbytes / (ms * 1e-3) / 1e9 if ms is not None and ms > 0 else None


def copy_gbs(nbytes: int, ms: float) -> float:
    """The bandwidth of a device-to-device copy of ``nbytes`` in ``ms``: bytes read plus bytes written."""
    return gbs(2 * nbytes, ms)


def prep_ratios(records: list, hbm_gbs: float | None) -> dict:
    """Per workload with a pagedwindow record: the fastest unfused sequence (the min over :data:`PREP_UNFUSED`'s
    times, kernel and e2e separately, and which system it was), pagedwindow's speed-ups over it (unfused time /
    ours: above 1, the fused op is faster), its achieved GB/s and that as a fraction of ``hbm_gbs``. A value is
    None where a time it needs is missing."""

    def fastest(workload, key):
        timed = [
            (r[key], r["system"])
            for r in records
            if r["workload"] == workload and r["system"] in PREP_UNFUSED and r.get(key) is not None
        ]
        return min(timed, default=(None, None))

    out = {}
    for ours in records:
        if ours["system"] != "pagedwindow":
            continue
        w = ours["workload"]
        best_ms, best_ms_system = fastest(w, "ms")
        best_e2e, best_e2e_system = fastest(w, "e2e_ms")
        ms, e2e, achieved = ours.get("ms"), ours.get("e2e_ms"), ours.get("gbs")
        out[w] = {
            "best_unfused_ms": best_ms,
            "best_unfused_ms_system": best_ms_system,
            "best_unfused_e2e_ms": best_e2e,
            "best_unfused_e2e_system": best_e2e_system,
            "kernel_speedup": best_ms / ms if best_ms is not None and ms else None,
            "e2e_speedup": best_e2e / e2e if best_e2e is not None and e2e else None,
            "gbs": achieved,
            "hbm_fraction": achieved / hbm_gbs if achieved is not None and hbm_gbs else None,
        }
    return out


def prep_bars(ratios: dict, bars=PREP_BARS) -> list[dict]:
    """Each bar whose workload was run: ``value`` (None: not measured), ``threshold`` and ``passed`` (True,
    False, or None when not measured)."""
    verdicts = []
    for bar in bars:
        if bar.workload not in ratios:
            continue
        value = ratios[bar.workload].get(bar.metric)
        verdicts.append(
            {
                "workload": bar.workload,
                "metric": bar.metric,
                "bar": bar.text,
                "threshold": bar.threshold,
                "value": value,
                "passed": None if value is None else value >= bar.threshold,
            }
        )
    return verdicts
