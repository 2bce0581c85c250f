"""``pagedwindow bench --prep``: Gemma's prep before a local layer's attention (q/k/v RMSNorm, rotate-half RoPE,
the paged K/V write), fused in ``prepare_paged_qkv`` and as the unfused sequences a user would write.

Systems (``pagedwindow.measure.bench_results.PREP_SYSTEMS``), each given the projections before the norms
(``q [T, 16, 256]``, ``k, v [T, 8, 256]`` bf16, request order) and writing the normed, rotated q and the pool's
new K/V slots:

- ``pagedwindow``: one ``prepare_paged_qkv`` call (one launch).
- ``hf_torch_append``: Hugging Face's Gemma 4 torch ops (``Gemma4RMSNorm``: fp32 norm, ``* w.float()``, back to
  bf16; ``Gemma4TextRotaryEmbedding``: cos/sin from ``inv_freq`` and the positions, cast to bf16;
  ``apply_rotary_pos_emb``: ``x * cos + rotate_half(x) * sin`` in bf16), then ``pagedwindow.append_paged_kv``.
  cos/sin are computed in every call (HF computes them once per forward for all layers): the record's
  ``part_ms["cos_sin"]`` is that part alone, for a reader who amortises it. The positions tensor is an input
  (HF builds it once per step), not timed.
- ``flashinfer``: ``flashinfer.norm.rmsnorm`` on q, k and v flattened to ``[T * H, 256]`` (v's unweighted norm
  with a ones weight), ``flashinfer.rope.apply_rope_pos_ids_inplace`` (``interleave=False``, theta 10000) on
  the normed q and k, ``flashinfer.page.append_paged_kv_cache`` into the pool's strided layer views
  (``pool[:, layer, 0]``, ``pool[:, layer, 1]``; FlashInfer reads the caches' strides). Five launches into
  buffers allocated once; its "plan" is ``get_seq_lens`` + ``get_batch_indices_positions`` (batch indices and
  positions for the append; the positions are RoPE's ``pos_ids`` too).

Every system's q_out and the pool's whole layer (the new slots, and no stray write elsewhere) are checked against
``prepare_paged_qkv(backend="reference")`` (fp32 math, one rounding) before timing: per part (q, K, V),
``max |got - ref| <= PREP_TOLERANCE * max |ref|`` over that part's new rows. The three times are the attention
bench's (``pagedwindow.bench``): ``e2e_ms`` back-to-back calls (the systems take turns loop by loop, each round in
a new order; the median of each one's loops), ``ms`` CUDA-event kernel time with the host queued ahead,
``plan_ms`` host planning. Bandwidth counts the minimum traffic (:func:`prep_bytes`); the HBM bandwidth is a
large device-to-device copy measured in the same run. Results: ``<gpu>-<date>-prep[-label].json`` / ``.md`` /
``-bandwidth.png``.
"""

from __future__ import annotations

import datetime
import json
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import pagedwindow as pw

from .bench import (
    HEAD_DIM,
    HKV,
    HQ,
    NO_PLAN,
    Csr,
    Workload,
    _num,
    host_ms,
    interleaved_e2e_ms,
    median_ms,
    named_twice,
    plan_kwargs,
    plan_times,
)
from .bench import result_stem as _result_stem
from .gemma_prep import rope_inv_freq
from .measure.bench_results import PREP_LABEL, PREP_SYSTEMS, copy_gbs, gbs, prep_bars, prep_ratios
from .testing import random_pages

EPS, ROPE_THETA, NORM_STYLE = 1e-6, 10000.0, "gemma4"
"""Gemma 4's ``rms_norm_eps`` and its sliding layers' RoPE base; the norm style with the unweighted v norm."""
PREP_TOLERANCE = 2e-2
"""A part (q, K or V) passes when max |got - ref| <= PREP_TOLERANCE * max |ref| over its new rows. The fused op
rounds once; the unfused sequences round to bf16 between steps (HF after the norm, cos/sin, each product and the
sum: 0.94e-2 measured on the CPU for 2048 rows at positions 6144+; FlashInfer after the norm, with its angles
from ``__powf`` / ``__sincosf``), so the attention bench's 1e-2 would reject HF's own arithmetic."""
HBM_COPY_BYTES = 1 << 30
"""The copy that measures HBM bandwidth: 1 GiB read and 1 GiB written."""
BF16_BYTES = 2


