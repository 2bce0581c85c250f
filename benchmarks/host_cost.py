"""Host time of one call, as a serving loop pays it: pagedwindow's wrappers against FlashInfer's ``run``.

The GPU is kept busy (a device sleep queued first) while N calls are enqueued back to back, so the wall-clock per
call is the host's cost alone: argument checks, dispatch, the launch itself. Also times plan building from CSR
(``from_csr`` / ``update_csr``, and the per-request list form) against FlashInfer's ``plan`` for the same batch.
Usage on a GPU machine: ``python3 benchmarks/host_cost.py [--json PATH]``; prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

import pagedwindow as pw
from pagedwindow import bench

WORKLOADS = ("prompts_32x128", "chunk_512_on_30000", "decode_64x4096", "decode_256x2000_p32", "prefill_8x2048")


def _busy_gpu() -> None:
    torch.cuda._sleep(int(5e7))  # ~30 ms of GPU time: the calls timed behind it only enqueue


def host_us_per_call(
    calls: dict, n: int = 200, rounds: int = 9, busy=_busy_gpu, synchronize=torch.cuda.synchronize
) -> dict:
    """Host wall-clock µs per call of each of ``calls`` (name -> callable): ``n`` calls enqueued behind a device
    sleep (``busy``; ``synchronize`` after them), the systems interleaved, each round in a new order
    (``bench.shuffled_rounds``: host drift hits all alike), the garbage collector off; the median over
    ``rounds``. Without a GPU, pass no-ops for both."""
    for call in calls.values():
        call()
    synchronize()
    per_call = {name: [] for name in calls}
    gc.disable()
    try:
        for order in bench.shuffled_rounds(calls, rounds):
            for name in order:
                call = calls[name]
                busy()
                t0 = time.perf_counter()
                for _ in range(n):
                    call()
                per_call[name].append((time.perf_counter() - t0) * 1e6 / n)
                synchronize()
    finally:
        gc.enable()
    return {name: statistics.median(times) for name, times in per_call.items()}


def measure(name: str, device: torch.device, flashinfer: tuple[str, ...], plan_only: bool = False) -> dict:
    """One workload's row: host µs per call of each wrapper and FlashInfer's run, plan-build ms of each
    (``plan_only``: the plan builds alone)."""
    w = bench.WORKLOADS[name]
    inp = bench.make_inputs(w, torch.Generator().manual_seed(0), device)
    row = {"workload": name, "cta_tile_q": inp.plan.cta_tile_q}
    if not plan_only:
        row.update(call_costs(w, inp, device, flashinfer))
    row.update(plan_costs(w, inp, device, flashinfer))
    return row


def call_costs(w, inp, device, flashinfer: tuple[str, ...]) -> dict:
    """Host µs per call of each wrapper and of FlashInfer's run, measured interleaved."""
    row = {}
    kv = torch.randn(inp.plan.total_tokens, bench.HKV, bench.HEAD_DIM, dtype=torch.bfloat16, device=device)
    calls = {
        f"prefill_{backend}_us": (
            lambda b=backend: pw.batch_prefill_paged_window(
                inp.q,
                inp.pool,
                inp.layout,
                0,
                inp.plan,
                sm_scale=bench.SM_SCALE,
                window_left=w.window_left,
                out=inp.out,
                backend=b,
            )
        )
        for backend in ("cuda", "auto")
    }
    calls["prefill_out_none_us"] = lambda: pw.batch_prefill_paged_window(
        inp.q, inp.pool, inp.layout, 0, inp.plan, sm_scale=bench.SM_SCALE, window_left=w.window_left, backend="cuda"
    )
    calls["append_us"] = lambda: pw.append_paged_kv(kv, kv, inp.pool, inp.layout, 0, inp.plan, backend="cuda")
    for backend in flashinfer:
        try:
            calls[f"flashinfer_{backend}_run_us"] = bench.MAKERS[f"flashinfer_{backend}"](w, inp)[0]
        except Exception as exc:  # a peer that fails is reported, not dropped
            row[f"flashinfer_{backend}_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    row.update(host_us_per_call(calls))
    return row


def plan_costs(w, inp, device, flashinfer: tuple[str, ...]) -> dict:
    """Host ms of building the plan, every form interleaved (each round in a new random order): from_csr (a new
    plan), update_csr (CPU and CUDA inputs), the per-request list form, FlashInfer's plan (CUDA arrays, and host
    indptrs)."""
    kwargs = bench.plan_kwargs(w)
    plan = inp.plan
    cuda_csr = bench.Csr(*(t.to(device) for t in inp.csr))
    host_indptr = inp.csr._replace(kv_indices=cuda_csr.kv_indices)
    lists = (
        [list(p) for p in plan.pages],
        plan.last_page_len.tolist(),
        list(plan.start_positions),
        list(plan.seq_lens),
    )
    fns = {
        "from_csr_ms": lambda: pw.PrefillPagedPlan.from_csr(*inp.csr, **kwargs, device=device),
        "update_csr_ms": lambda: plan.update_csr(*inp.csr, **kwargs),
        "update_csr_cuda_inputs_ms": lambda: plan.update_csr(*cuda_csr, **kwargs),
        "batch_lists_ms": lambda: pw.PrefillPagedPlan.batch(*lists, **kwargs, device=device),
    }
    row = {}
    for backend in flashinfer:
        try:
            wrapper = bench._flashinfer_wrapper(backend, device)
            bench._flashinfer_plan(wrapper, cuda_csr, w)  # builds its module on first use
            fns[f"flashinfer_{backend}_plan_ms"] = lambda wr=wrapper: bench._flashinfer_plan(wr, cuda_csr, w)
            fns[f"flashinfer_{backend}_plan_host_indptr_ms"] = lambda wr=wrapper: bench._flashinfer_plan(
                wr, host_indptr, w
            )
        except Exception as exc:  # a peer that fails is reported, not dropped
            row[f"flashinfer_{backend}_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    row.update(bench.interleaved_host_ms(fns))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    parser.add_argument("--flashinfer", nargs="*", default=["fa2", "fa3"], help="FlashInfer backends to time")
    parser.add_argument("--plan-only", action="store_true", help="time plan builds only")
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for name in WORKLOADS:
        rows.append(measure(name, device, tuple(args.flashinfer), args.plan_only))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    keys = [
        "prefill_cuda_us",
        "prefill_auto_us",
        "prefill_out_none_us",
        "append_us",
        "flashinfer_fa2_run_us",
        "flashinfer_fa3_run_us",
        "from_csr_ms",
        "update_csr_ms",
        "update_csr_cuda_inputs_ms",
        "batch_lists_ms",
        "flashinfer_fa2_plan_ms",
        "flashinfer_fa2_plan_host_indptr_ms",
        "flashinfer_fa3_plan_ms",
    ]
    print("\n| workload | tile | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for row in rows:
        cells = [f"{row[k]:.3f}" if isinstance(row.get(k), float) else str(row.get(k, "—")) for k in keys]
        print(f"| {row['workload']} | {row['cta_tile_q']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
