"""``pagedwindow bench``: the Gemma-4 local-layer and serving-shaped workloads timed for pagedwindow and its peers.

Every system's output is checked against the PyTorch reference (fp32 math on the GPU) before it is timed. Each
system and workload gets three times:

- ``e2e_ms``: back-to-back API calls as a user makes them (host not queued ahead): synchronize, wall-clock over
  N consecutive calls, synchronize, divided by N; the median of a few such loops. The plan is built beforehand.
- ``ms``: kernel time: the median of CUDA-event pairs over rotated input sets, with the host queued ahead of the
  GPU (a device sleep first) so launch overhead does not leak in.
- ``plan_ms``: host time of planning the batch from its CSR page table given as CUDA tensors (pagedwindow
  ``from_csr``, FlashInfer ``wrapper.plan``), and ``update_plan_ms`` for pagedwindow's in-place ``update_csr`` (a
  serving loop re-plans every step). ``None`` where a system has no plan step. Also recorded: pagedwindow from
  the CPU CSR (``plan_ms_host_csr``, ``update_plan_ms_host_csr``) and FlashInfer with host indptrs
  (``plan_ms_host_indptr``).

Useful FLOPs count visible (query, key) pairs only: ``4 * head_dim * num_qo_heads * sum(visible)``. The bf16 GEMM
rate is measured in the same run. Results are named after the GPU: ``<gpu-slug>-<date>[-label].json`` / ``.md``.
"""

from __future__ import annotations

import datetime
import json
import random
import re
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

import pagedwindow as pw

from .bench_sweep import (
    POINT_NAME_FORMS,
    SweepPoint,
    SweepSlice,
    point_named,
    slower_points,
    sweep_slices,
    sweep_summary,
)
from .measure.bench_results import FLASHINFER_SYSTEMS, SYSTEMS, flashinfer_ratios
from .semantics import key_visible
from .testing import pages_in_turn, random_pages

HQ, HKV, HEAD_DIM, PAGE_SIZE, WINDOW_LEFT, SM_SCALE = 16, 8, 256, 16, 1023, 1.0
"""``PAGE_SIZE`` is the default of ``Workload.page_size``; everything else reads the workload's."""
OUTPUT_TOLERANCE = 1e-2
"""A system's output passes when max |out - reference| <= OUTPUT_TOLERANCE * max |reference|: four bf16 ulps at
the output's largest magnitude (Gemma-4 logits are unscaled, so softmax is sharp and outputs reach |V|'s tail)."""


def _triangle(n: int) -> int:
    """``sum(p + 1 for p in range(n))``."""
    return n * (n + 1) // 2


def visible_pairs_of_request(start: int, seq_len: int, window_left: int) -> int:
    """Visible keys summed over query positions ``start .. start + seq_len - 1``, in closed form.

    The query at ``p`` sees ``min(p, window_left) + 1`` keys (``p + 1`` without a window): ``p + 1`` below the knee
    ``p = window_left``, ``window_left + 1`` from it on.
    """
    end = start + seq_len
    if window_left < 0:
        return _triangle(end) - _triangle(start)
    knee = min(max(start, window_left), end)
    return _triangle(knee) - _triangle(start) + (end - knee) * (window_left + 1)


@dataclass(frozen=True)
class Workload:
    name: str
    seq_lens: tuple[int, ...]
    start_positions: tuple[int, ...]
    window_left: int = WINDOW_LEFT
    page_size: int = PAGE_SIZE

    @property
    def kv_lens(self) -> tuple[int, ...]:
        return tuple(s + n for s, n in zip(self.start_positions, self.seq_lens))

    def visible_pairs(self) -> int:
        """Visible (query, key) pairs per head, summed over the batch (O(batch))."""
        return sum(
            visible_pairs_of_request(s, n, self.window_left) for s, n in zip(self.start_positions, self.seq_lens)
        )

    def useful_flops(self) -> int:
        return 4 * HEAD_DIM * HQ * self.visible_pairs()


