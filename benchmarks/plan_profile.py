"""Where a new plan's host time goes (``from_csr`` on a CUDA device), piece by piece, for the serving workloads.

Usage on a GPU machine: ``python3 benchmarks/plan_profile.py``; prints a table (µs, medians, the device idle
before each call)."""

from __future__ import annotations

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


def main() -> None:
    device = torch.device("cuda")
    ops.library(device)
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
