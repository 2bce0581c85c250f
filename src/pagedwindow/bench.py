"""``pagedwindow bench``: the Gemma-4 local-layer workloads timed for pagedwindow and its peers in one process.

Every system's output is checked against the PyTorch reference (fp32 math on the GPU) before it is timed. Times
are medians of CUDA-event pairs over rotated input sets, measured with the host queued ahead of the GPU (a device
sleep first) so launch overhead does not leak into kernel time. Useful FLOPs count visible (query, key) pairs
only: ``4 * head_dim * num_qo_heads * sum(visible)``. The bf16 GEMM rate is measured in the same run.
"""

from __future__ import annotations

import datetime
import json
import statistics
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

import pagedwindow as pw

from .semantics import window_start

HQ, HKV, HEAD_DIM, PAGE_SIZE, WINDOW_LEFT, SM_SCALE = 16, 8, 256, 16, 1023, 1.0
OUTPUT_TOLERANCE = 1e-2
"""A system's output passes when max |out - reference| <= OUTPUT_TOLERANCE * max |reference|: four bf16 ulps at
the output's largest magnitude (Gemma-4 logits are unscaled, so softmax is sharp and outputs reach |V|'s tail)."""
SYSTEMS = ("pagedwindow", "flashinfer_fa2", "flashinfer_fa3", "flex", "sdpa")


@dataclass(frozen=True)
class Workload:
    name: str
    seq_lens: tuple[int, ...]
    start_positions: tuple[int, ...]
    window_left: int = WINDOW_LEFT

    @property
    def kv_lens(self) -> tuple[int, ...]:
        return tuple(s + n for s, n in zip(self.start_positions, self.seq_lens))

    def visible_pairs(self) -> int:
        """Visible (query, key) pairs per head, summed over the batch."""
        total = 0
        for start, seq in zip(self.start_positions, self.seq_lens):
            for q_pos in range(start, start + seq):
                total += q_pos - window_start(q_pos, self.window_left) + 1
        return total

    def useful_flops(self) -> int:
        return 4 * HEAD_DIM * HQ * self.visible_pairs()


WORKLOADS = {
    w.name: w
    for w in (
        Workload("prefill_1x8192", (8192,), (0,)),
        Workload("prefill_8x2048", (2048,) * 8, (0,) * 8),
        Workload("chunk_2048_on_6144", (2048,), (6144,)),
        Workload("decode_64x4096", (1,) * 64, (4096,) * 64),
    )
}


SWEEP_SYSTEMS = ("pagedwindow", "flashinfer_fa2", "flashinfer_fa3")
"""Sweep points time the paged kernels only (flex recompiles per shape; SDPA's dense mask grows as kv²)."""


def sweep_workloads() -> list[Workload]:
    """Single-request prefill over kv length and window."""
    out = []
    for kv in (1024, 4096, 16384):
        for window in (255, 1023, -1):
            out.append(Workload(f"sweep_kv{kv}_w{window}", (kv,), (0,), window))
    return out


@dataclass
class Inputs:
    """One input set: a pool with shuffled pages holding each request's whole KV, the plan and q."""

    layout: pw.PagedKvLayout
    pool: torch.Tensor  # [num_pages, 1, 2, PAGE_SIZE, HKV, HEAD_DIM]
    plan: pw.PrefillPagedPlan
    q: torch.Tensor  # [total_tokens, HQ, HEAD_DIM]
    out: torch.Tensor  # [total_tokens, HQ, HEAD_DIM]