WORKLOADS = {
    w.name: w
    for w in (
        Workload("prefill_1x8192", (8192,), (0,)),
        Workload("prefill_8x2048", (2048,) * 8, (0,) * 8),
        Workload("chunk_2048_on_6144", (2048,), (6144,)),
        Workload("decode_64x4096", (1,) * 64, (4096,) * 64),
        # serving-shaped: a decode step of a big batch, a burst of short prompts, a late chunk of a long prompt
        Workload("decode_256x2000_p32", (1,) * 256, (1999,) * 256, page_size=32),
        Workload("prompts_32x128", (128,) * 32, (0,) * 32),
        Workload("chunk_512_on_30000", (512,), (30000,)),
    )
}


SWEEP_SYSTEMS = ("pagedwindow", "flashinfer_fa2", "flashinfer_fa3")
"""Sweep points time the paged kernels only (flex recompiles per shape; SDPA's dense mask grows as kv²)."""


def sweep_workload(point: SweepPoint) -> Workload:
    """The workload of one sweep point: ``point.batch`` identical requests."""
    return Workload(
        point.name,
        (point.new_tokens,) * point.batch,
        (point.cached,) * point.batch,
        point.window_left,
        point.page_size,
    )


def workload_named(name: str) -> Workload | None:
    """The workload called ``name``: one of ``WORKLOADS``, else a sweep point's (:func:`bench_sweep.point_named`:
    the sweep's names, or a point off its grids named as its points are); None for any other name."""
    if name in WORKLOADS:
        return WORKLOADS[name]
    point = point_named(name)
    return None if point is None else sweep_workload(point)


def sweep_workloads(slices: list[SweepSlice]) -> list[Workload]:
    """Every point of ``slices`` (:func:`bench_sweep.sweep_slices`) as a workload, slice by slice."""
    return [sweep_workload(p) for s in slices for p in s.points]


def gpu_slug(name: str) -> str:
    """A file-name slug of a GPU's name: lower-case, the vendor dropped, other characters to '-'.

    ``"NVIDIA H200"`` -> ``"h200"``; ``"NVIDIA H100 80GB HBM3"`` -> ``"h100-80gb-hbm3"``.
    """
    words = name.lower().split()
    if len(words) > 1 and words[0] in ("nvidia", "amd", "intel"):
        words = words[1:]
    return re.sub(r"[^a-z0-9]+", "-", " ".join(words)).strip("-") or "gpu"


def result_stem(gpu: str, date: str, label: str | None = None) -> str:
    """``<gpu-slug>-<date>[-label]``: the name of a run's JSON, table and plots."""
    return f"{gpu_slug(gpu)}-{date}" + (f"-{label}" if label else "")


class Csr(NamedTuple):
    """A batch's page table in FlashInfer's CSR layout: CPU int32 tensors."""

    qo_indptr: torch.Tensor  # [batch + 1]: request i's query rows are qo_indptr[i] .. qo_indptr[i + 1]
    kv_indptr: torch.Tensor  # [batch + 1]: request i's pages are kv_indices[kv_indptr[i] .. kv_indptr[i + 1]]
    kv_indices: torch.Tensor  # [total_pages]
    last_page_len: torch.Tensor  # [batch]: kv_len = (pages - 1) * page_size + last_page_len


def paged_csr(w: Workload, order: list[int]) -> Csr:
    """``w``'s requests with their pages taken in turn from ``order`` (a request's whole KV is paged)."""
    return Csr(*pages_in_turn(w.kv_lens, w.page_size, order).csr(w.seq_lens))


def plan_kwargs(w: Workload, cta_tile_q=None) -> dict:
    """The keyword arguments of ``PrefillPagedPlan.from_csr`` / ``update_csr`` for ``w`` (minus ``device``)."""
    return {
        "num_qo_heads": HQ,
        "num_kv_heads": HKV,
        "head_dim": HEAD_DIM,
        "page_size": w.page_size,
        "cta_tile_q": cta_tile_q,
    }


@dataclass
class Inputs:
    """One input set: a pool with shuffled pages holding each request's whole KV, its CSR, the plan, q, out."""

    layout: pw.PagedKvLayout
    pool: torch.Tensor  # [num_pages, 1, 2, page_size, HKV, HEAD_DIM]
    csr: Csr
    plan: pw.PrefillPagedPlan
    q: torch.Tensor  # [total_tokens, HQ, HEAD_DIM]
    out: torch.Tensor  # [total_tokens, HQ, HEAD_DIM]
    cta_tile_q: int | None = None  # the tile override the plan was built with (None: the plan's own choice)