def prep_bytes(tokens: int, hq: int = HQ, hkv: int = HKV, head_dim: int = HEAD_DIM, elem: int = BF16_BYTES) -> int:
    """The prep's minimum HBM traffic: q, k, v read and q_out, K, V written (``2 * T * (hq + 2 hkv) * D`` elements)
    plus the two norm weights read. The page table and positions (a few bytes a token) are not counted."""
    return 2 * tokens * (hq + 2 * hkv) * head_dim * elem + 2 * head_dim * elem


@dataclass(frozen=True)
class PrepWorkload(Workload):
    """A prep workload: ``seq_lens[i]`` new tokens of request ``i`` after ``start_positions[i]`` cached ones (the
    window is not used)."""

    @property
    def tokens(self) -> int:
        return sum(self.seq_lens)

    def bytes_moved(self) -> int:
        return prep_bytes(self.tokens)


PREP_WORKLOADS = {
    w.name: w
    for w in (
        # 8192 new tokens as a chunked prefill: 4 requests x 2048 on 6144 cached each (positions up to 8191)
        PrepWorkload("prep_8192", (2048,) * 4, (6144,) * 4),
        # mid: one 512-token chunk of a long prompt (launch overhead shows; RoPE angles up to 30511)
        PrepWorkload("prep_512_on_30000", (512,), (30000,)),
        # a decode step: 64 requests x 1 new token on 4096 cached each
        PrepWorkload("prep_decode_64x1", (1,) * 64, (4096,) * 64),
    )
}


@dataclass
class PrepInputs:
    """One input set: a pool with shuffled pages holding each request's whole KV, its CSR, the plan, the
    projections before the norms, the norm weights (bf16, as HF stores them) and ``out_q``."""

    layout: pw.PagedKvLayout
    pool: torch.Tensor  # [num_pages, 1, 2, page_size, HKV, HEAD_DIM]
    csr: Csr
    plan: pw.PrefillPagedPlan
    q: torch.Tensor  # [T, HQ, HEAD_DIM]
    k: torch.Tensor  # [T, HKV, HEAD_DIM]
    v: torch.Tensor  # [T, HKV, HEAD_DIM]
    q_norm_weight: torch.Tensor  # [HEAD_DIM]
    k_norm_weight: torch.Tensor  # [HEAD_DIM]
    out_q: torch.Tensor  # [T, HQ, HEAD_DIM]
    cta_tile_q: int | None = None  # read by pagedwindow.bench.plan_times (the prep does not use a tile)


def make_prep_inputs(w: PrepWorkload, gen: torch.Generator, device) -> PrepInputs:
    """A seeded input set for ``w``: pages shuffled by ``gen``, everything else filled on ``device`` from a
    generator ``gen`` seeds. Each projection row has its own scale in [0.5, 4) (so a missing norm shows)."""
    device = torch.device(device)
    table = random_pages(gen, w.kv_lens, w.page_size, spare_pages=8)
    csr = Csr(*table.csr(w.seq_lens))
    fill = torch.Generator(device).manual_seed(int(torch.randint(2**62, (), generator=gen)))
    layout = pw.PagedKvLayout(1, HKV, HEAD_DIM, w.page_size)
    pool = layout.allocate(table.num_pages, torch.bfloat16, device)  # [num_pages, 1, 2, page_size, HKV, HEAD_DIM]
    pool.normal_(generator=fill)
    plan = pw.PrefillPagedPlan.from_csr(*csr, **plan_kwargs(w), device=device)

    def projection(heads: int) -> torch.Tensor:
        x = torch.randn(w.tokens, heads, HEAD_DIM, generator=fill, device=device)  # [T, heads, D] fp32
        scale = 0.5 + 3.5 * torch.rand(w.tokens, heads, 1, generator=fill, device=device)
        return (x * scale).to(torch.bfloat16)

    q, k, v = projection(HQ), projection(HKV), projection(HKV)

    def weight() -> torch.Tensor:
        return (0.5 + torch.rand(HEAD_DIM, generator=fill, device=device)).to(torch.bfloat16)  # [D]

    q_norm_weight, k_norm_weight = weight(), weight()
    return PrepInputs(layout, pool, csr, plan, q, k, v, q_norm_weight, k_norm_weight, torch.empty_like(q))


