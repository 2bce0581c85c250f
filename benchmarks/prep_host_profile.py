"""Where one ``prepare_paged_qkv`` call's host time goes (the decode step, 64 requests x 1 token), piece by piece.

Usage on a GPU machine: ``python3 benchmarks/prep_host_profile.py``; prints a table (µs per call, timed as
``host_cost.py`` times a call: back-to-back calls enqueued behind a device sleep, the pieces interleaved, each
round in a new order)."""

from __future__ import annotations

import torch
from host_cost import host_us_per_call  # benchmarks/host_cost.py, beside this script

import pagedwindow as pw
from pagedwindow import api, bench_prep
from pagedwindow import cuda as cuda_backend
from pagedwindow.cuda import ops
from pagedwindow.gemma_prep import check_prep_scalars, check_rope

WHAT = "prepare_paged_qkv"


def main() -> None:
    w = bench_prep.PREP_WORKLOADS["prep_decode_64x1"]
    inp = bench_prep.make_prep_inputs(w, torch.Generator().manual_seed(0), torch.device("cuda"))
    q, k, v, pool, plan, out_q = inp.q, inp.k, inp.v, inp.pool, inp.plan, inp.out_q
    wq, wk = inp.q_norm_weight, inp.k_norm_weight
    kwargs = dict(
        q_norm_weight=wq,
        k_norm_weight=wk,
        eps=bench_prep.EPS,
        rope_theta=bench_prep.ROPE_THETA,
        norm_style=bench_prep.NORM_STYLE,
        out_q=out_q,
    )
    state, geometry = api._plan_on_pool(WHAT, plan, inp.layout, pool, 0)
    rows, hq, hkv, d = state.total_tokens, state.num_qo_heads, state.num_kv_heads, state.head_dim
    q_shape, kv_shape = (rows, hq, d), (rows, hkv, d)
    inputs = (("q", q), ("k", k), ("v", v), ("q_norm_weight", wq), ("k_norm_weight", wk))
    written = (("out_q", out_q), ("pool", pool))
    spans, address_bits = api._memory_spans(False, *written, *inputs)
    pieces = {
        "whole call, backend='cuda'": lambda: pw.prepare_paged_qkv(
            q, k, v, pool, inp.layout, 0, plan, backend="cuda", **kwargs
        ),
        "whole call, backend='auto'": lambda: pw.prepare_paged_qkv(
            q, k, v, pool, inp.layout, 0, plan, backend="auto", **kwargs
        ),
        "scalars (eps, theta, factor)": lambda: check_prep_scalars(WHAT, 1e-6, 10000.0, 1.0),
        "plan on pool (geometry cached)": lambda: api._plan_on_pool(WHAT, plan, inp.layout, pool, 0),
        "rope bounds": lambda: check_rope(WHAT, d, 10000.0, 1.0, state.total_pages * state.page_size, compiling=False),
        "q, k, v, out_q rows": lambda: [
            api._check_rows(WHAT, n, t, s, pool.dtype, pool.device)
            for n, t, s in (("q", q, q_shape), ("k", k, kv_shape), ("v", v, kv_shape), ("out_q", out_q, q_shape))
        ],
        "two norm weights": lambda: [
            api._check_norm_weight(WHAT, n, t, d, pool.dtype, pool.device) for n, t in (("wq", wq), ("wk", wk))
        ],
        "writable out_q, pool": lambda: (
            api._check_writable(WHAT, "o", out_q, False),
            api._check_writable(WHAT, "p", pool, False),
        ),
        "spans and overlaps": lambda: api._check_disjoint(WHAT, api._memory_spans(False, *written, *inputs)[0], 2),
        "resolve backend 'cuda'": lambda: api._resolve_backend(
            WHAT, "cuda", plan, pool.device, pool.dtype, api._addresses(spans), address_bits
        ),
        "cuda backend (block + launch)": lambda: cuda_backend.prepare_paged_qkv(
            q,
            k,
            v,
            pool,
            geometry,
            plan,
            q_norm_weight=wq,
            k_norm_weight=wk,
            eps=1e-6,
            rope_theta=10000.0,
            rope_position_factor=1.0,
            norm_style="gemma4",
            out_q=out_q,
            compiling=False,
        ),
    }
    pieces["whole call, backend='cuda'"]()  # fills the plan's launch block
    block = plan.launch_cache[("prepare", q.device.index)]
    lib = ops.library(q.device)
    pieces["launcher alone (ctypes call)"] = lambda: ops._launch_on(q.device, lib.pw_prepare_qkv, block)
    print("| piece | µs per call |\n|---|---|")
    for name, us in host_us_per_call(pieces, n=200, rounds=15).items():
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
