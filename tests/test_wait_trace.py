"""benchmarks/wait_trace.py's reading of the prefill kernel's wait trace (CPU only: the traced launch needs an
sm_90a GPU). The trace's layout is kernels/sm90_wait_trace.cuh's."""

import importlib.util
import os
from pathlib import Path

import numpy as np

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "wait_trace.py"
_spec = importlib.util.spec_from_file_location("wait_trace", _SCRIPT)
wait_trace = importlib.util.module_from_spec(_spec)
_flags_before = os.environ.get("PAGEDWINDOW_NVCC_FLAGS")
_spec.loader.exec_module(wait_trace)

ITERS = 32
K, ITER, V, KEND = 2, 2 + ITERS, 2 + 2 * ITERS, 2 + 3 * ITERS  # consumer slots
TILES, TOTAL, SLOTS = 2 + 4 * ITERS, 3 + 4 * ITERS, 4 + 4 * ITERS
ISSUE_V = ITERS + 2  # producer slots: K(t)'s issue clock at t, V(t)'s at ISSUE_V + t


def test_importing_the_script_leaves_the_build_flags_alone():
    assert os.environ.get("PAGEDWINDOW_NVCC_FLAGS") == _flags_before


def test_signed_cycles_undo_the_32_bit_wrap():
    d = np.array([5, -5, 2**32 - 3, 2**31 + 1, 2**31 - 1], dtype=np.int64)
    assert wait_trace.signed_cycles(d).tolist() == [5, -5, -3, -(2**31) + 1, 2**31 - 1]


def synthetic_trace(ctas: int) -> np.ndarray:
    """CTAs of 4 KV tiles (3 loop iterations) whose clocks sit near the 32-bit wrap, and one CTA that did not run."""
    t = np.zeros((ctas + 1, 3, SLOTS), dtype=np.uint32)  # [CTA, role, slot]
    base = 2**32 - 1000  # K(2)'s issue and later readings wrap past zero
    for c in range(ctas):
        for w in (0, 1):
            t[c, w, TILES], t[c, w, TOTAL] = 4, 10_000 + 1000 * w
            t[c, w, 0], t[c, w, 1] = 300 + w, 40
            t[c, w, K : K + 3] = [100, 900 + w, 50]  # waits for K(1), K(2), K(3)
            t[c, w, ITER : ITER + 3] = [2400, 3300, 2400]
            t[c, w, V : V + 3] = [70, 80, 90 + w]
        # warpgroup 0's K(j+1) waits end at base + 3000, + 6000, + 9000 (mod 2^32)
        t[c, 0, KEND : KEND + 3] = [(base + 3000 * (j + 1)) % 2**32 for j in range(3)]
        issue_k = [base - 500, base + 400, (base + 4100) % 2**32, (base + 6450) % 2**32, 0, 0, 0, 0]
        t[c, 2, :8] = issue_k
        t[c, 2, ISSUE_V : ISSUE_V + 8] = [(k - 20) % 2**32 if k else 0 for k in issue_k]  # V(t) 20 cycles earlier
    return t


def test_summary_of_a_synthetic_trace():
    s = wait_trace.summarise(synthetic_trace(3), ITERS)
    assert s["ctas"] == 3  # the CTA that did not run (no tiles) is left out
    assert s["mean_tiles"] == 4 and s["mean_total_cycles"] == 10_500
    assert s["q_wait"] == 300.5 and s["k0_wait"] == 40
    assert [p["j"] for p in s["per_iteration"]] == [0, 1, 2]  # the last tile is peeled: 3 iterations
    p0, p1, p2 = s["per_iteration"]
    assert p1["k_wait"] == [900, 901] and p2["v_wait"] == [90, 91] and p1["cycles"] == 3300
    # lead = (wait end - wait) - K(j+1)'s issue, each relative to base, across the wrap
    assert [p["k_lead"] for p in (p0, p1, p2)] == [3000 - 100 - 400, 6000 - 900 - 4100, 9000 - 50 - 6450]
    assert s["producer_issue_gap_k"] is None and s["issue_v_minus_k"] is None  # no CTA of 8 tiles
    k_waits = (100 + 100 + 900 + 901 + 50 + 50) / 2
    assert abs(s["k_wait_share_of_total"] - k_waits / 10_500) < 1e-12


def test_issue_gaps_are_taken_over_ctas_of_eight_tiles_or_more():
    t = synthetic_trace(2)
    t[0, :2, TILES] = 8
    t[0, 2, :8] = [1000 * i for i in range(8)]
    t[0, 2, ISSUE_V : ISSUE_V + 8] = [1000 * i - 20 for i in range(8)] + np.array(2**32 * (np.arange(8) == 0))
    s = wait_trace.summarise(t, ITERS)
    assert s["producer_issue_gap_k"] == 1000  # only CTA 0 has 8 tiles
    assert s["issue_v_minus_k"] == -20  # V before K: signed, not 2^32 - 20