def written_slots(csr: Csr, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page id, slot) of every new row in request order (CPU long ``[T]`` each): row ``j`` of request ``i`` is
    KV position ``kv_len_i - seq_i + j``."""
    qo, kvp, last = csr.qo_indptr.tolist(), csr.kv_indptr.tolist(), csr.last_page_len.tolist()
    indices = csr.kv_indices.long()
    pages, slots = [], []
    for i in range(len(last)):
        kv_len = (kvp[i + 1] - kvp[i] - 1) * page_size + last[i]
        pos = torch.arange(kv_len - (qo[i + 1] - qo[i]), kv_len)
        pages.append(indices[kvp[i] + pos // page_size])
        slots.append(pos % page_size)
    return torch.cat(pages), torch.cat(slots)


def layer_caches(pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's K and V of a pool as strided views ``[num_pages, page_size, HKV, HEAD_DIM]``."""
    return pool[:, 0, 0], pool[:, 0, 1]


@dataclass
class PrepExpected:
    """The reference's outputs on a copy of an input set's pool: q_out, the layer's K and V caches, and where the
    new rows landed."""

    q: torch.Tensor  # [T, HQ, HEAD_DIM]
    k_cache: torch.Tensor  # [num_pages, page_size, HKV, HEAD_DIM]
    v_cache: torch.Tensor
    page_ids: torch.Tensor  # [T] long, on the pool's device
    slots: torch.Tensor  # [T] long


def prep_reference(inp: PrepInputs) -> PrepExpected:
    """``prepare_paged_qkv(backend="reference")`` on a clone of ``inp``'s pool (``inp`` is not written)."""
    pool = inp.pool.clone()
    q = pw.prepare_paged_qkv(
        inp.q,
        inp.k,
        inp.v,
        pool,
        inp.layout,
        0,
        inp.plan,
        q_norm_weight=inp.q_norm_weight,
        k_norm_weight=inp.k_norm_weight,
        eps=EPS,
        rope_theta=ROPE_THETA,
        norm_style=NORM_STYLE,
        backend="reference",
    )
    page_ids, slots = (t.to(pool.device) for t in written_slots(inp.csr, inp.layout.page_size))
    k_cache, v_cache = layer_caches(pool)
    return PrepExpected(q, k_cache, v_cache, page_ids, slots)


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor, rows: int = 4096) -> float:
    """max |a - b| in fp32, ``rows`` leading rows at a time (a decode pool's layer is 1 GiB of bf16)."""
    worst = 0.0
    for i in range(0, a.shape[0], rows):
        diff = (a[i : i + rows].float() - b[i : i + rows].float()).abs().max().item()
        if math.isnan(diff):
            return diff
        worst = max(worst, diff)
    return worst


def prep_errors(got, want: PrepExpected, tolerance: float = PREP_TOLERANCE) -> dict:
    """``got = (q_out, k_cache, v_cache)``: per part, ``(max |got - ref|, tolerance * max |ref| over the new
    rows)``. K and V compare the layer's whole cache, so a write to a wrong slot shows too."""
    q, k_cache, v_cache = got
    parts = {}
    for name, mine, ref, new_rows in (
        ("q", q, want.q, want.q),
        ("k", k_cache, want.k_cache, want.k_cache[want.page_ids, want.slots]),
        ("v", v_cache, want.v_cache, want.v_cache[want.page_ids, want.slots]),
    ):
        if tuple(mine.shape) != tuple(ref.shape):
            raise ValueError(f"{name}: shape {tuple(mine.shape)} != the reference's {tuple(ref.shape)}")
        parts[name] = (_max_abs_diff(mine, ref), tolerance * new_rows.float().abs().max().item())
    return parts


def check_record(record: dict, parts: dict) -> bool:
    """Fill ``record``'s error fields from :func:`prep_errors`' ``parts``; ``max_abs_err`` / ``err_bound`` are the
    part closest to (or furthest past) its bound. False (and a ``wrong output`` status) if any part fails."""
    record["errors"] = {n: e for n, (e, _) in parts.items()}
    record["err_bounds"] = {n: b for n, (_, b) in parts.items()}

    def closeness(name):  # err / bound; failing parts (NaN included) first
        err, bound = parts[name]
        if not err <= bound:
            return math.inf
        return err / bound if bound > 0 else 0.0

    worst = max(parts, key=closeness)
    record["max_abs_err"], record["err_bound"] = parts[worst]
    failed = [n for n, (e, b) in parts.items() if not e <= b]
    if failed:
        record["status"] = "wrong output (" + ", ".join(f"{n}: {parts[n][0]:.3e} > {parts[n][1]:.3e}" for n in failed)
        record["status"] += ")"
        return False
    return True


