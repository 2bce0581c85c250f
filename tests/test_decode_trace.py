"""benchmarks/decode_trace.py's reading of the decode kernel's timeline (CPU only: the traced launch needs a CUDA
GPU). The trace's layout is kernels/decode_trace.cuh's."""

import os
import re

import numpy as np
import pytest

from .benchmark_scripts import BENCHMARKS, load_benchmark_script

_flags_before = os.environ.get("PAGEDWINDOW_NVCC_FLAGS")
decode_trace = load_benchmark_script("decode_trace")
S = decode_trace.SLOT


def test_importing_the_script_leaves_the_build_flags_alone():
    assert os.environ.get("PAGEDWINDOW_NVCC_FLAGS") == _flags_before


def test_the_slots_are_the_kernels():
    """The script's slot names, in order, are the header's DecodeTraceSlot enumerators (kSlotEntryNs: entry_ns)."""
    header = (BENCHMARKS.parent / "kernels" / "decode_trace.cuh").read_text()
    body = re.search(r"enum DecodeTraceSlot : int \{(.*?)\};", header, re.S).group(1)
    names = [n.strip() for n in body.split(",") if n.strip()]
    assert names[-1] == "kDecodeTraceSlots"
    snake = [re.sub(r"(?<!^)(?=[A-Z])", "_", n.removeprefix("kSlot")).lower() for n in names[:-1]]
    assert tuple(snake) == decode_trace.SLOT_NAMES


def cta(trace, c, *, sm, start_ns, start_clock, points, first_unit=1, steps=2, merged=0, units=1):
    """CTA c: started at ``start_ns`` (timer) / ``start_clock`` (SM clock, 2 cycles a ns), its first unit's
    points as ns after its start (``points``: name -> ns; the end is the last), ending at the last point."""
    row = trace[c]
    row[S["sm"]], row[S["entry"]], row[S["entry_ns"]] = sm, start_clock, start_ns
    row[S["first_unit"]], row[S["steps"]], row[S["merged"]], row[S["units"]] = first_unit, steps, merged, units
    for name, ns in points.items():
        row[S[name]] = start_clock + 2 * ns
    end = max(points.values())
    row[S["exit"]], row[S["exit_ns"]] = start_clock + 2 * end, start_ns + end


T0 = 1_700_000_000_000_000_000  # a timer reading in ns, as the device's: past 2^32


def synthetic() -> np.ndarray:
    """Three split CTAs and one without a unit, on three SMs; CTA 2 starts last, merges and ends last."""
    t = np.zeros((6, len(decode_trace.SLOT_NAMES)), dtype=np.uint64)  # rows 4-5: CTAs that never started
    way = {"ready": 500, "landed": 3000, "loop_end": 4000, "stored": 4500, "arrived": 5500, "exit": 5600}
    cta(t, 0, sm=0, start_ns=T0, start_clock=10_000, points=way)
    cta(t, 1, sm=1, start_ns=T0 + 32, start_clock=2**40, points={**way, "exit": 5700})
    cta(t, 2, sm=2, start_ns=T0 + 1000, start_clock=7, merged=1, points={**way, "merge_end": 8000, "exit": 8100})
    cta(t, 3, sm=0, start_ns=T0 + 64, start_clock=10_000 + 2 * 5700, first_unit=0, units=0, points={"exit": 100})
    return t


def test_timeline_of_a_synthetic_launch():
    t = decode_trace.timeline(synthetic())
    assert t["ghz"] == 2.0 and t["ctas"] == 4 and t["ctas_with_a_unit"] == 3 and t["merged"] == 1 and t["sms"] == 3
    assert t["span_ns"] == 1000 + 8100 and t["timer_step_ns"] == 32
    assert t["start_ns"] == {"min": 0.0, "median": 48.0, "max": 1000.0}
    m = t["mean_ns"]  # over CTAs 0-2, each offset by its start (0, 32, 1000 ns)
    assert m["entry"] == pytest.approx(1032 / 3) and m["landed"] == pytest.approx(1032 / 3 + 3000)
    assert m["merge_end"] == 1000 + 8000  # only CTA 2 passed it
    assert m["exit"] == pytest.approx((5600 + 32 + 5700 + 1000 + 8100) / 3)
    last = t["last_cta"]
    assert last["merged"] and last["steps"] == 2
    assert last["ns"]["arrived"] == 1000 + 5500 and last["ns"]["exit"] == 1000 + 8100


def test_points_a_cta_did_not_pass_stay_empty():
    trace = synthetic()
    trace[2, S["merge_end"]] = 0
    t = decode_trace.timeline(trace)
    assert t["mean_ns"]["merge_end"] is None and t["last_cta"]["ns"]["merge_end"] is None


def test_an_empty_trace_is_refused():
    with pytest.raises(ValueError, match="decode kernel"):
        decode_trace.timeline(np.zeros((4, len(decode_trace.SLOT_NAMES)), dtype=np.uint64))


def test_the_report_renders_the_timeline():
    text = decode_trace.report(decode_trace.timeline(synthetic()), "decode_b1_kv4096_w1023")
    lines = text.splitlines()
    assert lines[0].startswith("decode_b1_kv4096_w1023: span 9.10 us; 4 CTAs on 3 SMs (3 ran a unit, 1 merged)")
    assert "starting at 0.00 / 0.05 / 1.00 us" in lines[0] and "timer step 32 ns" in lines[0]
    assert "| merge_end | 9.00 | 9.00 |" in lines
    assert lines[-1] == "(the CTA that ended last ran 2 steps first and merged)"