class PlanInputs(Protocol):
    """What :func:`plan_times` reads of an input set: an :class:`Inputs` or the prep bench's ``PrepInputs``."""

    @property
    def q(self) -> torch.Tensor: ...  # [total_tokens, HQ, HEAD_DIM]: its device is the plans'
    @property
    def csr(self) -> Csr: ...
    @property
    def cta_tile_q(self) -> int | None: ...


def make_inputs(w: Workload, gen: torch.Generator, device, cta_tile_q=None) -> Inputs:
    """A seeded input set for ``w``: pages shuffled by ``gen`` (``pagedwindow.testing.random_pages``), pool and q
    filled on ``device`` from a generator ``gen`` seeds (a float64 batch on the host would not fit the large
    workloads)."""
    device = torch.device(device)
    table = random_pages(gen, w.kv_lens, w.page_size, spare_pages=8)  # every request's pages and 8 spare
    csr = Csr(*table.csr(w.seq_lens))
    fill = torch.Generator(device).manual_seed(int(torch.randint(2**62, (), generator=gen)))
    layout = pw.PagedKvLayout(1, HKV, HEAD_DIM, w.page_size)
    pool = layout.allocate(table.num_pages, torch.bfloat16, device)  # [num_pages, 1, 2, page_size, HKV, HEAD_DIM]
    pool.normal_(generator=fill)
    plan = pw.PrefillPagedPlan.from_csr(*csr, **plan_kwargs(w, cta_tile_q), device=device)
    q = torch.randn(
        sum(w.seq_lens), HQ, HEAD_DIM, generator=fill, device=device, dtype=torch.bfloat16
    )  # [total_tokens, HQ, HEAD_DIM]
    return Inputs(layout, pool, csr, plan, q, torch.empty_like(q), cta_tile_q)


def dense_kv(inp: Inputs, request: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ``request``'s K and V gathered from the pool: ``[kv_len, HKV, HEAD_DIM]`` each."""
    lo, hi = int(inp.csr.kv_indptr[request]), int(inp.csr.kv_indptr[request + 1])
    kv_len = (hi - lo - 1) * inp.layout.page_size + int(inp.csr.last_page_len[request])
    pages = inp.csr.kv_indices[lo:hi].to(inp.pool.device)  # [pages]
    k = inp.pool[pages, 0, 0].reshape(-1, HKV, HEAD_DIM)[:kv_len]  # [kv_len, HKV, HEAD_DIM]
    v = inp.pool[pages, 0, 1].reshape(-1, HKV, HEAD_DIM)[:kv_len]
    return k, v


# -- systems: each returns a zero-argument callable that writes its output, and that output ---------------------


def system_pagedwindow(w: Workload, inp: Inputs):
    def call():
        pw.batch_prefill_paged_window(
            inp.q,
            inp.pool,
            inp.layout,
            0,
            inp.plan,
            sm_scale=SM_SCALE,
            window_left=w.window_left,
            out=inp.out,
            backend="cuda",
        )

    return call, lambda: inp.out


def _flashinfer_wrapper(backend: str, device):
    import flashinfer

    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)


def _flashinfer_plan(wrapper, csr: Csr, w: Workload) -> None:
    wrapper.plan(
        *csr,
        HQ,
        HKV,
        HEAD_DIM,
        w.page_size,
        causal=True,
        window_left=w.window_left,
        sm_scale=SM_SCALE,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
    )


def _flashinfer(backend: str):
    def make(w: Workload, inp: Inputs):
        wrapper = _flashinfer_wrapper(backend, inp.q.device)
        k_cache = inp.pool[:, 0, 0].contiguous()  # [num_pages, page_size, HKV, HEAD_DIM]
        v_cache = inp.pool[:, 0, 1].contiguous()
        _flashinfer_plan(wrapper, Csr(*(t.to(inp.q.device) for t in inp.csr)), w)
        out = torch.empty_like(inp.q)  # [total_tokens, HQ, HEAD_DIM]

        def call():
            wrapper.run(inp.q, (k_cache, v_cache), out=out)

        return call, lambda: out

    return make


