"""Where the Hopper prefill kernel's consumers wait, per iteration of a CTA's main loop (an sm_90a device).

``python3 benchmarks/wait_trace.py NAME [TILE] [--json out.json]`` builds the kernels with the wait trace
(``-DPW_SM90_WAIT_TRACE=1``, ``kernels/sm90_wait_trace.cuh``; its own kernel-cache entry), launches workload NAME
(named as ``profile_case.py`` names them; TILE the plan's ``cta_tile_q``, default the policy's) once to warm up and
once traced, and prints, per main-loop iteration j, the mean SM cycles each consumer warpgroup waited for K(j+1)
and V(j), the cycles of the iteration, and K(j+1)'s lead (from its copies' issue to the wait for it), after the
waits for Q and K(0) that come before the loop.
"""

import argparse
import ctypes
import json
import os
import sys

import numpy as np

TRACE_FLAG = "-DPW_SM90_WAIT_TRACE=1"


def read_trace(lib: ctypes.CDLL) -> tuple[np.ndarray, int]:
    """The trace buffer as rows [3 * CTA + role, slot] (uint32; role 0 and 1 the consumer warpgroups, 2 the
    producer), and the iterations traced; the device buffer is zeroed after the read."""
    layout = (ctypes.c_int * 3)()
    lib.pw_prefill_sm90_wait_trace_layout(layout)
    rows, iters, slots = layout
    buf = np.zeros(rows * slots, dtype=np.uint32)
    read = lib.pw_prefill_sm90_wait_trace
    read.argtypes, read.restype = [ctypes.c_void_p, ctypes.c_longlong], ctypes.c_longlong
    n = read(buf.ctypes.data, rows * slots)
    if n != rows * slots:
        raise SystemExit(f"pw_prefill_sm90_wait_trace returned {n}: not a trace build, or a CUDA error")
    return buf.reshape(rows // 3, 3, slots), iters


def signed_cycles(d: np.ndarray) -> np.ndarray:
    """Differences of 32-bit clock readings as signed cycle counts (the readings wrap every 2^32 cycles)."""
    d = d % 2**32
    return np.where(d >= 2**31, d - 2**32, d)


def summarise(trace: np.ndarray, iters: int) -> dict:
    """Means over the CTAs that ran (KV tile count > 0), per consumer warpgroup and per main-loop iteration j: the
    waits for K(j+1) and V(j), the iteration's cycles, and K(j+1)'s lead (from its copies' issue to the start of
    warpgroup 0's wait for it)."""
    sk, si, sv, se = 2, 2 + iters, 2 + 2 * iters, 2 + 3 * iters  # slots: K wait, iteration, V wait, K wait end
    tiles_slot, total_slot, issue_v = 2 + 4 * iters, 3 + 4 * iters, iters + 2
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
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload")
    parser.add_argument("tile", nargs="?", default="default")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    # The flag joins the build's (read when the kernels are built, below); then the CUDA side is imported.
    os.environ["PAGEDWINDOW_NVCC_FLAGS"] = " ".join(
        filter(None, [os.environ.get("PAGEDWINDOW_NVCC_FLAGS"), TRACE_FLAG])
    )
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
    total = s["mean_total_cycles"]
    print(
        f"{args.workload} (tile {args.tile}): {s['ctas']} CTAs, {s['mean_tiles']:.1f} KV tiles a CTA, {total:.0f} "
        f"cycles from Q's wait to the loop's end; before the loop Q {s['q_wait']:.0f} cycles "
        f"({100 * s['q_wait'] / total:.1f} %), K(0) {s['k0_wait']:.0f} ({100 * s['k0_wait'] / total:.1f} %); "
        f"waits for K(j+1) in the loop {100 * s['k_wait_share_of_total']:.1f} % of the time"
    )
    if s["producer_issue_gap_k"] is not None:
        print(
            f"K's copies issued every {s['producer_issue_gap_k']:.0f} cycles, "
            f"V(t)'s {s['issue_v_minus_k']:.0f} after K(t)'s"
        )
    print("| j | CTAs | K(j+1) lead | K(j+1) wait, wg 0 / 1 | V(j) wait, wg 0 / 1 | iteration | K wait / iteration |")
    print("|---|---|---|---|---|---|---|")
    for p in s["per_iteration"]:
        kw, vw = p["k_wait"], p["v_wait"]
        share = 100 * (kw[0] + kw[1]) / 2 / p["cycles"]
        print(
            f"| {p['j']} | {p['ctas']} | {p['k_lead']:.0f} | {kw[0]:.0f} / {kw[1]:.0f} | {vw[0]:.0f} / {vw[1]:.0f} | "
            f"{p['cycles']:.0f} | {share:.1f} % |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": args.workload, "tile": args.tile, **s}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
