"""Where a new plan's host time goes (``from_csr`` on a CUDA device), piece by piece, for the serving workloads.

Usage on a GPU machine: ``python3 benchmarks/plan_profile.py``; prints a table (µs, medians, the device idle
before each call). ``--cprofile [--workload NAME] [--calls N] [--method from_csr|update_csr]`` instead runs
cProfile over N back-to-back ``from_csr(..., device="cuda")`` calls, or ``update_csr`` calls on one plan (default:
decode_64x4096, 2000 calls, ``from_csr``) and prints the top functions by own time and by cumulative time, in µs
per call. ``--forms [--shapes "B,N,C,P;..." | sweep]`` times planning
by the form of the CSR arrays: pagedwindow's ``from_csr`` / ``update_csr`` of CUDA and of CPU tensors, and
FlashInfer fa2's ``plan`` (CUDA arrays; host indptrs) when flashinfer imports, every form interleaved, each
round in a new random order; a shape is B requests of N new tokens on C cached keys with page size P, page ids
shuffled."""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from host_cost import WORKLOADS  # benchmarks/host_cost.py, beside this script: its five workloads

import pagedwindow as pw
from pagedwindow import bench, bench_sweep
from pagedwindow import plan as plan_module
from pagedwindow.cuda import host_pass, ops


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


def cprofile(
    name: str, device: torch.device, calls: int, top: int = 25, csr_device: str = "cpu", method: str = "from_csr"
) -> None:
    """cProfile over ``calls`` back-to-back ``method`` calls (``from_csr``: each plan kept until the next one is
    built, a serving loop's ``plan = from_csr(...)``; ``update_csr``: one plan re-planned in place) for workload
    ``name`` on ``device``; prints the ``top`` functions by own time and by cumulative time, in µs per call.
    ``csr_device``: where the CSR tensors are."""
    w = bench.WORKLOADS[name]
    inp = bench.make_inputs(w, torch.Generator().manual_seed(0), device)
    kwargs = {k: v for k, v in bench.plan_kwargs(w).items() if v is not None}
    given = tuple(t.to(csr_device) for t in inp.csr)
    kept = pw.PrefillPagedPlan.from_csr(*given, **kwargs, device=device)

    def loop(n: int) -> float:
        plan = None
        t0 = time.perf_counter()
        if method == "from_csr":
            for _ in range(n):
                plan = pw.PrefillPagedPlan.from_csr(*given, **kwargs, device=device)
        else:
            for _ in range(n):
                kept.update_csr(*given, **kwargs)
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
        f"\n{name}: {method}({csr_device} CSR, device={str(device)!r}) {plain:.1f} µs per call back to back, "
        f"{profiled:.1f} µs "
        f"under cProfile ({calls} calls)"
    )
    print_profile(profiler, calls, f"{method} call", top)


def print_profile(profiler: cProfile.Profile, calls: int, what: str, top: int = 25) -> None:
    """The ``top`` functions of ``profiler`` by own time and by cumulative time, in µs per one of ``calls``
    profiled calls (``what`` names the call)."""
    rows = []  # (own µs, cumulative µs, calls, function) per profiled call
    for (path, line, func), (_, ncalls, own, cumulative, _) in pstats.Stats(profiler).stats.items():
        where = func if path == "~" else f"{'/'.join(path.split('/')[-2:])}:{line}({func})"
        rows.append((own * 1e6 / calls, cumulative * 1e6 / calls, ncalls / calls, where))
    for title, key in (("own time", 0), ("cumulative time", 1)):
        print(f"\ntop {top} by {title} (µs per {what})\n{'own':>8} {'cumul':>8} {'calls':>6}  function")
        for own, cumulative, per_call, where in sorted(rows, key=lambda r: -r[key])[:top]:
            print(f"{own:8.2f} {cumulative:8.2f} {per_call:6.2f}  {where}")


FORM_SHAPES = (
    "64,1,4095,16;256,1,1999,32;8,2048,0,16;32,128,0,16;1,512,30000,16;1,1024,0,16;1,1,0,16;"
    "64,1,32767,16;512,1,4095,16;64,1,4095,1"
)
"""``--forms``' default shapes: the issue's two decode batches, the serving prefills, a single short prompt and a
single token, then the sweep's largest page tables."""