def system_flex(w: Workload, inp: Inputs):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    qo = inp.csr.qo_indptr.tolist()
    calls = []
    outs: list[torch.Tensor] = []  # [B, HQ, seq, D] each
    for r, (start, seq) in enumerate(zip(w.start_positions, w.seq_lens)):
        k, v = dense_kv(inp, r)
        kv_len = start + seq
        qr = inp.q[qo[r] : qo[r + 1]].transpose(0, 1)[None]  # [1, HQ, seq, D]
        kr, vr = k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous()  # [1, HKV, kv, D]
        offset, wl = kv_len - seq, w.window_left

        def mask_mod(b, h, q_idx, kv_idx, offset=offset, wl=wl):
            return key_visible(q_idx + offset, kv_idx, wl)

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

    return call, lambda: torch.cat(
        [o[0].transpose(0, 1) if o.shape[0] == 1 else o.transpose(1, 2).reshape(-1, HQ, HEAD_DIM) for o in outs]
    )


def system_sdpa(w: Workload, inp: Inputs):
    import torch.nn.functional as F

    qo = inp.csr.qo_indptr.tolist()
    groups: dict[tuple[int, int], list[int]] = {}
    for r, key in enumerate(zip(w.start_positions, w.seq_lens)):
        groups.setdefault(key, []).append(r)
    batches = []
    for (start, seq), reqs in groups.items():
        kv_len = start + seq
        q = torch.stack([inp.q[qo[r] : qo[r + 1]].transpose(0, 1) for r in reqs])  # [B, HQ, seq, D]
        kvs = [dense_kv(inp, r) for r in reqs]
        k = torch.stack([x[0].transpose(0, 1) for x in kvs]).contiguous()  # [B, HKV, kv, D]
        v = torch.stack([x[1].transpose(0, 1) for x in kvs]).contiguous()
        q_pos = torch.arange(start, kv_len, device=q.device)[:, None]
        k_pos = torch.arange(kv_len, device=q.device)[None, :]
        mask = key_visible(q_pos, k_pos, w.window_left)  # [seq, kv_len]
        batches.append((reqs, q, k, v, mask))
    outs: list[tuple[list[int], torch.Tensor]] = []  # (requests, [B, HQ, seq, D])

    def call():
        outs.clear()
        for reqs, q, k, v, mask in batches:
            outs.append(
                (reqs, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SM_SCALE, enable_gqa=True))
            )

    def output():
        result = torch.empty_like(inp.q)
        for reqs, o in outs:
            for i, r in enumerate(reqs):
                result[qo[r] : qo[r + 1]] = o[i].transpose(0, 1)
        return result

    return call, output


MAKERS = {
    "pagedwindow": system_pagedwindow,
    "flashinfer_fa2": _flashinfer("fa2"),
    "flashinfer_fa3": _flashinfer("fa3"),
    "flex": system_flex,
    "sdpa": system_sdpa,
}


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


def e2e_ms(calls: list, iters: int, loops: int, synchronize=torch.cuda.synchronize) -> float:
    """Wall-clock ms per call of ``iters`` back-to-back calls (``calls`` in rotation), the host not queued ahead:
    synchronize, time the loop, synchronize. The median over ``loops`` such loops (after one warm-up round)."""
    for c in calls:
        c()
    per_call = []
    for _ in range(loops):
        synchronize()
        t0 = time.perf_counter()
        for i in range(iters):
            calls[i % len(calls)]()
        synchronize()
        per_call.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(per_call)


def shuffled_rounds(names, rounds: int):
    """``rounds`` orders of ``names``, each a new seeded random permutation: interleaved timings run one round in
    each. A system timed right after another pays for the caches that one left; a fixed order would charge that to
    the same system every round."""
    order, shuffle = list(names), random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        yield order


def interleaved_e2e_ms(
    calls: dict[str, list], iters: int, rounds: int, synchronize=torch.cuda.synchronize
) -> dict[str, float]:
    """:func:`e2e_ms` of each system (name -> its calls), the systems taking turns loop by loop for ``rounds``
    rounds, each round in a new order (:func:`shuffled_rounds`; host drift hits all alike); per system, the
    median over its loops."""
    per_call: dict[str, list[float]] = {name: [] for name in calls}
    for order in shuffled_rounds(calls, rounds):
        for name in order:
            per_call[name].append(e2e_ms(calls[name], iters, 1, synchronize))
    return {name: statistics.median(times) for name, times in per_call.items()}


