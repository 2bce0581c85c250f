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
TILES, TOTAL, QCLOCK, EXIT, EXIT_NS = 2 + 4 * ITERS, 3 + 4 * ITERS, 4 + 4 * ITERS, 5 + 4 * ITERS, 6 + 4 * ITERS
LAST_V, PV_DONE, STAGED = 8 + 4 * ITERS, 9 + 4 * ITERS, 10 + 4 * ITERS
SLOTS = 11 + 4 * ITERS
ISSUE_V = ITERS + 2  # producer slots: K(t)'s issue clock at t, V(t)'s at ISSUE_V + t
SM, ENTRY, ENTRY_NS = 2 * ITERS + 4, 2 * ITERS + 5, 2 * ITERS + 6  # producer slots: the CTA's SM and start


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
        t[c, 2, SM] = c  # one CTA per SM, no lifetimes recorded: cta_life's own test covers those
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


def test_the_slots_are_the_kernels():
    sl = wait_trace.slots(ITERS)
    assert (sl["tiles"], sl["total"], sl["q_clock"], sl["exit"], sl["exit_ns"]) == (TILES, TOTAL, QCLOCK, EXIT, EXIT_NS)
    assert (sl["issue_v"], sl["sm"], sl["entry"], sl["entry_ns"]) == (ISSUE_V, SM, ENTRY, ENTRY_NS)
    assert (sl["last_v"], sl["pv_done"], sl["staged"]) == (LAST_V, PV_DONE, STAGED)
    assert sl["staged"] + 1 == SLOTS and sl["entry_ns"] + 2 <= SLOTS  # kTraceSlots


def put_ns(row: np.ndarray, slot: int, ns: int) -> None:
    row[slot], row[slot + 1] = ns & 0xFFFFFFFF, ns >> 32


def test_cta_life_over_two_sms():
    """Four CTAs, two per SM, at 2 cycles a ns; clocks near the 32-bit wrap and timer values past 2^32 ns."""
    t = np.zeros((4, 3, SLOTS), dtype=np.uint32)
    ns0 = 5 * 2**32  # the timer's high word in use
    # (SM, start ns, start clock) per CTA; every CTA lives 10 000 ns = 20 000 cycles
    ctas = [(3, 0, 2**32 - 5000), (3, 10_500, 2**32 - 5000 + 21_000), (7, 100, 40), (7, 10_300, 40 + 20_400)]
    for c, (sm, start_ns, start_clock) in enumerate(ctas):
        t[c, 2, SM] = sm
        t[c, 2, ENTRY] = start_clock % 2**32
        put_ns(t[c, 2], ENTRY_NS, ns0 + start_ns)
        for w in (0, 1):
            t[c, w, TILES], t[c, w, TOTAL] = 4, 15_000 + 100 * w
            t[c, w, QCLOCK] = (start_clock + 1000 + 10 * w) % 2**32
            # warpgroup 1 ends last, 3 890 cycles after its loop's end (1 010 + 15 100 + 3 890 = 20 000): its last
            # PV 1 000 cycles (200 of them waiting for V), staging 400, the stores 2 490
            t[c, w, EXIT] = (start_clock + 20_000 - 10 * (1 - w)) % 2**32
            t[c, w, LAST_V] = 200 + 5 * (1 - w)
            t[c, w, PV_DONE] = (start_clock + 1010 + 15_100 + 1000 - 7 * (1 - w)) % 2**32
            t[c, w, STAGED] = (start_clock + 1010 + 15_100 + 1400 - 7 * (1 - w)) % 2**32
            put_ns(t[c, w], EXIT_NS, ns0 + start_ns + 10_000 - (1 - w))
    life = wait_trace.cta_life(t, ITERS)
    assert life["ghz"] == 2.0 and life["sms"] == 2
    assert life["setup"] == 1000  # warpgroup 0's wait for Q
    assert life["tail"] == 3890 and life["life"] == 20_000
    assert life["tail_parts"] == {"v_wait": 200, "last_pv": 1000, "staging": 400, "stores": 2490}
    assert life["gap"] == (500 + 200) / 2 * 2.0  # ns between CTAs on each SM, in cycles
    assert life["span_ns"] == 10_500 + 10_000


def test_the_report_renders_a_traced_launch():
    t = synthetic_trace(2)
    for c in range(2):  # two CTAs on two SMs, 20 000 cycles each at 2 cycles a ns
        t[c, 2, ENTRY] = 1000
        put_ns(t[c, 2], ENTRY_NS, 0)
        for w in (0, 1):
            t[c, w, QCLOCK] = 2000
            t[c, w, EXIT] = 21_000
            put_ns(t[c, w], EXIT_NS, 10_000)
    text = wait_trace.report(wait_trace.summarise(t, ITERS), "prefill_8x2048", "default")
    assert "(the launch has more CTAs" not in text
    # an SM's time per CTA: span 10 us x 2 GHz x 2 SMs / 2 CTAs; setup 1 000 cycles of it
    assert "2 SMs, 2.000 GHz, span 10.0 us): 20000 cycles" in text
    assert text.splitlines()[-2].startswith("| 1000 (5.0 %) | 300 (1.5 %) | 40 (0.2 %) |")
    assert text.splitlines()[-1].startswith("After the loop (the warpgroup that ends last): the last PV")
