"""Where the Hopper prefill kernel's consumers wait, per iteration of a CTA's main loop (an sm_90a device).

``python3 benchmarks/wait_trace.py NAME [TILE] [--json out.json]`` builds the kernels with the wait trace
(``-DPW_SM90_WAIT_TRACE=1``, ``kernels/sm90_wait_trace.cuh``; its own kernel-cache entry), launches workload NAME
(named as ``profile_case.py`` names them; TILE the plan's ``cta_tile_q``, default the policy's) once to warm up and
once traced, and prints, per main-loop iteration j, the mean SM cycles a consumer warpgroup waited for K(j+1)
against the mean cycles of the iteration, after the waits for Q and K(0) that come before the loop.
"""

import argparse
import ctypes
import json
import os
import sys

os.environ["PAGEDWINDOW_NVCC_FLAGS"] = " ".join(
    filter(None, [os.environ.get("PAGEDWINDOW_NVCC_FLAGS", ""), "-DPW_SM90_WAIT_TRACE=1"])
)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from profile_case import make_call  # noqa: E402  (beside this script)

from pagedwindow.cuda import ops  # noqa: E402


def read_trace(lib: ctypes.CDLL) -> tuple[np.ndarray, int]:
    """The trace buffer as rows [CTA * 2 + consumer warpgroup, slot] (uint32), and the iterations traced; the
    device buffer is zeroed after the read."""
    layout = (ctypes.c_int * 3)()
    lib.pw_prefill_sm90_wait_trace_layout(layout)
    ctas, iters, slots = layout
    words = ctas * 2 * slots
    buf = np.zeros(words, dtype=np.uint32)
    read = lib.pw_prefill_sm90_wait_trace
    read.argtypes, read.restype = [ctypes.c_void_p, ctypes.c_longlong], ctypes.c_longlong
    n = read(buf.ctypes.data, words)
    if n != words:
        raise SystemExit(f"pw_prefill_sm90_wait_trace returned {n}: not a trace build, or a CUDA error")
    return buf.reshape(ctas * 2, slots), iters


def summarise(rows: np.ndarray, iters: int) -> dict:
    """Per-iteration means over the rows of CTAs that ran (KV tile count > 0)."""
    rows = rows[rows[:, 2 + 2 * iters] > 0].astype(np.float64)  # rows [R, slots]
    q_wait, k0_wait = rows[:, 0], rows[:, 1]  # [R]
    k_wait, it = rows[:, 2 : 2 + iters], rows[:, 2 + iters : 2 + 2 * iters]  # [R, iters]
    tiles, total = rows[:, 2 + 2 * iters], rows[:, 3 + 2 * iters]  # [R]
    per_iter = []
    for j in range(iters):
        ran = tiles - 1 > j  # iteration j exists (the last tile is peeled)
        if ran.sum() == 0:
            break
        per_iter.append(
            {
                "j": j,
                "rows": int(ran.sum()),
                "k_wait": float(k_wait[ran, j].mean()),
                "cycles": float(it[ran, j].mean()),
            }
        )
    k_sum = np.array([p["k_wait"] * p["rows"] for p in per_iter])
    return {
        "rows": int(rows.shape[0]),
        "mean_tiles": float(tiles.mean()),
        "mean_total_cycles": float(total.mean()),
        "q_wait": float(q_wait.mean()),
        "k0_wait": float(k0_wait.mean()),
        "k_wait_share_of_total": float((k_sum.sum() / rows.shape[0]) / total.mean()) if len(per_iter) else 0.0,
        "k_wait_in_first_two_iterations": float(k_sum[:2].sum() / k_sum.sum()) if k_sum.sum() > 0 else 0.0,
        "per_iteration": per_iter,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload")
    parser.add_argument("tile", nargs="?", default="default")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    tile = None if args.tile == "default" else int(args.tile)
    call = make_call(args.workload, tile)
    lib = ops.library(torch.device("cuda"))
    call()
    torch.cuda.synchronize()
    read_trace(lib)  # discards (and zeroes) the warm-up's trace
    call()
    torch.cuda.synchronize()
    rows, iters = read_trace(lib)
    s = summarise(rows, iters)
    print(
        f"{args.workload} (tile {args.tile}): {s['rows']} consumer warpgroups, {s['mean_tiles']:.1f} KV tiles a CTA, "
        f"{s['mean_total_cycles']:.0f} cycles from Q's wait to the loop's end"
    )
    print(
        f"before the loop: Q {s['q_wait']:.0f} cycles ({100 * s['q_wait'] / s['mean_total_cycles']:.1f} %), "
        f"K(0) {s['k0_wait']:.0f} ({100 * s['k0_wait'] / s['mean_total_cycles']:.1f} %); waits for K(j+1) in the loop: "
        f"{100 * s['k_wait_share_of_total']:.1f} % of the time, {100 * s['k_wait_in_first_two_iterations']:.0f} % "
        f"of them in iterations 0 and 1"
    )
    print("| j | warpgroups | wait for K(j+1), cycles | iteration, cycles | wait / iteration |")
    print("|---|---|---|---|---|")
    for p in s["per_iteration"]:
        share = 100 * p["k_wait"] / p["cycles"]
        print(f"| {p['j']} | {p['rows']} | {p['k_wait']:.0f} | {p['cycles']:.0f} | {share:.1f} % |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": args.workload, "tile": args.tile, **s}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