def _call_ms(fn, synchronize) -> float:
    """Host wall-clock ms of one ``fn()``, the device idle before it."""
    synchronize()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def host_ms(fn, reps: int, synchronize=torch.cuda.synchronize) -> float:
    """Median host wall-clock ms of ``fn()`` (after a warm-up), the device idle before each call."""
    fn()
    times = [_call_ms(fn, synchronize) for _ in range(reps)]
    synchronize()
    return statistics.median(times)


def interleaved_host_ms(fns: dict, reps: int = 40, synchronize=torch.cuda.synchronize) -> dict[str, float]:
    """:func:`host_ms` of each of ``fns`` (name -> callable), the callables interleaved call by call for ``reps``
    rounds, each round in a new order (:func:`shuffled_rounds`)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for order in shuffled_rounds(fns, reps):
        for name in order:
            times[name].append(_call_ms(fns[name], synchronize))
    synchronize()
    return {name: statistics.median(t) for name, t in times.items()}


NO_PLAN = {
    "plan_ms": None,
    "update_plan_ms": None,
    "plan_inputs": None,
    "plan_status": "not applicable: no plan step (masks are built once, outside the timed call)",
}


def plan_times(system: str, w: Workload, inp: PlanInputs, reps: int) -> dict:
    """Host time of planning ``inp``'s batch from its CSR as each system's user does it: record fields.

    pagedwindow: ``PrefillPagedPlan.from_csr`` (a new plan) and ``update_csr`` (in place) of the int32 CSR as CUDA
    tensors (``plan_ms``, ``update_plan_ms``: the page ids checked on the GPU) and as CPU tensors (``*_host_csr``).
    FlashInfer: ``wrapper.plan`` on a warm wrapper with every array a CUDA tensor (its documentation's form;
    ``plan_ms``), and with the indptrs and last_page_len on the host (vLLM's form; ``plan_ms_host_indptr``; the
    page ids stay on the GPU in both). It has no separate update: a serving loop calls ``wrapper.plan`` every step.
    """
    if system != "pagedwindow" and system not in FLASHINFER_SYSTEMS:
        return dict(NO_PLAN)
    device = inp.q.device
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    on_device = Csr(*(t.to(device) for t in inp.csr))  # both systems' plan_ms: the CSR as device tensors
    if system == "pagedwindow":
        kwargs = plan_kwargs(w, inp.cta_tile_q)
        plan = pw.PrefillPagedPlan.from_csr(*on_device, **kwargs, device=device)
        host_plan = pw.PrefillPagedPlan.from_csr(*inp.csr, **kwargs, device=device)
        return {
            "plan_ms": host_ms(lambda: pw.PrefillPagedPlan.from_csr(*on_device, **kwargs, device=device), reps, sync),
            "update_plan_ms": host_ms(lambda: plan.update_csr(*on_device, **kwargs), reps, sync),
            "plan_ms_host_csr": host_ms(
                lambda: pw.PrefillPagedPlan.from_csr(*inp.csr, **kwargs, device=device), reps, sync
            ),
            "update_plan_ms_host_csr": host_ms(lambda: host_plan.update_csr(*inp.csr, **kwargs), reps, sync),
            "plan_inputs": dict.fromkeys(Csr._fields, device.type),
            "plan_status": f"from_csr (new plan) / update_csr (in place) of the {device.type} int32 CSR; "
            "*_host_csr: of the CPU int32 CSR",
        }
    wrapper = _flashinfer_wrapper(system.removeprefix("flashinfer_"), device)
    host_indptr = inp.csr._replace(kv_indices=on_device.kv_indices)
    return {
        "plan_ms": host_ms(lambda: _flashinfer_plan(wrapper, on_device, w), reps, sync),
        "update_plan_ms": None,
        "plan_ms_host_indptr": host_ms(lambda: _flashinfer_plan(wrapper, host_indptr, w), reps, sync),
        "plan_inputs": dict.fromkeys(Csr._fields, "cuda"),
        "plan_status": "wrapper.plan on a warm wrapper (FlashInfer re-plans this way every step)",
    }


def gemm_tflops(device) -> float:
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = median_ms([lambda: a @ b], 20)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def reference_output(w: Workload, inp: Inputs) -> torch.Tensor:
    return pw.batch_prefill_paged_window(
        inp.q, inp.pool, inp.layout, 0, inp.plan, sm_scale=SM_SCALE, window_left=w.window_left, backend="reference"
    ).float()


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


def new_record(system: str, workload: str) -> dict:
    """A record before measurement: every time ``None`` (not measured / not applicable), status ``ok``."""
    return {
        "system": system,
        "workload": workload,
        "e2e_ms": None,
        "ms": None,
        "plan_ms": None,
        "update_plan_ms": None,
        "useful_tflops": None,
        "max_abs_err": None,
        "err_bound": None,
        "status": "ok",
        "plan_inputs": None,
        "plan_status": None,
    }


def _time_system(
    record: dict, system: str, w: Workload, input_sets: list, want: torch.Tensor, reps: int, loops: int
) -> None:
    """Check ``system``'s output, then fill ``record`` with its kernel, end-to-end and plan times."""
    made = [MAKERS[system](w, inp) for inp in input_sets]
    made[0][0]()
    torch.cuda.synchronize()
    err = (made[0][1]().float() - want).abs().max().item()
    bound = OUTPUT_TOLERANCE * want.abs().max().item()
    record.update(max_abs_err=err, err_bound=bound)
    if not err <= bound:
        record["status"] = f"wrong output (max abs err {err:.3e} > {bound:.3e})"
        return
    calls = [m[0] for m in made]
    ms = median_ms(calls, reps)
    record.update(ms=ms, useful_tflops=w.useful_flops() / (ms * 1e-3) / 1e12)
    record["e2e_ms"] = e2e_ms(calls, reps, loops)
    if system == "pagedwindow":
        record["cta_tile_q"] = input_sets[0].plan.cta_tile_q
    record.update(plan_times(system, w, input_sets[0], max(5, reps // 2)))


def named_twice(*name_lists) -> list[str]:
    """The names any of ``name_lists`` (None: empty) holds more than once, sorted."""
    return sorted({n for names in name_lists for n in names or () if list(names).count(n) > 1})


def run_bench(
    out="benchmarks/results",
    workloads=None,
    systems=None,
    sweep=False,
    quick=False,
    cta_tile_q=None,
    label=None,
    decode_sweep=False,
) -> int:
    """Measure, print a table, write ``<gpu-slug>-<date>[-label].json`` / ``.md`` into ``out``; an exit code.

    ``sweep`` adds every sweep point (:mod:`pagedwindow.bench_sweep`), ``decode_sweep`` the decode slices' (with
    no ``workloads`` named, a sweep runs alone); the result then holds ``"sweep"``, each point's speed-up over
    FlashInfer's best, drawn as heat maps into ``<stem>-sweep.png``.

    ``cta_tile_q`` overrides the plans' tile (all systems see the same batch; only pagedwindow reads the tile).
    """
    named = [(n, workload_named(n)) for n in workloads or ()]
    found = [w for _, w in named if w is not None]  # all of them once `unknown` is empty
    unknown = [n for n, w in named if w is None] + [s for s in systems or () if s not in MAKERS]
    if unknown:
        print(
            f"pagedwindow bench: unknown workload or system {unknown}; workloads {list(WORKLOADS)} or a sweep "
            f"point's name ({', '.join(POINT_NAME_FORMS)}), systems {list(MAKERS)}"
        )
        return 2
    twice = named_twice([w.name for w in found], systems)
    if twice:
        print(f"pagedwindow bench: {twice} named more than once (each is timed once)")
        return 2
    if not torch.cuda.is_available():
        print("pagedwindow bench needs a CUDA GPU; none is available.")
        return 2
    device = torch.device("cuda")
    chosen = found if workloads else [] if sweep or decode_sweep else list(WORKLOADS.values())
    slices = sweep_slices(decode_only=not sweep) if sweep or decode_sweep else []
    chosen += sweep_workloads(slices)
    systems = list(systems or SYSTEMS)
    reps, sets, loops = (10, 2, 3) if quick else (50, 3, 5)
    peak = gemm_tflops(device)
    records, allocations = [], {}
    for w in chosen:
        gen = torch.Generator().manual_seed(0)
        input_sets = [make_inputs(w, gen, device, cta_tile_q) for _ in range(sets)]
        want = reference_output(w, input_sets[0])
        for system in systems:
            record = new_record(system, w.name)
            if w.name not in WORKLOADS and system not in SWEEP_SYSTEMS:
                record["status"] = "not run at sweep points"
            else:
                try:
                    _time_system(record, system, w, input_sets, want, reps, loops)
                except ImportError as exc:
                    record["status"] = f"missing: {exc}"
                except Exception as exc:  # a peer that fails is reported, not dropped
                    record["status"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    traceback.print_exc()
            records.append(record)
            print(
                f"{w.name:>22} {system:>15}  e2e {_num(record['e2e_ms'], '9.4f')}  kernel "
                f"{_num(record['ms'], '9.4f')}  plan {_num(record['plan_ms'], '8.4f')} ms  {record['status']}",
                flush=True,
            )
        if "pagedwindow" in systems:
            allocations[w.name] = allocations_per_call(w, input_sets[0])
        del input_sets
        torch.cuda.empty_cache()
    from .cuda import build, ops

    kernel = ops.prefill_entry(build.target_for_capability(*torch.cuda.get_device_capability(device)))
    result = {
        "gpu": torch.cuda.get_device_name(device),
        "date": datetime.date.today().isoformat(),
        "prefill_kernel": kernel,
        "torch": torch.__version__,
        "peak_bf16_tflops": peak,
        "tile_override": cta_tile_q,
        "label": label,
        "allocations_per_10_calls": allocations,
        "records": records,
    }
    if slices:
        result["sweep"] = sweep_summary(records, slices)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = result_stem(result["gpu"], result["date"], label)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    table = markdown_table(result)
    (out / f"{stem}.md").write_text(table)
    write_plots(out / f"{stem}.json")
    print(table)
    print(f"wrote {out / stem}.json / .md")
    return 0


def merge_results(paths, out, label: str) -> Path:
    """One result from bench runs made on one GPU that timed different systems of the same workloads (a peer timed
    in a later call, say): their records together, a workload's records in the order of ``paths``, and the sweep
    summary recomputed over all of them. Refuses runs from other GPUs or with one (workload, system) twice. Writes
    ``<gpu>-<date of the first>-<label>.json`` / ``.md`` and the plots into ``out``; returns the JSON's path."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    first = runs[0]
    if any(r["gpu"] != first["gpu"] for r in runs):
        raise ValueError(f"runs from different GPUs: {sorted({r['gpu'] for r in runs})}")
    seen: set[tuple[str, str]] = set()
    for r in runs:
        for rec in r["records"]:
            key = (rec["workload"], rec["system"])
            if key in seen:
                raise ValueError(f"{key} is timed in more than one run")
            seen.add(key)
    order = list(dict.fromkeys(rec["workload"] for r in runs for rec in r["records"]))
    records = [rec for w in order for r in runs for rec in r["records"] if rec["workload"] == w]
    result = dict(first, label=label, records=records, merged_from=[Path(p).name for p in paths])
    result["allocations_per_10_calls"] = {k: v for r in runs for k, v in r.get("allocations_per_10_calls", {}).items()}
    if any("sweep" in r for r in runs):
        result["sweep"] = sweep_summary(records, sweep_slices())  # the points the runs timed
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result_stem(result['gpu'], result['date'], label)}.json"
    path.write_text(json.dumps(result, indent=1))
    path.with_suffix(".md").write_text(markdown_table(result))
    write_plots(path)
    return path


def write_plots(path: Path) -> None:
    """Throughput and speed-up PNGs beside the results JSON, and the sweep's heat maps when it holds a sweep."""
    import matplotlib

    matplotlib.use("Agg")
    from .measure.bench_results import load_results
    from .viz.bench_plots import plot_speedup, plot_sweep, plot_throughput

    results = load_results(path)
    for name, plot in (("throughput", plot_throughput), ("speedup", plot_speedup)):
        plot(results).savefig(path.with_name(f"{path.stem}-{name}.png"), dpi=120)
    sweep = json.loads(path.read_text()).get("sweep")
    if sweep:
        plot_sweep(sweep).savefig(path.with_name(f"{path.stem}-sweep.png"), dpi=120)


def _num(value, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def _listed(records: list[dict], field: str, title: str, text) -> list[str]:
    """A paragraph ``title`` + ``text(record)`` for each record whose ``field`` is set (only pagedwindow's records
    carry ``cta_tile_q`` and ``plan_ms_host_csr``, only FlashInfer's ``plan_ms_host_indptr``); nothing if none is."""
    items = [text(r) for r in records if r.get(field) is not None]
    return ["", title + ", ".join(items)] if items else []


def markdown_table(result: dict) -> str:
    """Workloads × systems: the three times, useful TF/s, % of the bf16 GEMM rate, each time over FlashInfer's best
    (the faster of fa2 / fa3 on that workload: < 1 is faster than FlashInfer), the output error."""
    timed = result["records"]
    ratios = flashinfer_ratios(timed)
    peak = result["peak_bf16_tflops"]
    override = result.get("tile_override", result.get("cta_tile_q"))  # older files: top-level cta_tile_q
    lines = [
        f"GPU: {result['gpu']}; bf16 GEMM {peak:.0f} TF/s measured in the same run; plan tile "
        + (f"forced to {override}" if override else "the plan's own choice"),
        "",
        "| workload | system | e2e ms | kernel ms | plan ms | update ms | useful TF/s | % GEMM | "
        "e2e / FI best | kernel / FI best | max abs err |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in timed:
        if r.get("ms") is None and r.get("e2e_ms") is None:
            lines.append(f"| {r['workload']} | {r['system']} |" + " — |" * 8 + f" {r.get('status', 'missing')} |")
            continue
        tflops = r.get("useful_tflops")
        e2e_ratio, ms_ratio = ratios.get((r["workload"], r["system"]), (None, None))
        lines.append(
            f"| {r['workload']} | {r['system']} | {_num(r.get('e2e_ms'), '.4f')} | "
            f"{_num(r.get('ms'), '.4f')} | {_num(r.get('plan_ms'), '.4f')} | "
            f"{_num(r.get('update_plan_ms'), '.4f')} | {_num(tflops, '.1f')} | "
            f"{_num(None if tflops is None else 100 * tflops / peak, '.1f')} | "
            f"{_num(e2e_ratio, '.2f', '×')} | {_num(ms_ratio, '.2f', '×')} | "
            f"{_num(r.get('max_abs_err'), '.2e')} |"
        )
    lines += [
        "",
        "e2e: back-to-back API calls, wall clock, host not queued ahead; kernel: CUDA events, host queued "
        "ahead; plan: host time of planning from the CSR page table (pagedwindow `from_csr`, FlashInfer "
        "`wrapper.plan`, both given CUDA-tensor arrays); update: pagedwindow's in-place `update_csr` (FlashInfer "
        "re-plans with `wrapper.plan`: its plan ms).",
    ]
    lines += _listed(
        timed,
        "plan_ms_host_indptr",
        "FlashInfer plan ms with the indptrs and last_page_len on the host (vLLM's form): ",
        lambda r: f"{r['workload']} {r['system'].removeprefix('flashinfer_')} {r['plan_ms_host_indptr']:.4f}",
    )
    lines += _listed(
        timed,
        "plan_ms_host_csr",
        "pagedwindow plan / update ms from the CSR on the host (CPU tensors): ",
        lambda r: f"{r['workload']} {r['plan_ms_host_csr']:.4f} / {_num(r.get('update_plan_ms_host_csr'), '.4f')}",
    )
    lines += _listed(
        timed, "cta_tile_q", "pagedwindow's plan tile (cta_tile_q): ", lambda r: f"{r['workload']} {r['cta_tile_q']}"
    )
    sweep = result.get("sweep") or []
    if sweep:
        timed_points = [r for r in sweep if r["speedup"] is not None]
        slower = slower_points(sweep)
        lines += [
            "",
            f"Sweep: {len(sweep)} points in {len({r['slice'] for r in sweep})} slices, {len(timed_points)} timed "
            f"beside FlashInfer; pagedwindow slower than FlashInfer's best (kernel time) at {len(slower)}"
            + (":" if slower else "."),
        ]
        lines += [
            f"- {r['workload']}: {r['speedup']:.2f}× ({r['pagedwindow_ms']:.4f} ms against "
            f"{r['flashinfer_best'].removeprefix('flashinfer_')} {r['flashinfer_best_ms']:.4f} ms)"
            for r in slower
        ]
    allocations = result.get("allocations_per_10_calls") or {}
    if allocations:
        lines += [
            "",
            "Allocations made by 10 pagedwindow calls with `out` given (the contract: 0): "
            + ", ".join(f"{w} {n}" for w, n in allocations.items()),
        ]
    return "\n".join(lines) + "\n"