def _shape_csr(batch: int, new: int, cached: int, page: int, gen: torch.Generator):
    """CPU int32 CSR of ``batch`` requests of ``new`` rows on ``cached`` keys, page ids a random permutation."""
    pages = -(-(cached + new) // page)
    qo = torch.arange(batch + 1, dtype=torch.int32) * new
    kv = torch.arange(batch + 1, dtype=torch.int32) * pages
    ids = torch.randperm(batch * pages + 8, generator=gen)[: batch * pages].to(torch.int32)
    last = torch.full((batch,), (cached + new - 1) % page + 1, dtype=torch.int32)
    return bench.Csr(qo, kv, ids, last)


def _without_device_pass(fn):
    """``fn()`` with CUDA CSR tensors read to the host and checked there (the device pass switched off)."""
    saved = plan_module._state_from_device_csr
    plan_module._state_from_device_csr = lambda *args: None
    try:
        return fn()
    finally:
        plan_module._state_from_device_csr = saved


def _form_row(text: str, device: torch.device, reps: int, gen: torch.Generator, wrapper) -> dict:
    """One shape's median host ms in every form, the forms interleaved, a new random order each round
    (``wrapper``: a warm fa2 wrapper, or None without FlashInfer)."""
    batch, new, cached, page = map(int, text.split(","))
    w = bench.Workload(f"b{batch}_n{new}_c{cached}_p{page}", (new,) * batch, (cached,) * batch, page_size=page)
    host = _shape_csr(batch, new, cached, page, gen)
    cuda = bench.Csr(*(t.to(device) for t in host))
    kwargs = {k: v for k, v in bench.plan_kwargs(w).items() if v is not None}
    plan = pw.PrefillPagedPlan.from_csr(*cuda, **kwargs, device=device)
    host_plan = pw.PrefillPagedPlan.from_csr(*host, **kwargs, device=device)
    check = host_pass.device_check(device)
    assert plan.to_dict() == host_plan.to_dict(), f"{w.name}: the GPU CSR plan differs from the host one"
    timed = {
        "from_csr cuda": lambda: pw.PrefillPagedPlan.from_csr(*cuda, **kwargs, device=device),
        "update_csr cuda": lambda: plan.update_csr(*cuda, **kwargs),
        "from_csr cpu": lambda: pw.PrefillPagedPlan.from_csr(*host, **kwargs, device=device),
        "update_csr cpu": lambda: host_plan.update_csr(*host, **kwargs),
        "from_csr cuda, read to host": lambda: _without_device_pass(
            lambda: pw.PrefillPagedPlan.from_csr(*cuda, **kwargs, device=device)
        ),
        "update_csr cuda, read to host": lambda: _without_device_pass(lambda: plan.update_csr(*cuda, **kwargs)),
        "device check alone": lambda: check.run(tuple(cuda), [len(t) for t in cuda], None),
        "indptr .cpu()": lambda: cuda.kv_indptr.cpu(),
    }
    if wrapper is not None:
        host_indptr = host._replace(kv_indices=cuda.kv_indices)
        timed["fa2 plan cuda"] = lambda: bench._flashinfer_plan(wrapper, cuda, w)
        timed["fa2 plan host indptr"] = lambda: bench._flashinfer_plan(wrapper, host_indptr, w)
    row: dict = {"shape": w.name, "page ids": batch * (-(-(cached + new) // page))}
    row.update(bench.interleaved_host_ms(timed, reps))  # a new random order each round, the device idle before each
    return row


def forms(shapes: str, device: torch.device, reps: int, json_path: str | None = None) -> list[dict]:
    """Median host ms of planning each shape in every form, the forms interleaved (a new random order each round);
    the rows also go to ``json_path`` when given, with how many shapes each pagedwindow form is at or below fa2's
    CUDA-array ``plan``."""
    try:
        import flashinfer  # noqa: F401

        wrapper = bench._flashinfer_wrapper("fa2", device)  # one warm wrapper (its workspace) for every shape
    except ImportError:
        wrapper = None
    gen = torch.Generator().manual_seed(0)
    rows = []
    if shapes == "sweep":  # every distinct batch shape of `pagedwindow bench --sweep` (the window does not plan)
        points = [p for s in bench_sweep.sweep_slices() for p in s.points]
        shapes = ";".join(sorted({f"{p.batch},{p.new_tokens},{p.cached},{p.page_size}" for p in points}))
    for text in shapes.split(";"):
        rows.append(_form_row(text, device, reps, gen, wrapper))
        print(rows[-1], flush=True)
    keys = list(rows[0])
    print("\nplan ms by CSR form (medians, interleaved)\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) if k in ("shape", "page ids") else f"{r[k]:.4f}" for k in keys) + " |")
    at_or_below = {}
    if wrapper is not None:
        for form in ("from_csr cuda", "update_csr cuda", "from_csr cpu", "update_csr cpu"):
            at_or_below[form] = sum(r[form] <= r["fa2 plan cuda"] for r in rows)
            print(f"{form}: at or below fa2's CUDA-array plan at {at_or_below[form]} of {len(rows)} shapes")
    if json_path:
        gpu = torch.cuda.get_device_name(device)
        Path(json_path).write_text(json.dumps({"gpu": gpu, "reps": reps, "rows": rows, "at_or_below_fa2": at_or_below}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cprofile", action="store_true", help="profile back-to-back from_csr calls instead")
    parser.add_argument("--workload", default="decode_64x4096", choices=WORKLOADS, help="--cprofile's workload")
    parser.add_argument("--calls", type=int, default=2000, help="--cprofile's from_csr calls")
    parser.add_argument("--csr-device", default="cpu", help="--cprofile's CSR tensors: cpu or cuda")
    parser.add_argument("--method", default="from_csr", choices=("from_csr", "update_csr"), help="--cprofile's call")
    parser.add_argument("--forms", action="store_true", help="time planning by CSR form against FlashInfer")
    parser.add_argument("--shapes", default=FORM_SHAPES, help='--forms\' shapes: "B,N,C,P;..." or "sweep"')
    parser.add_argument("--reps", type=int, default=100, help="--forms' rounds")
    parser.add_argument("--json", default=None, help="--forms: also write the rows to this JSON file")
    args = parser.parse_args()
    device = torch.device("cuda")
    ops.library(device)
    if args.forms:
        forms(args.shapes, device, args.reps, args.json)
        return
    if args.cprofile:
        cprofile(args.workload, device, args.calls, csr_device=args.csr_device, method=args.method)
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
