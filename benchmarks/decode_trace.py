"""Where one launch of the split-KV decode kernel spends its time, on the clock (a CUDA device).

``python3 benchmarks/decode_trace.py NAME [NAME ...] [--json out.json]`` builds the kernels with the decode trace
(``-DPW_DECODE_TRACE=1``, ``kernels/decode_trace.cuh``; its own kernel-cache entry), launches each decode workload
(named as ``profile_case.py`` names them, e.g. ``decode_b1_kv4096_w1023``) once to warm up and once traced, and
prints, for each (a name given again is launched again, its results named NAME-again1, ...): the launch's span from
the first CTA's start to the last CTA's end, when the CTAs started, and the way of a CTA's first unit through the
launch — its geometry known, its first and second steps' keys landed, its last step done, its rows stored, its
split counter's add returned, and in a merge the weights known, the first batch of splits summed, the rows stored
and the counter reset, then the CTA's end — as the mean over the CTAs that ran a unit and as the way of the CTA
that ended last (the launch's critical path), in µs from the first start.
"""

import argparse
import collections
import ctypes
import json
import sys

import numpy as np

TRACE_FLAG = "-DPW_DECODE_TRACE=1"

# kernels/decode_trace.cuh's DecodeTraceSlot, in order
SLOT_NAMES = (
    "entry_ns",
    "exit_ns",
    "sm",
    "units",
    "first_unit",
    "steps",
    "merged",
    "entry",
    "ready",
    "landed",
    "second_step",
    "loop_end",
    "stored",
    "arrived",
    "merge_weights",
    "merge_batch",
    "merge_rows",
    "merge_end",
    "exit",
)
SLOT = {name: i for i, name in enumerate(SLOT_NAMES)}
# The points of a CTA's way, in order: the slots from ``entry`` on, SM clock readings (``entry`` and ``exit`` are
# also on the timer).
POINTS = SLOT_NAMES[SLOT["entry"] :]


def read_trace(lib: ctypes.CDLL) -> np.ndarray:
    """The trace buffer as rows [CTA, slot] (uint64); the device buffer is zeroed after the read."""
    from trace_buffer import read_buffer  # beside this script

    layout = (ctypes.c_int * 2)()
    lib.pw_decode_trace_layout(layout)
    ctas, slots = layout
    if slots != len(SLOT_NAMES):
        raise SystemExit(f"the kernel's trace has {slots} slots a CTA, this script reads {len(SLOT_NAMES)}")
    return read_buffer(lib, "pw_decode_trace", ctas * slots, np.uint64).reshape(ctas, slots)


def timeline(trace: np.ndarray) -> dict:
    """The launch laid out in ns from its first CTA's start. ``trace`` [C, slots]: rows of CTAs that never started
    are all zero and left out. Each CTA's SM-clock points become ns through the SM clock rate (``ghz``: the
    median over CTAs of clock cycles per timer ns across their lives), anchored at the CTA's start on the timer.
    Returns the rate, the launch's span, the CTAs started and those that ran a unit, the SMs used, the timer's
    step (the smallest nonzero gap between start times: how coarse the cross-CTA times are), the start offsets'
    minimum / median / maximum, and per point of ``POINTS`` the mean over CTAs that passed it and the value of
    the CTA that ended last (None where it did not pass it)."""
    rows = trace[trace[:, SLOT["entry_ns"]] > 0].astype(np.int64)  # [C, slots] (ns since the epoch fit int64)
    if len(rows) == 0:
        raise ValueError("the trace holds no CTA: did the workload run the decode kernel of a trace build?")
    entry_ns, exit_ns = rows[:, SLOT["entry_ns"]], rows[:, SLOT["exit_ns"]]
    life_clock, life_ns = rows[:, SLOT["exit"]] - rows[:, SLOT["entry"]], exit_ns - entry_ns
    timed = life_ns > 0
    ghz = float(np.median(life_clock[timed] / life_ns[timed])) if timed.any() else 1.0
    t0 = int(entry_ns.min())
    starts = entry_ns - t0  # [C]
    at = {}  # point -> [C] ns from t0, NaN where the CTA did not pass it
    for point in POINTS:
        clock = rows[:, SLOT[point]]
        at[point] = np.where(clock > 0, starts + (clock - rows[:, SLOT["entry"]]) / ghz, np.nan)
    ran = rows[:, SLOT["first_unit"]] > 0
    last = int(np.argmax(exit_ns))
    gaps = np.diff(np.unique(entry_ns))
    return {
        "ghz": ghz,
        "span_ns": int(exit_ns.max() - t0),
        "ctas": int(len(rows)),
        "ctas_with_a_unit": int(ran.sum()),
        "merged": int(rows[:, SLOT["merged"]].sum()),
        "sms": int(len(np.unique(rows[:, SLOT["sm"]]))),
        "timer_step_ns": int(gaps.min()) if len(gaps) else 0,
        "start_ns": {"min": float(starts.min()), "median": float(np.median(starts)), "max": float(starts.max())},
        "mean_ns": {p: _mean(at[p][ran]) for p in POINTS},
        "last_cta": {
            "steps": int(rows[last, SLOT["steps"]]),
            "merged": bool(rows[last, SLOT["merged"]]),
            "ns": {p: None if np.isnan(at[p][last]) else float(at[p][last]) for p in POINTS},
        },
    }


def _mean(values: np.ndarray) -> float | None:
    values = values[~np.isnan(values)]
    return float(values.mean()) if len(values) else None


def report(t: dict, workload: str) -> str:
    """The timeline as text: a line on the launch, then a table of the points (µs from the first start)."""

    def us(v: float | None) -> str:
        return "—" if v is None else f"{v / 1000:.2f}"

    s = t["start_ns"]
    out = [
        f"{workload}: span {t['span_ns'] / 1000:.2f} us; {t['ctas']} CTAs on {t['sms']} SMs ({t['ctas_with_a_unit']} "
        f"ran a unit, {t['merged']} merged), starting at {us(s['min'])} / {us(s['median'])} / {us(s['max'])} us "
        f"(min / median / max); SM clock {t['ghz']:.3f} GHz, timer step {t['timer_step_ns']} ns",
        "| point | mean over the CTAs with a unit that passed it (us) | the CTA that ended last (us) |",
        "|---|---|---|",
    ]
    last = t["last_cta"]
    for p in POINTS:
        out.append(f"| {p} | {us(t['mean_ns'][p])} | {us(last['ns'][p])} |")
    merged = "merged" if last["merged"] else "no merge"
    out.append(f"(the CTA that ended last ran {last['steps']} steps first and {merged})")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", nargs="+")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from trace_buffer import add_build_flag  # beside this script

    add_build_flag(TRACE_FLAG)  # read when the kernels are built, below; then the CUDA side is imported
    import torch
    from profile_case import make_call  # beside this script

    from pagedwindow.cuda import ops

    lib = ops.library(torch.device("cuda"))
    results, times_named = {}, collections.Counter()
    for name in args.workloads:
        call = make_call(name, None)
        call()
        torch.cuda.synchronize()
        read_trace(lib)  # discards (and zeroes) the warm-up's trace
        call()
        torch.cuda.synchronize()
        key = f"{name}-again{times_named[name]}" if times_named[name] else name
        times_named[name] += 1
        results[key] = timeline(read_trace(lib))
        print(report(results[key], key), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