# -- systems: each returns a Made: the call, its output (q_out, K cache, V cache) and parts to time alone -------


@dataclass
class Made:
    call: Callable[[], None]
    output: Callable[[], tuple]
    parts: dict = field(default_factory=dict)  # name -> a zero-argument callable (timed alone, kernel ms)
    notes: dict = field(default_factory=dict)  # copied into the record


def system_pagedwindow(w: PrepWorkload, inp: PrepInputs, backend: str = "cuda") -> Made:
    def call():
        pw.prepare_paged_qkv(
            inp.q,
            inp.k,
            inp.v,
            inp.pool,
            inp.layout,
            0,
            inp.plan,
            q_norm_weight=inp.q_norm_weight,
            k_norm_weight=inp.k_norm_weight,
            eps=EPS,
            rope_theta=ROPE_THETA,
            norm_style=NORM_STYLE,
            out_q=inp.out_q,
            backend=backend,
        )

    return Made(call, lambda: (inp.out_q, *layer_caches(inp.pool)))


def hf_rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``Gemma4RMSNorm.forward`` (transformers 5.x): ``x.float() * pow(mean(x^2) + eps, -0.5)``, times
    ``weight.float()`` when it has a scale (q_norm, k_norm; v_norm has none), cast back to ``x``'s dtype."""
    hidden = x.float()
    normed = hidden * torch.pow(hidden.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        normed = normed * weight.float()
    return normed.type_as(x)


def hf_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype, attention_scaling: float = 1.0):
    """``Gemma4TextRotaryEmbedding.forward``: fp32 angles ``position * inv_freq``, duplicated to the full head,
    cos and sin times the attention scaling (1 for the default RoPE), cast to ``dtype``: ``[T, D]`` each."""
    freqs = position_ids[..., None].float() * inv_freq.to(device=position_ids.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def hf_rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_pos_emb`` for ``x [T, H, D]`` and ``cos``/``sin`` ``[T, D]`` (HF's unsqueeze onto heads)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (hf_rotate_half(x) * sin)


def token_positions(csr: Csr, page_size: int) -> torch.Tensor:
    """The KV position of every new row in request order (CPU long ``[T]``)."""
    qo, kvp, last = csr.qo_indptr.tolist(), csr.kv_indptr.tolist(), csr.last_page_len.tolist()
    pieces = []
    for i in range(len(last)):
        kv_len = (kvp[i + 1] - kvp[i] - 1) * page_size + last[i]
        pieces.append(torch.arange(kv_len - (qo[i + 1] - qo[i]), kv_len))
    return torch.cat(pieces)


def system_hf_torch_append(w: PrepWorkload, inp: PrepInputs, backend: str = "cuda") -> Made:
    device = inp.q.device
    inv_freq = torch.tensor(rope_inv_freq(HEAD_DIM, ROPE_THETA), dtype=torch.float32, device=device)  # [D/2]
    positions = token_positions(inp.csr, inp.layout.page_size).to(device)  # [T] long: HF's position_ids
    held: list = [None]

    def norms_and_rope(cos, sin):
        q = hf_apply_rotary(hf_rms_norm(inp.q, EPS, inp.q_norm_weight), cos, sin)
        k = hf_apply_rotary(hf_rms_norm(inp.k, EPS, inp.k_norm_weight), cos, sin)
        return q, k, hf_rms_norm(inp.v, EPS)

    def append(k, v):
        pw.append_paged_kv(k, v, inp.pool, inp.layout, 0, inp.plan, backend=backend)

    def call():
        cos, sin = hf_cos_sin(inv_freq, positions, inp.q.dtype)
        q, k, v = norms_and_rope(cos, sin)
        append(k, v)
        held[0] = q

    cos, sin = hf_cos_sin(inv_freq, positions, inp.q.dtype)
    _, k_done, v_done = norms_and_rope(cos, sin)
    parts = {
        "cos_sin": lambda: hf_cos_sin(inv_freq, positions, inp.q.dtype),
        "norms_rope": lambda: norms_and_rope(cos, sin),
        "append": lambda: append(k_done, v_done),
    }
    return Made(call, lambda: (held[0], *layer_caches(inp.pool)), parts)


def _flashinfer_positions(flashinfer, csr: Csr, page_size: int, nnz: int):
    """FlashInfer's documented way to the append's batch indices and positions (int32 ``[nnz]`` each) from CUDA
    CSR arrays."""
    seq_lens = flashinfer.get_seq_lens(csr.kv_indptr, csr.last_page_len, page_size)  # KV length after the append
    return flashinfer.get_batch_indices_positions(csr.qo_indptr, seq_lens, nnz)


def system_flashinfer(w: PrepWorkload, inp: PrepInputs, backend: str = "cuda") -> Made:
    import flashinfer  # lazily: a missing package is reported as such

    device = inp.q.device
    csr = Csr(*(t.to(device) for t in inp.csr))
    batch_indices, positions = _flashinfer_positions(flashinfer, csr, w.page_size, w.tokens)
    q_out, k_buf, v_buf = torch.empty_like(inp.q), torch.empty_like(inp.k), torch.empty_like(inp.v)
    flat = {name: t.view(-1, HEAD_DIM) for name, t in (("q", inp.q), ("k", inp.k), ("v", inp.v))}
    flat_out = {"q": q_out.view(-1, HEAD_DIM), "k": k_buf.view(-1, HEAD_DIM), "v": v_buf.view(-1, HEAD_DIM)}
    ones = torch.ones(HEAD_DIM, dtype=inp.v.dtype, device=device)  # v's norm has no weight
    k_cache, v_cache = layer_caches(inp.pool)  # strided views: FlashInfer reads the caches' strides

    def norms():
        flashinfer.norm.rmsnorm(flat["q"], inp.q_norm_weight, EPS, out=flat_out["q"])
        flashinfer.norm.rmsnorm(flat["k"], inp.k_norm_weight, EPS, out=flat_out["k"])
        flashinfer.norm.rmsnorm(flat["v"], ones, EPS, out=flat_out["v"])

    def rope():
        flashinfer.rope.apply_rope_pos_ids_inplace(q_out, k_buf, positions, interleave=False, rope_theta=ROPE_THETA)

    def append():
        flashinfer.page.append_paged_kv_cache(
            k_buf,
            v_buf,
            batch_indices,
            positions,
            (k_cache, v_cache),
            csr.kv_indices,
            csr.kv_indptr,
            csr.last_page_len,
            kv_layout="NHD",
        )

    def call():
        norms()
        rope()
        append()

    return Made(
        call,
        lambda: (q_out, k_cache, v_cache),
        {"rmsnorm_qkv": norms, "rope": rope, "append": append},
        {"flashinfer": getattr(flashinfer, "__version__", None)},
    )


PREP_MAKERS = {
    "pagedwindow": system_pagedwindow,
    "hf_torch_append": system_hf_torch_append,
    "flashinfer": system_flashinfer,
}
assert tuple(PREP_MAKERS) == PREP_SYSTEMS


# -- timing -------------------------------------------------------------------------------------------------------


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hbm_bandwidth_gbs(device, nbytes: int = HBM_COPY_BYTES, reps: int = 10) -> float:
    """Decimal GB/s of a device-to-device ``copy_`` of ``nbytes``: bytes read + written over the best of
    ``reps`` CUDA-event-timed copies."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del src, dst
    return copy_gbs(nbytes, min(times))


def prep_plan_times(system: str, w: PrepWorkload, inp: PrepInputs, reps: int) -> dict:
    """Host time of each system's plan step: pagedwindow ``from_csr`` / ``update_csr`` (as in the attention
    bench), FlashInfer's batch indices and positions from CUDA CSR arrays, HF none."""
    if system == "pagedwindow":
        return plan_times("pagedwindow", w, inp, reps)
    if system == "flashinfer":
        import flashinfer

        device = inp.q.device
        csr = Csr(*(t.to(device) for t in inp.csr))
        sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
        return {
            "plan_ms": host_ms(lambda: _flashinfer_positions(flashinfer, csr, w.page_size, w.tokens), reps, sync),
            "update_plan_ms": None,
            "plan_inputs": dict.fromkeys(Csr._fields, "cuda"),
            "plan_status": "get_seq_lens + get_batch_indices_positions on CUDA CSR arrays (every step)",
        }
    return {
        **NO_PLAN,
        "plan_status": "not applicable: the positions are an input of the forward (built once per step)",
    }


def new_prep_record(system: str, w: PrepWorkload) -> dict:
    """A record before measurement: every time ``None``, status ``ok``; the workload's tokens and bytes."""
    return {
        "system": system,
        "workload": w.name,
        "tokens": w.tokens,
        "bytes": w.bytes_moved(),
        "e2e_ms": None,
        "ms": None,
        "plan_ms": None,
        "update_plan_ms": None,
        "gbs": None,
        "hbm_fraction": None,
        "max_abs_err": None,
        "err_bound": None,
        "status": "ok",
        "plan_inputs": None,
        "plan_status": None,
    }


def check_prep_system(record: dict, system: str, w: PrepWorkload, inp: PrepInputs, want: PrepExpected, backend):
    """Make ``system`` on ``inp``, run it once and check its output against ``want``; the Made, or None when
    the check failed (the record says why). Runs on a CPU with ``backend="reference"``."""
    made = PREP_MAKERS[system](w, inp, backend)
    made.call()
    _synchronize(inp.q.device)
    record.update(made.notes)
    return made if check_record(record, prep_errors(made.output(), want)) else None


def _time_prep_system(
    record: dict, system: str, w: PrepWorkload, input_sets: list, want: PrepExpected, reps: int, hbm
) -> list | None:
    """Check ``system``'s output on the first input set, then fill ``record`` with its kernel and plan times and
    bandwidth; returns its calls (one per input set) for the end-to-end loops, or None when the check failed."""
    first = check_prep_system(record, system, w, input_sets[0], want, "cuda")
    if first is None:
        return None
    made = [first] + [PREP_MAKERS[system](w, inp, "cuda") for inp in input_sets[1:]]
    calls = [m.call for m in made]
    ms = median_ms(calls, reps)
    record.update(ms=ms, gbs=gbs(w.bytes_moved(), ms))
    record["hbm_fraction"] = record["gbs"] / hbm if hbm else None
    if first.parts:
        record["part_ms"] = {name: median_ms([fn], reps) for name, fn in first.parts.items()}
    record.update(prep_plan_times(system, w, input_sets[0], max(5, reps // 2)))
    return calls


def allocations_per_10_calls(call: Callable[[], None]) -> int:
    """Allocator calls made by 10 calls of ``call`` (after one warm-up)."""
    call()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["allocation.all.allocated"] - before


def prep_stem(gpu: str, date: str, label: str | None = None) -> str:
    """``<gpu-slug>-<date>-prep[-label]``."""
    return _result_stem(gpu, date, PREP_LABEL + (f"-{label}" if label else ""))


def run_prep_bench(out="benchmarks/results", workloads=None, systems=None, quick=False, label=None) -> int:
    """Measure the prep workloads, print a table, write ``<gpu>-<date>-prep[-label].json`` / ``.md`` /
    ``-bandwidth.png`` into ``out``; an exit code."""
    unknown = [n for n in workloads or () if n not in PREP_WORKLOADS] + [
        s for s in systems or () if s not in PREP_MAKERS
    ]
    if unknown:
        print(
            f"pagedwindow bench --prep: unknown workload or system {unknown}; workloads {list(PREP_WORKLOADS)}, "
            f"systems {list(PREP_MAKERS)}"
        )
        return 2
    twice = named_twice(workloads, systems)
    if twice:
        print(f"pagedwindow bench --prep: {twice} named more than once (each is timed once)")
        return 2
    if not torch.cuda.is_available():
        print("pagedwindow bench needs a CUDA GPU; none is available.")
        return 2
    device = torch.device("cuda")
    chosen = [PREP_WORKLOADS[n] for n in (workloads or PREP_WORKLOADS)]
    systems = list(systems or PREP_SYSTEMS)
    reps, sets, rounds = (10, 2, 3) if quick else (50, 3, 15)
    hbm = hbm_bandwidth_gbs(device)
    print(f"HBM copy bandwidth: {hbm:.0f} GB/s ({HBM_COPY_BYTES >> 30} GiB copy_, read + written, best of 10)")
    records, allocations = [], {}
    for w in chosen:
        gen = torch.Generator().manual_seed(0)
        input_sets = [make_prep_inputs(w, gen, device) for _ in range(sets)]
        want = prep_reference(input_sets[0])
        timed, workload_records = {}, []
        for system in systems:
            record = new_prep_record(system, w)
            try:
                calls = _time_prep_system(record, system, w, input_sets, want, reps, hbm)
            except ImportError as exc:
                record["status"] = f"missing: {exc}"
            except Exception as exc:  # a peer that fails is reported, not dropped
                record["status"] = f"failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
                traceback.print_exc()
            else:
                if calls is not None:
                    timed[system] = calls
            workload_records.append(record)
        # end to end: the systems take turns loop by loop (a new order each round), so drift hits all alike
        e2e = interleaved_e2e_ms(timed, reps, rounds)
        for record in workload_records:
            record["e2e_ms"] = e2e.get(record["system"])
            records.append(record)
            print(
                f"{w.name:>20} {record['system']:>15}  e2e {_num(record['e2e_ms'], '9.4f')}  kernel "
                f"{_num(record['ms'], '9.4f')}  plan {_num(record['plan_ms'], '8.4f')} ms  "
                f"{_num(record['gbs'], '7.0f')} GB/s  {record['status']}",
                flush=True,
            )
        if "pagedwindow" in systems:
            allocations[w.name] = allocations_per_10_calls(system_pagedwindow(w, input_sets[0]).call)
        del input_sets, want
        torch.cuda.empty_cache()
    result = {
        "suite": PREP_LABEL,
        "gpu": torch.cuda.get_device_name(device),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "flashinfer": next((r["flashinfer"] for r in records if r.get("flashinfer")), None),
        "label": label,
        "hbm_gbs": hbm,
        "hbm_copy_bytes": HBM_COPY_BYTES,
        "prep": {"eps": EPS, "rope_theta": ROPE_THETA, "norm_style": NORM_STYLE, "tolerance": PREP_TOLERANCE},
        "shape": {"num_qo_heads": HQ, "num_kv_heads": HKV, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
        "allocations_per_10_calls": allocations,
        "records": records,
    }
    path = write_prep_results(result, Path(out))
    print(prep_markdown(result))
    print(f"wrote {path.with_suffix('')}.json / .md")
    return 0


def write_prep_results(result: dict, out: Path) -> Path:
    """Add the ratios and bars to ``result``; write its JSON, markdown table and bandwidth plot into ``out``;
    the JSON's path."""
    result["ratios"] = prep_ratios(result["records"], result.get("hbm_gbs"))
    result["bars"] = prep_bars(result["ratios"])
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{prep_stem(result['gpu'], result['date'], result.get('label'))}.json"
    path.write_text(json.dumps(result, indent=1))
    path.with_suffix(".md").write_text(prep_markdown(result))
    import matplotlib

    matplotlib.use("Agg")
    from .viz.bench_plots import plot_prep_bandwidth

    plot_prep_bandwidth(result).savefig(path.with_name(f"{path.stem}-bandwidth.png"), dpi=120)
    return path


def _verdict(passed) -> str:
    return "not measured" if passed is None else ("**pass**" if passed else "**FAIL**")


def _bar_value(metric: str, value) -> str:
    if value is None:
        return "—"
    return f"{100 * value:.1f} %" if metric == "hbm_fraction" else f"{value:.2f}×"


def prep_markdown(result: dict) -> str:
    """Workloads × systems: the three times, GB/s and % of the HBM copy bandwidth, the fastest unfused
    sequence's time over this system's (kernel and e2e), the worst part's error; then the bars, pass/fail."""
    hbm = result.get("hbm_gbs")
    ratios = result.get("ratios") or prep_ratios(result["records"], hbm)
    bars = result.get("bars") or prep_bars(ratios)
    shape = result.get("shape") or {}
    prep = result.get("prep") or {}
    lines = [
        f"GPU: {result['gpu']}; HBM copy bandwidth {_num(hbm, '.0f')} GB/s measured in the same run "
        f"(device-to-device copy_ of {result.get('hbm_copy_bytes', HBM_COPY_BYTES) / 2**30:g} GiB, best of 10, "
        f"bytes read + written); prep: Hq {shape.get('num_qo_heads', HQ)}, Hkv {shape.get('num_kv_heads', HKV)}, "
        f"head_dim {shape.get('head_dim', HEAD_DIM)}, bf16, norm_style {prep.get('norm_style', NORM_STYLE)}, "
        f"eps {prep.get('eps', EPS):g}, RoPE theta {prep.get('rope_theta', ROPE_THETA):g}; torch "
        f"{result.get('torch', '?')}, FlashInfer {result.get('flashinfer') or 'not run'}",
        "",
        "| workload | tokens | MiB moved | system | e2e ms | kernel ms | plan ms | GB/s | % HBM | "
        "kernel: best unfused / this | e2e: best unfused / this | max err (bound) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["records"]:
        head = f"| {r['workload']} | {r['tokens']} | {r['bytes'] / 2**20:.1f} | {r['system']} |"
        if r.get("ms") is None and r.get("e2e_ms") is None:
            lines.append(head + " — |" * 7 + f" {r.get('status', 'missing')} |")
            continue
        best = ratios.get(r["workload"], {})
        k_ratio = best["best_unfused_ms"] / r["ms"] if best.get("best_unfused_ms") and r.get("ms") else None
        e_ratio = (
            best["best_unfused_e2e_ms"] / r["e2e_ms"] if best.get("best_unfused_e2e_ms") and r.get("e2e_ms") else None
        )
        fraction = r["gbs"] / hbm if r.get("gbs") is not None and hbm else None
        lines.append(
            f"{head} {_num(r.get('e2e_ms'), '.4f')} | {_num(r.get('ms'), '.4f')} | {_num(r.get('plan_ms'), '.4f')} | "
            f"{_num(r.get('gbs'), '.0f')} | {_num(None if fraction is None else 100 * fraction, '.1f')} | "
            f"{_num(k_ratio, '.2f', '×')} | {_num(e_ratio, '.2f', '×')} | "
            f"{_num(r.get('max_abs_err'), '.2e')} ({_num(r.get('err_bound'), '.2e')}) |"
        )
    lines += [
        "",
        "| workload | bar | measured | result |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {b['workload']} | {b['bar']} | {_bar_value(b['metric'], b['value'])} | {_verdict(b['passed'])} |"
        for b in bars
    ]
    fastest = [
        f"{w} kernel {r['best_unfused_ms_system']}, e2e {r['best_unfused_e2e_system']}"
        for w, r in ratios.items()
        if r.get("best_unfused_ms_system") or r.get("best_unfused_e2e_system")
    ]
    if fastest:
        lines += ["", "Fastest unfused sequence: " + "; ".join(fastest) + "."]
    parts = [
        f"{r['workload']} {r['system']}: " + ", ".join(f"{n} {ms:.4f}" for n, ms in r["part_ms"].items())
        for r in result["records"]
        if r.get("part_ms")
    ]
    if parts:
        lines += ["", "Unfused steps timed alone (kernel ms): " + "; ".join(parts) + "."]
    lines += [
        "",
        "e2e: back-to-back calls, wall clock, host not queued ahead, the systems taking turns loop by loop in a new "
        "order each round (median "
        "of each one's loops); kernel: CUDA events, host queued ahead; plan: "
        "host time (pagedwindow `from_csr`; FlashInfer `get_seq_lens` + `get_batch_indices_positions` on CUDA "
        "CSR arrays; HF none). GB/s: the minimum traffic (q, k, v read, q_out, K, V written, the two weights) over "
        "kernel time. hf_torch_append computes cos/sin in every call (HF: once per forward for all layers; its "
        "`cos_sin` step above is that part alone). Each output was checked against the fp32 reference before "
        f"timing: per part, max |err| <= {prep.get('tolerance', PREP_TOLERANCE):g} · max |ref|.",
    ]
    allocations = result.get("allocations_per_10_calls") or {}
    if allocations:
        lines += [
            "",
            "Allocations made by 10 pagedwindow calls with `out_q` given (the contract: 0): "
            + ", ".join(f"{w} {n}" for w, n in allocations.items()),
        ]
    return "\n".join(lines) + "\n"
