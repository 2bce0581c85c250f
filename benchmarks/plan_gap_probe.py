"""Where a new plan's extra host time goes (``from_csr`` against ``update_csr`` of the same CUDA CSR tensors),
piece by piece, timed as ``plan_profile.py --forms`` times (the device idle before each call, the pieces
interleaved, each round in a new random order), then cProfile of ``from_csr`` under the same conditions.

``--host-csr``: the same from CPU CSR tensors (the host's compiled pass), with FlashInfer fa2's ``plan`` of host
indptrs beside it where FlashInfer imports.

Usage on a GPU machine: ``python3 benchmarks/plan_gap_probe.py [B,N,C,P] [--reps N] [--host-csr]``."""

from __future__ import annotations

import argparse
import cProfile

import plan_profile
import torch

import pagedwindow as pw
from pagedwindow import bench
from pagedwindow import plan as plan_module
from pagedwindow.cuda import ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("shape", nargs="?", default="1,1024,0,16")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--host-csr", action="store_true", help="CPU CSR tensors instead of CUDA ones")
    args = parser.parse_args()
    device = torch.device("cuda")
    ops.library(device)
    batch, new, cached, page = map(int, args.shape.split(","))
    w = bench.Workload("probe", (new,) * batch, (cached,) * batch, page_size=page)
    host = plan_profile._shape_csr(batch, new, cached, page, torch.Generator())
    cuda = host if args.host_csr else bench.Csr(*(t.to(device) for t in host))
    kwargs = {k: v for k, v in bench.plan_kwargs(w).items() if v is not None}
    heads = plan_module._Heads.checked(
        kwargs["num_qo_heads"], kwargs["num_kv_heads"], kwargs["head_dim"], kwargs["page_size"]
    )
    plan = pw.PrefillPagedPlan.from_csr(*cuda, **kwargs, device=device)

    def make_state(tile):
        if args.host_csr:
            arrays = plan_module._csr_arrays(*cuda)
            return plan_module._state_from_csr(*arrays, heads, tile, device, given=tuple(cuda))
        return plan_module._state_from_device_csr(tuple(cuda), heads, tile, device, None)

    state, reason = make_state(None)
    cap = plan.capacity
    held = [None]  # a serving loop's `plan = from_csr(...)`: the previous plan is freed by the assignment

    def replace():
        held[0] = pw.PrefillPagedPlan.from_csr(*cuda, **kwargs, device=device)

    timed = {
        "from_csr": lambda: pw.PrefillPagedPlan.from_csr(*cuda, **kwargs, device=device),
        "from_csr, replacing": replace,
        "update_csr": lambda: plan.update_csr(*cuda, **kwargs),
        "state (pass + pack + policy)": lambda: make_state(None),
        "state (pass + pack, tile fixed)": lambda: make_state(state.cta_tile_q),
        "_exact(state)": lambda: pw.PrefillPagedPlan._exact(state, reason, device),
        "construct (mirror)": lambda: pw.PrefillPagedPlan(cap, cta_tile_q=state.cta_tile_q, device=device),
        "construct (cpu)": lambda: pw.PrefillPagedPlan(cap, cta_tile_q=state.cta_tile_q, device=None),
        "_commit(state)": lambda: plan._commit(state),
        "capacity": lambda: plan_module._exact_capacity(
            state.total_tokens, state.total_pages, state.batch_size, state.num_tiles
        ),
    }
    if args.host_csr:
        try:
            wrapper = bench._flashinfer_wrapper("fa2", device)
            host_indptr = cuda._replace(kv_indices=cuda.kv_indices.to(device))
            bench._flashinfer_plan(wrapper, host_indptr, w)
            timed["fa2 plan, host indptrs"] = lambda: bench._flashinfer_plan(wrapper, host_indptr, w)
        except ImportError as exc:
            print(f"FlashInfer not timed: {exc}")
    for name, ms in bench.interleaved_host_ms(timed, args.reps).items():
        print(f"{name:32} {1e3 * ms:8.1f} µs")
    profiler = cProfile.Profile()
    calls = 1000
    for _ in range(calls):
        torch.cuda.synchronize()
        profiler.enable()
        pw.PrefillPagedPlan.from_csr(*cuda, **kwargs, device=device)
        profiler.disable()
    plan_profile.print_profile(profiler, calls, "from_csr (device idle before each)", top=22)


if __name__ == "__main__":
    main()
