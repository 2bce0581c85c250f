"""Planning on a host without a GPU (CI's kind of machine: the plan's numpy pass, no kernels library): host ms of
``from_csr`` (a new plan), ``update_csr`` (re-planning an exact plan) and the per-request list form (``batch``)
for the host-cost workloads, the forms interleaved with each round in a new random order.

Usage: ``python3 benchmarks/plan_cpu_host.py [--reps N]``; prints a table (ms, medians) last."""

from __future__ import annotations

import argparse
import os

import torch
from host_cost import WORKLOADS  # benchmarks/host_cost.py, beside this script: its five workloads

import pagedwindow as pw
from pagedwindow import bench
from pagedwindow.testing import random_pages


def forms(name: str, reps: int) -> dict:
    """One workload's median host ms of each form, on the CPU."""
    w = bench.WORKLOADS[name]
    table = random_pages(torch.Generator().manual_seed(0), w.kv_lens, w.page_size, spare_pages=8)
    csr = table.csr(w.seq_lens)  # CPU int32 tensors
    kwargs = bench.plan_kwargs(w)
    plan = pw.PrefillPagedPlan.from_csr(*csr, **kwargs)
    pages = [list(p) for p in plan.pages]
    lists = (pages, plan.last_page_len.tolist(), list(plan.start_positions), list(plan.seq_lens))
    fns = {
        "from_csr": lambda: pw.PrefillPagedPlan.from_csr(*csr, **kwargs),
        "update_csr": lambda: plan.update_csr(*csr, **kwargs),
        "batch (lists)": lambda: pw.PrefillPagedPlan.batch(*lists, **kwargs),
    }
    return bench.interleaved_host_ms(fns, reps, synchronize=lambda: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    rows = {name: forms(name, args.reps) for name in WORKLOADS}
    print(f"CPU: {os.cpu_count()} cores, torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    names = list(next(iter(rows.values())))
    print("| workload | " + " | ".join(f"{n} ms" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for workload, row in rows.items():
        print(f"| {workload} | " + " | ".join(f"{row[n]:.3f}" for n in names) + " |")


if __name__ == "__main__":
    main()