def make_inputs(w: Workload, gen: torch.Generator, device, cta_tile_q=None) -> Inputs:
    need = [-(-kv // PAGE_SIZE) for kv in w.kv_lens]
    num_pages = sum(need) + 8
    order = torch.randperm(num_pages, generator=gen).tolist()
    pages, at = [], 0
    for n in need:
        pages.append(order[at: at + n])
        at += n
    lasts = [kv - (n - 1) * PAGE_SIZE for kv, n in zip(w.kv_lens, need)]
    layout = pw.PagedKvLayout(1, HKV, HEAD_DIM, PAGE_SIZE)
    pool = layout.allocate(num_pages, torch.bfloat16, device)
    pool.normal_(generator=None)
    plan = pw.PrefillPagedPlan.batch(pages, lasts, list(w.start_positions), list(w.seq_lens), num_qo_heads=HQ,
                                     num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=PAGE_SIZE, cta_tile_q=cta_tile_q,
                                     device=device)
    q = torch.randn(plan.total_tokens, HQ, HEAD_DIM, device=device, dtype=torch.bfloat16)
    return Inputs(layout, pool, plan, q, torch.empty_like(q))


def dense_kv(inp: Inputs, request: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ``request``'s K and V gathered from the pool: ``[kv_len, HKV, HEAD_DIM]`` each."""
    kv_len = inp.plan.kv_lens[request]
    pages = torch.tensor(inp.plan.pages[request], device=inp.pool.device)
    k = inp.pool[pages, 0, 0].reshape(-1, HKV, HEAD_DIM)[:kv_len]
    v = inp.pool[pages, 0, 1].reshape(-1, HKV, HEAD_DIM)[:kv_len]
    return k, v


# -- systems: each returns a zero-argument callable that writes its output, and that output ---------------------

def system_pagedwindow(w: Workload, inp: Inputs):
    def call():
        pw.batch_prefill_paged_window(inp.q, inp.pool, inp.layout, 0, inp.plan, sm_scale=SM_SCALE,
                                      window_left=w.window_left, out=inp.out, backend="cuda")
    return call, lambda: inp.out


def _flashinfer(backend: str):
    def make(w: Workload, inp: Inputs):
        import flashinfer

        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=inp.q.device)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
        p = inp.plan
        k_cache = inp.pool[:, 0, 0].contiguous()  # [num_pages, PAGE_SIZE, HKV, HEAD_DIM]
        v_cache = inp.pool[:, 0, 1].contiguous()
        wrapper.plan(p.qo_indptr.to(inp.q.device), p.page_indptr.to(inp.q.device),
                     p.page_indices.to(inp.q.device), p.last_page_len.to(inp.q.device), HQ, HKV, HEAD_DIM,
                     PAGE_SIZE, causal=True, window_left=w.window_left, sm_scale=SM_SCALE,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        out = torch.empty_like(inp.q)

        def call():
            wrapper.run(inp.q, (k_cache, v_cache), out=out)
        return call, lambda: out
    return make


def system_flex(w: Workload, inp: Inputs):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    qo = inp.plan.qo_indptr.tolist()
    calls, outs = [], []
    for r, (start, seq) in enumerate(zip(w.start_positions, w.seq_lens)):
        k, v = dense_kv(inp, r)
        kv_len = start + seq
        qr = inp.q[qo[r]: qo[r + 1]].transpose(0, 1)[None]  # [1, HQ, seq, D]
        kr, vr = k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous()  # [1, HKV, kv, D]
        offset, wl = kv_len - seq, w.window_left

        def mask_mod(b, h, q_idx, kv_idx, offset=offset, wl=wl):
            q_pos = q_idx + offset
            visible = kv_idx <= q_pos
            return visible & (q_pos - kv_idx <= wl) if wl >= 0 else visible

        block_mask = create_block_mask(mask_mod, 1, 1, seq, kv_len, device=inp.q.device)
        calls.append((qr, kr, vr, block_mask))
    # decode-sized batches of identical requests run as one batched call
    if len(set(zip(w.start_positions, w.seq_lens))) == 1 and len(calls) > 1:
        q_all = torch.cat([c[0] for c in calls])
        k_all, v_all = torch.cat([c[1] for c in calls]), torch.cat([c[2] for c in calls])
        mask = calls[0][3]
        calls = [(q_all, k_all, v_all, mask)]

    def call():
        outs.clear()
        for qr, kr, vr, mask in calls:
            outs.append(compiled(qr, kr, vr, block_mask=mask, scale=SM_SCALE, enable_gqa=True))
    return call, lambda: torch.cat([o[0].transpose(0, 1) if o.shape[0] == 1 else
                                    o.transpose(1, 2).reshape(-1, HQ, HEAD_DIM) for o in outs])


def system_sdpa(w: Workload, inp: Inputs):
    import torch.nn.functional as F

    qo = inp.plan.qo_indptr.tolist()
    groups: dict[tuple[int, int], list[int]] = {}
    for r, key in enumerate(zip(w.start_positions, w.seq_lens)):
        groups.setdefault(key, []).append(r)
    batches = []
    for (start, seq), reqs in groups.items():
        kv_len = start + seq
        q = torch.stack([inp.q[qo[r]: qo[r + 1]].transpose(0, 1) for r in reqs])  # [B, HQ, seq, D]
        kvs = [dense_kv(inp, r) for r in reqs]
        k = torch.stack([x[0].transpose(0, 1) for x in kvs]).contiguous()  # [B, HKV, kv, D]
        v = torch.stack([x[1].transpose(0, 1) for x in kvs]).contiguous()
        q_pos = torch.arange(start, kv_len, device=q.device)[:, None]
        key = torch.arange(kv_len, device=q.device)[None, :]
        mask = key <= q_pos
        if w.window_left >= 0:
            mask &= q_pos - key <= w.window_left
        batches.append((reqs, q, k, v, mask))
    outs = []

    def call():
        outs.clear()
        for reqs, q, k, v, mask in batches:
            outs.append((reqs, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SM_SCALE,
                                                              enable_gqa=True)))

    def output():
        result = torch.empty_like(inp.q)
        for reqs, o in outs:
            for i, r in enumerate(reqs):
                result[qo[r]: qo[r + 1]] = o[i].transpose(0, 1)
        return result
    return call, output


MAKERS = {"pagedwindow": system_pagedwindow, "flashinfer_fa2": _flashinfer("fa2"),
          "flashinfer_fa3": _flashinfer("fa3"), "flex": system_flex, "sdpa": system_sdpa}


# -- timing -------------------------------------------------------------------------------------------------------

def median_ms(calls: list, reps: int) -> float:
    """Median CUDA-event time of ``calls`` in rotation, with the host queued ahead of the GPU."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda._sleep(int(2e8))  # keep the GPU busy while the host enqueues every timed call
    for i in range(reps):
        starts[i].record()
        calls[i % len(calls)]()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def gemm_tflops(device) -> float:
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = median_ms([lambda: a @ b], 20)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def reference_output(w: Workload, inp: Inputs) -> torch.Tensor:
    return pw.batch_prefill_paged_window(inp.q, inp.pool, inp.layout, 0, inp.plan, sm_scale=SM_SCALE,
                                         window_left=w.window_left, backend="reference").float()


def allocations_per_call(w: Workload, inp: Inputs) -> int:
    """Allocator calls made by 10 pagedwindow calls with ``out`` given (the contract: none)."""
    call, _ = system_pagedwindow(w, inp)
    call()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["allocation.all.allocated"] - before


def run_bench(out="benchmarks/results", workloads=None, systems=None, sweep=False, quick=False, cta_tile_q=None,
              label=None) -> int:
    """Measure, print a table, write ``h200-<date>[-label].json`` / ``.md`` into ``out``. Returns an exit code.

    ``cta_tile_q`` overrides the plans' tile (all systems see the same plan; only pagedwindow reads the tile).
    """
    if not torch.cuda.is_available():
        print("pagedwindow bench needs a CUDA GPU; none is available.")
        return 2
    device = torch.device("cuda")
    chosen = [WORKLOADS[n] for n in (workloads or WORKLOADS)]
    if sweep:
        chosen += sweep_workloads()
    systems = list(systems or SYSTEMS)
    reps, sets = (10, 2) if quick else (50, 3)
    peak = gemm_tflops(device)
    records, allocations = [], {}
    for w in chosen:
        gen = torch.Generator().manual_seed(0)
        input_sets = [make_inputs(w, gen, device, cta_tile_q) for _ in range(sets)]
        want = reference_output(w, input_sets[0])
        for system in systems:
            record = {"system": system, "workload": w.name, "ms": None, "useful_tflops": None,
                      "max_abs_err": None, "err_bound": None, "status": "ok"}
            if w.name not in WORKLOADS and system not in SWEEP_SYSTEMS:
                record["status"] = "not run at sweep points"
                records.append(record)
                continue
            try:
                made = [MAKERS[system](w, inp) for inp in input_sets]
                made[0][0]()
                torch.cuda.synchronize()
                err = (made[0][1]().float() - want).abs().max().item()
                record["max_abs_err"] = err
                bound = OUTPUT_TOLERANCE * want.abs().max().item()
                record["err_bound"] = bound
                if not err <= bound:
                    record["status"] = f"wrong output (max abs err {err:.3e} > {bound:.3e})"
                else:
                    ms = median_ms([m[0] for m in made], reps)
                    record.update(ms=ms, useful_tflops=w.useful_flops() / (ms * 1e-3) / 1e12)
            except ImportError as exc:
                record["status"] = f"missing: {exc}"
            except Exception as exc:  # a peer that fails is reported, not dropped
                record["status"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                traceback.print_exc()
            records.append(record)
            print(f"{w.name:>22} {system:>15} {record['ms'] or float('nan'):9.4f} ms  {record['status']}", flush=True)
        if "pagedwindow" in systems:
            allocations[w.name] = allocations_per_call(w, input_sets[0])
        del input_sets
        torch.cuda.empty_cache()
    from .cuda import build, ops

    kernel = ops.prefill_entry(build.target_for_capability(*torch.cuda.get_device_capability(device)))
    result = {"gpu": torch.cuda.get_device_name(device), "date": datetime.date.today().isoformat(),
              "prefill_kernel": kernel,
              "torch": torch.__version__, "peak_bf16_tflops": peak, "cta_tile_q": cta_tile_q, "label": label,
              "allocations_per_10_calls": allocations, "records": records}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"h200-{result['date']}" + (f"-{label}" if label else "")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    table = markdown_table(result)
    (out / f"{stem}.md").write_text(table)
    write_plots(out / f"{stem}.json")
    print(table)
    return 0


def write_plots(path: Path) -> None:
    """Throughput and speed-up PNGs beside the results JSON."""
    import matplotlib

    matplotlib.use("Agg")
    from .viz.bench_plots import plot_speedup, plot_throughput
    from .viz.bench_results import load_results

    results = load_results(path)
    for name, plot in (("throughput", plot_throughput), ("speedup", plot_speedup)):
        plot(results).savefig(path.with_name(f"{path.stem}-{name}.png"), dpi=120)


def markdown_table(result: dict) -> str:
    """Workloads × systems: ms, useful TF/s, % of the measured bf16 GEMM rate, pagedwindow's speed-up."""
    timed = result["records"]
    workloads = list(dict.fromkeys(r["workload"] for r in timed))
    systems = list(dict.fromkeys(r["system"] for r in timed))
    by = {(r["workload"], r["system"]): r for r in timed}
    lines = [f"GPU: {result['gpu']}; bf16 GEMM {result['peak_bf16_tflops']:.0f} TF/s measured in the same run", "",
             "| workload | system | ms | useful TF/s | % GEMM | pagedwindow speed-up | max abs err |",
             "|---|---|---|---|---|---|---|"]
    for w in workloads:
        ours = by.get((w, "pagedwindow"), {}).get("ms")
        for s in systems:
            r = by.get((w, s))
            if r is None:
                continue
            if r["ms"] is None:
                lines.append(f"| {w} | {s} | — | — | — | — | {r['status']} |")
                continue
            speedup = f"{r['ms'] / ours:.2f}×" if ours else "—"  # peer time / ours: > 1 means we are faster
            lines.append(f"| {w} | {s} | {r['ms']:.4f} | {r['useful_tflops']:.1f} | "
                         f"{100 * r['useful_tflops'] / result['peak_bf16_tflops']:.1f} | {speedup} | "
                         f"{r['max_abs_err']:.2e} |")
    allocations = result.get("allocations_per_10_calls") or {}
    if allocations:
        lines += ["", "Allocations made by 10 pagedwindow calls with `out` given (the contract: 0): "
                  + ", ".join(f"{w} {n}" for w, n in allocations.items())]
    return "\n".join(lines) + "\n"
