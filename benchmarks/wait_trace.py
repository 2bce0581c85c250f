"""Where the Hopper prefill kernel's consumers wait, per iteration of a CTA's main loop (an sm_90a device).

``python3 benchmarks/wait_trace.py NAME [TILE] [--json out.json]`` builds the kernels with the wait trace
(``-DPW_SM90_WAIT_TRACE=1``, ``kernels/sm90_wait_trace.cuh``; its own kernel-cache entry), launches workload NAME
(named as ``profile_case.py`` names them; TILE the plan's ``cta_tile_q``, default the policy's) once to warm up and
once traced, and prints, per main-loop iteration j, the mean SM cycles each consumer warpgroup waited for K(j+1)
and V(j), the cycles of the iteration, and K(j+1)'s lead (from its copies' issue to the wait for it), after the
waits for Q and K(0) that come before the loop; and where an SM's time goes per CTA: from the CTA's start to its
wait for Q, the waits before the loop, the loop, from the loop's end to the end of the epilogue, and the gap
before the SM's next CTA starts.
"""

import argparse
import ctypes
import json
import sys

import numpy as np

TRACE_FLAG = "-DPW_SM90_WAIT_TRACE=1"


def read_trace(lib: ctypes.CDLL) -> tuple[np.ndarray, int]:
    """The trace buffer as rows [3 * CTA + role, slot] (uint32; role 0 and 1 the consumer warpgroups, 2 the
    producer), and the iterations traced; the device buffer is zeroed after the read."""
    from trace_buffer import read_buffer  # beside this script

    layout = (ctypes.c_int * 3)()
    lib.pw_prefill_sm90_wait_trace_layout(layout)
    rows, iters, slots = layout
    buf = read_buffer(lib, "pw_prefill_sm90_wait_trace", rows * slots, np.uint32)
    return buf.reshape(rows // 3, 3, slots), iters


def signed_cycles(d: np.ndarray) -> np.ndarray:
    """Differences of 32-bit clock readings as signed cycle counts (the readings wrap every 2^32 cycles)."""
    d = d % 2**32
    return np.where(d >= 2**31, d - 2**32, d)


def slots(iters: int) -> dict[str, int]:
    """The trace's slot numbers (kernels/sm90_wait_trace.cuh) for ``iters`` traced iterations: the consumer rows'
    (``k``, ``iter``, ``v``, ``k_end`` are the first of ``iters``) and the producer row's (``issue_v``, ``sm``,
    ``entry``, ``entry_ns``)."""
    c = {"q": 0, "k0": 1, "k": 2, "iter": 2 + iters, "v": 2 + 2 * iters, "k_end": 2 + 3 * iters}
    c.update(tiles=2 + 4 * iters, total=3 + 4 * iters, q_clock=4 + 4 * iters, exit=5 + 4 * iters, exit_ns=6 + 4 * iters)
    c.update(last_v=8 + 4 * iters, pv_done=9 + 4 * iters, staged=10 + 4 * iters)
    c.update(issue_v=iters + 2, sm=2 * iters + 4, entry=2 * iters + 5, entry_ns=2 * iters + 6)
    return c


def ns_of(trace: np.ndarray, slot: int) -> np.ndarray:
    """The 64-bit global timer stored as two words from ``slot`` (low first), over the trace's leading axes."""
    return trace[..., slot].astype(np.int64) | (trace[..., slot + 1].astype(np.int64) << 32)


def cta_life(trace: np.ndarray, iters: int) -> dict:
    """Where an SM's time goes, over the CTAs that ran (``trace`` [C, 3, slots], every CTA of the launch traced):
    mean cycles per CTA from its start to warpgroup 0's wait for Q (``setup``), from the later warpgroup's loop
    end to the later epilogue end (``tail``; ``tail_parts`` splits the last-ending warpgroup's: its last PV GEMM
    with the wait for V(n-1) in it, the staging of O, the global stores), the CTA's whole life (``life``), and the
    gap from one CTA's end to the next CTA's start on the same SM (``gap``; the global timer's ns at the clock
    rate measured); the SM clock rate (GHz, from clock and timer over each CTA's life); the launch's span (ns)
    and the SMs it used."""
    s = slots(iters)
    cons, prod = trace[:, :2], trace[:, 2]  # [C, 2, slots], [C, slots]
    entry = prod[:, s["entry"]].astype(np.int64)  # [C] clock at the CTA's start
    q_clock = cons[:, :, s["q_clock"]].astype(np.int64)  # [C, 2]
    loop_end = q_clock + cons[:, :, s["total"]].astype(np.int64)  # [C, 2]
    exit_clock = cons[:, :, s["exit"]].astype(np.int64)  # [C, 2]
    # cycles from the CTA's start (one SM's clock, so both warpgroups' readings compare)
    setup = signed_cycles(q_clock[:, 0] - entry)  # [C]
    life = signed_cycles(exit_clock - entry[:, None]).max(axis=1)  # [C]
    tail = life - signed_cycles(loop_end - entry[:, None]).max(axis=1)  # [C]
    # the tail of the warpgroup that ends last: its loop end -> PV(n-1) done (the wait for V(n-1) in it) -> O staged
    # in shared memory -> the epilogue's end
    last = signed_cycles(exit_clock - entry[:, None]).argmax(axis=1)  # [C]
    pick = np.arange(len(last)), last
    pv_done, staged = cons[:, :, s["pv_done"]].astype(np.int64)[pick], cons[:, :, s["staged"]].astype(np.int64)[pick]
    tail_parts = {
        "v_wait": float(cons[:, :, s["last_v"]].astype(np.int64)[pick].mean()),
        "last_pv": float(signed_cycles(pv_done - loop_end[pick]).mean()),
        "staging": float(signed_cycles(staged - pv_done).mean()),
        "stores": float(signed_cycles(exit_clock[pick] - staged).mean()),
    }
    entry_ns, exit_ns = ns_of(prod, s["entry_ns"]), ns_of(cons, s["exit_ns"]).max(axis=1)  # [C]
    life_ns = exit_ns - entry_ns
    ghz = float(np.median(life[life_ns > 0] / life_ns[life_ns > 0])) if (life_ns > 0).any() else float("nan")
    gaps = []
    sm = prod[:, s["sm"]]
    for sm_id in np.unique(sm):
        on = np.argsort(entry_ns[sm == sm_id])
        starts, ends = entry_ns[sm == sm_id][on], exit_ns[sm == sm_id][on]
        gaps.extend((starts[1:] - ends[:-1]).tolist())  # a CTA's start after the one before it on this SM
    return {
        "ghz": ghz,
        "setup": float(setup.mean()),
        "tail": float(tail.mean()),
        "tail_parts": tail_parts,
        "life": float(life.mean()),
        "gap": float(np.mean(gaps) * ghz) if gaps else 0.0,
        "span_ns": int(exit_ns.max() - entry_ns.min()),
        "sms": int(len(np.unique(sm))),
    }


def summarise(trace: np.ndarray, iters: int) -> dict:
    """Means over the CTAs that ran (KV tile count > 0), per consumer warpgroup and per main-loop iteration j: the
    waits for K(j+1) and V(j), the iteration's cycles, and K(j+1)'s lead (from its copies' issue to the start of
    warpgroup 0's wait for it)."""
    sl = slots(iters)
    sk, si, sv, se = sl["k"], sl["iter"], sl["v"], sl["k_end"]
    tiles_slot, total_slot, issue_v = sl["tiles"], sl["total"], sl["issue_v"]
    every_cta_traced = not trace[-1, 0, tiles_slot] > 0  # the buffer's last CTA slot is unused
    trace = trace[trace[:, 0, tiles_slot] > 0]  # [C, 3, slots]
    cons = trace[:, :2].astype(np.float64)  # [C, 2, slots] the consumer warpgroups
    prod = trace[:, 2].astype(np.int64)  # [C, slots] the producer's issue clocks
    tiles, total = cons[:, 0, tiles_slot], cons[:, :, total_slot].mean(axis=1)  # [C]
    per_iter = []
    for j in range(iters):
        ran = tiles - 1 > j  # iteration j exists (the last tile is peeled)
        if ran.sum() == 0:
            break
        k_end = trace[ran, 0, se + j].astype(np.int64)  # [C'] warpgroup 0's wait end for K(j+1)
        wait_start = (k_end - trace[ran, 0, sk + j].astype(np.int64)) % 2**32
        lead = signed_cycles(wait_start - prod[ran, j + 1])  # [C'] cycles from K(j+1)'s issue to that wait
        per_iter.append(
            {
                "j": j,
                "ctas": int(ran.sum()),
                "k_wait": [float(cons[ran, w, sk + j].mean()) for w in (0, 1)],
                "v_wait": [float(cons[ran, w, sv + j].mean()) for w in (0, 1)],
                "cycles": float(cons[ran, :, si + j].mean()),
                "k_lead": float(lead.mean()),
            }
        )
    k_sum = np.array([sum(p["k_wait"]) / 2 * p["ctas"] for p in per_iter])
    long_k, long_v = prod[tiles >= 8, :8], prod[tiles >= 8, issue_v : issue_v + 8]  # [C'', 8] issue clocks
    return {
        "ctas": int(trace.shape[0]),
        "mean_tiles": float(tiles.mean()),
        "mean_total_cycles": float(total.mean()),
        "q_wait": float(cons[:, :, 0].mean()),
        "k0_wait": float(cons[:, :, 1].mean()),
        "k_wait_share_of_total": float((k_sum.sum() / trace.shape[0]) / total.mean()) if len(per_iter) else 0.0,
        # over CTAs of 8 tiles or more (None if there are none): the cycles between K's issues, and from K(t)'s
        # issue to V(t)'s (negative: V first)
        "producer_issue_gap_k": float(signed_cycles(np.diff(long_k, axis=1)).mean()) if len(long_k) else None,
        "issue_v_minus_k": float(signed_cycles(long_v - long_k).mean()) if len(long_k) else None,
        "per_iteration": per_iter,
        "life": {**cta_life(trace, iters), "every_cta_traced": every_cta_traced},
    }


def report(s: dict, workload: str, tile: str) -> str:
    """The summary as text: a line on the CTAs, the table per iteration, then an SM's time per CTA."""
    out: list[str] = []
    total = s["mean_total_cycles"]
    out.append(
        f"{workload} (tile {tile}): {s['ctas']} CTAs, {s['mean_tiles']:.1f} KV tiles a CTA, {total:.0f} "
        f"cycles from Q's wait to the loop's end; before the loop Q {s['q_wait']:.0f} cycles "
        f"({100 * s['q_wait'] / total:.1f} %), K(0) {s['k0_wait']:.0f} ({100 * s['k0_wait'] / total:.1f} %); "
        f"waits for K(j+1) in the loop {100 * s['k_wait_share_of_total']:.1f} % of the time"
    )
    if s["producer_issue_gap_k"] is not None:
        out.append(
            f"K's copies issued every {s['producer_issue_gap_k']:.0f} cycles, "
            f"V(t)'s {s['issue_v_minus_k']:.0f} after K(t)'s"
        )
    out.append(
        "| j | CTAs | K(j+1) lead | K(j+1) wait, wg 0 / 1 | V(j) wait, wg 0 / 1 | iteration | K wait / iteration |"
    )
    out.append("|---|---|---|---|---|---|---|")
    for p in s["per_iteration"]:
        kw, vw = p["k_wait"], p["v_wait"]
        share = 100 * (kw[0] + kw[1]) / 2 / p["cycles"]
        out.append(
            f"| {p['j']} | {p['ctas']} | {p['k_lead']:.0f} | {kw[0]:.0f} / {kw[1]:.0f} | {vw[0]:.0f} / {vw[1]:.0f} | "
            f"{p['cycles']:.0f} | {share:.1f} % |"
        )
    life = s["life"]
    if not life["every_cta_traced"]:
        out.append("(the launch has more CTAs than the trace holds: the gaps and the span below are partial)")
    sm_per_cta = life["span_ns"] * life["ghz"] * life["sms"] / s["ctas"]
    out.append(
        f"\nAn SM's time per CTA ({life['sms']} SMs, {life['ghz']:.3f} GHz, span {life['span_ns'] / 1000:.1f} us): "
        f"{sm_per_cta:.0f} cycles"
    )
    out.append(
        "| start to Q's wait | Q | K(0) | S(0) and the loop | loop end to epilogue end | life | gap to the next CTA |"
    )
    out.append("|---|---|---|---|---|---|---|")
    loop = total - s["q_wait"] - s["k0_wait"]
    parts = [life["setup"], s["q_wait"], s["k0_wait"], loop, life["tail"], life["life"], life["gap"]]
    out.append("| " + " | ".join(f"{v:.0f} ({100 * v / sm_per_cta:.1f} %)" for v in parts) + " |")
    tp = life["tail_parts"]
    out.append(
        f"After the loop (the warpgroup that ends last): the last PV {tp['last_pv']:.0f} cycles (of which the wait "
        f"for V(n-1) {tp['v_wait']:.0f}), O staged {tp['staging']:.0f}, the stores {tp['stores']:.0f}"
    )
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload")
    parser.add_argument("tile", nargs="?", default="default")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from trace_buffer import add_build_flag  # beside this script

    add_build_flag(TRACE_FLAG)  # read when the kernels are built, below; then the CUDA side is imported
    import torch
    from profile_case import make_call  # beside this script

    from pagedwindow.cuda import ops

    tile = None if args.tile == "default" else int(args.tile)
    call = make_call(args.workload, tile)
    lib = ops.library(torch.device("cuda"))
    call()
    torch.cuda.synchronize()
    read_trace(lib)  # discards (and zeroes) the warm-up's trace
    call()
    torch.cuda.synchronize()
    trace, iters = read_trace(lib)
    s = summarise(trace, iters)
    print(report(s, args.workload, args.tile))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": args.workload, "tile": args.tile, **s}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
