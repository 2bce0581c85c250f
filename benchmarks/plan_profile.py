"""Where a new plan's host time goes (``from_csr`` on a CUDA device), piece by piece, for the serving workloads.

Usage on a GPU machine: ``python3 benchmarks/plan_profile.py``; prints a table (µs, medians, the device idle
before each call). ``--cprofile [--workload NAME] [--calls N]`` instead runs cProfile over N back-to-back
``from_csr(..., device="cuda")`` calls (default: decode_64x4096, 2000 calls) and prints the top functions by own
time and by cumulative time, in µs per ``from_csr`` call."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import numpy as np
import torch

import pagedwindow as pw
from pagedwindow import bench
from pagedwindow import plan as plan_module
from pagedwindow.cuda import ops

WORKLOADS = ("prompts_32x128", "chunk_512_on_30000", "decode_64x4096", "decode_256x2000_p32", "prefill_8x2048")


def host_us(fn, reps: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def profile(name: str, device: torch.device) -> dict:
    """Host µs of ``from_csr`` for workload ``name`` and of each of its pieces."""
    w = bench.WORKLOADS[name]
    inp = bench.make_inputs(w, torch.Generator().manual_seed(0), device)
    kwargs = {k: v for k, v in bench.plan_kwargs(w).items() if v is not None}
    heads = plan_module._Heads.checked(
        kwargs["num_qo_heads"], kwargs["num_kv_heads"], kwargs["head_dim"], kwargs["page_size"]
    )
    given = tuple(inp.csr)
    arrays = plan_module._csr_arrays(*given)
    state, _ = plan_module._state_from_csr(*arrays, heads, None, device, given=given)
    entries = len(state.packed)
    plan = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=max(state.total_tokens, 1),
        max_total_pages=state.total_pages,
        max_batch=state.batch_size,
        max_tiles=max(state.num_tiles, 1),
        device=device,
    )
    plan.update_csr(*given, **kwargs)
    mirror = plan._mirrors[torch.device("cuda", torch.cuda.current_device())]
    return {
        "workload": name,
        "from_csr": host_us(lambda: pw.PrefillPagedPlan.from_csr(*given, **kwargs, device=device)),
        "from_csr_unpooled": host_us(
            lambda: (
                plan_module.release_pooled_plan_buffers(),
                pw.PrefillPagedPlan.from_csr(*given, **kwargs, device=device),
            )
        ),
        "from_csr_cpu": host_us(lambda: pw.PrefillPagedPlan.from_csr(*given, **kwargs, device="cpu")),
        "update_csr": host_us(lambda: plan.update_csr(*given, **kwargs)),
        "csr_arrays": host_us(lambda: plan_module._csr_arrays(*given)),
        "state_from_csr": host_us(lambda: plan_module._state_from_csr(*arrays, heads, None, device, given=given)),
        "upload": host_us(lambda: mirror.upload(state, plan.capacity)),
        "mirror_new": host_us(lambda: plan_module._DeviceMirror(plan.capacity, device)),
        "device_empty": host_us(lambda: torch.empty(entries, dtype=torch.int32, device=device)),
        "pinned_empty": host_us(lambda: torch.empty(entries, dtype=torch.int32, pin_memory=True)),
        "event_record": host_us(lambda: torch.cuda.Event().record()),
        "np_empty": host_us(lambda: np.empty(entries, dtype=np.int32)),
    }


def cprofile(name: str, device: torch.device, calls: int, top: int = 25) -> None:
    """cProfile over ``calls`` back-to-back ``from_csr`` calls for workload ``name`` on ``device``, each plan kept
    until the next one is built (a serving loop's ``plan = from_csr(...)``); prints the ``top`` functions by own
    time and by cumulative time, in µs per call of ``from_csr``."""
    w = bench.WORKLOADS[name]
    inp = bench.make_inputs(w, torch.Generator().manual_seed(0), device)
    kwargs = {k: v for k, v in bench.plan_kwargs(w).items() if v is not None}
    given = tuple(inp.csr)

    def loop(n: int) -> float:
        plan = None
        t0 = time.perf_counter()
        for _ in range(n):
            plan = pw.PrefillPagedPlan.from_csr(*given, **kwargs, device=device)
        elapsed = time.perf_counter() - t0
        del plan
        torch.cuda.synchronize()
        return elapsed * 1e6 / n

    loop(50)  # warm: pooled buffers, caches, the staging buffers' events
    plain = min(loop(calls) for _ in range(3))
    profiler = cProfile.Profile()
    profiler.enable()
    profiled = loop(calls)
    profiler.disable()
    print(
        f"\n{name}: from_csr(device={str(device)!r}) {plain:.1f} µs per call back to back, {profiled:.1f} µs "
        f"under cProfile ({calls} calls)"
    )
    rows = []  # (own µs, cumulative µs, calls, function) per from_csr call
    for (path, line, func), (_, ncalls, own, cumulative, _) in pstats.Stats(profiler).stats.items():
        where = func if path == "~" else f"{'/'.join(path.split('/')[-2:])}:{line}({func})"
        rows.append((own * 1e6 / calls, cumulative * 1e6 / calls, ncalls / calls, where))
    for title, key in (("own time", 0), ("cumulative time", 1)):
        print(f"\ntop {top} by {title} (µs per from_csr call)\n{'own':>8} {'cumul':>8} {'calls':>6}  function")
        for own, cumulative, per_call, where in sorted(rows, key=lambda r: -r[key])[:top]:
            print(f"{own:8.2f} {cumulative:8.2f} {per_call:6.2f}  {where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cprofile", action="store_true", help="profile back-to-back from_csr calls instead")
    parser.add_argument("--workload", default="decode_64x4096", choices=WORKLOADS, help="--cprofile's workload")
    parser.add_argument("--calls", type=int, default=2000, help="--cprofile's from_csr calls")
    args = parser.parse_args()
    device = torch.device("cuda")
    ops.library(device)
    if args.cprofile:
        cprofile(args.workload, device, args.calls)
        return
    rows = []
    for name in WORKLOADS:
        rows.append(profile(name, device))
        print(rows[-1], flush=True)
    keys = list(rows[0])
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(r["workload"] if k == "workload" else f"{r[k]:.1f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
