"""A representative launch of every kernel (prefill, pool write, fused prep), small enough for compute-sanitizer
(memcheck) to finish quickly.

Ragged batch, page_size 5 (tiles straddle pages; cp.async) and 16 (the sm_90a bulk copies), GQA 2, a prefix
(start > 0), a seq-0 request, every tile; a decode batch whose long request the split-KV kernel splits.
Prints the max error against the reference; exit code 1 when it is off. ``--prep`` runs only the prep's cases
and ``--decode`` only the split-KV decode kernel's (each for racecheck, whose cost the other kernels would
dominate).
"""

import sys

import torch

import pagedwindow as pw
from pagedwindow.testing import random_batch


def main() -> int:
    if "--decode" in sys.argv:
        return report(attention_cases(decode_only=True))
    worst = 0.0 if "--prep" in sys.argv else attention_cases()
    return report(prep_cases(worst))


def report(worst: float) -> int:
    print(f"memcheck case: max |cuda - reference| = {worst:.3e}")
    return 0 if worst < 2e-2 else 1


def attention_cases(decode_only: bool = False) -> float:
    """Each kernel's launches (``decode_only``: the tile-16 ones, which run the split-KV decode kernel); the
    largest error against the reference."""
    worst = 0.0
    # (seed, seq_lens, start_positions, tile, window_left, page_size): each tile on a ragged batch, K/V by cp.async
    # (page 5); then decode at the policy's tile 16 (the split-KV kernel) with no window, whose 3000-key request
    # splits across units; then the sm_90a kernel's bulk tensor copies (page 16), with kv_len not a multiple of
    # 16 (the last page's rows copied by the producer's tail loop).
    cases = [(tile, [70, 0, 9], [30, 4, 0], tile, 13, 5) for tile in (16, 64, 128)]
    cases.append((16, [1, 1, 3], [3000, 7, 640], None, -1, 5))
    cases += [(tile + 1, [70, 0, 9, 130], [30, 4, 0, 301], tile, window, 16) for tile, window in ((64, 13), (128, -1))]
    if decode_only:
        cases = [c for c in cases if c[3] in (16, None)]
    for seed, seqs, starts, tile, window_left, page_size in cases:
        case = random_batch(
            torch.Generator().manual_seed(seed),
            seq_lens=seqs,
            start_positions=starts,
            page_size=page_size,
            num_qo_heads=16,
            num_kv_heads=8,
            head_dim=256,
            dtype=torch.bfloat16,
            device="cuda",
            cta_tile_q=tile,
        )
        pw.append_paged_kv(case.k, case.v, case.pool, case.layout, case.layer, case.plan, backend="cuda")
        assert tile is not None or case.plan.cta_tile_q == 16, case.plan.describe()
        inputs = (case.q, case.pool, case.layout, case.layer, case.plan)
        for _ in range(2):  # the second launch finds the split counters the first one left
            out = pw.batch_prefill_paged_window(*inputs, sm_scale=0.0625, window_left=window_left, backend="cuda")
        ref = pw.batch_prefill_paged_window(*inputs, sm_scale=0.0625, window_left=window_left, backend="reference")
        torch.cuda.synchronize()
        worst = max(worst, (out.float() - ref.float()).abs().max().item())
    if decode_only:
        return worst
    # A preallocated plan re-planned in place between launches (the serving path: async upload, fixed tile), from
    # CSR tensors on the host and on the GPU in turn (the page ids then checked by pw_plan_check_pages).
    gen = torch.Generator().manual_seed(1)
    plan = pw.PrefillPagedPlan.preallocated(
        max_total_tokens=128, max_total_pages=64, max_batch=4, max_tiles=64, device="cuda"
    )
    updates = (([70, 0, 9], [30, 4, 0], "cpu"), ([1, 1, 1, 1], [50, 3, 0, 99], "cuda"), ([0, 0], [5, 9], "cuda"))
    for seqs, starts, csr_device in updates:
        case = random_batch(
            gen,
            seq_lens=seqs,
            start_positions=starts,
            page_size=5,
            num_qo_heads=16,
            num_kv_heads=8,
            head_dim=256,
            dtype=torch.bfloat16,
            device="cuda",
        )
        p = case.plan
        plan.update_csr(
            p.qo_indptr.to(csr_device),
            p.page_indptr.to(csr_device),
            p.page_indices.to(csr_device, torch.int64),
            p.last_page_len.to(csr_device),
            num_qo_heads=16,
            num_kv_heads=8,
            head_dim=256,
            page_size=5,
        )
        pw.append_paged_kv(case.k, case.v, case.pool, case.layout, case.layer, plan, backend="cuda")
        out = pw.batch_prefill_paged_window(
            case.q, case.pool, case.layout, case.layer, plan, sm_scale=1.0, window_left=1023, backend="cuda"
        )
        ref = pw.batch_prefill_paged_window(
            case.q, case.pool, case.layout, case.layer, plan, sm_scale=1.0, window_left=1023, backend="reference"
        )
        torch.cuda.synchronize()
        if out.numel():
            worst = max(worst, (out.float() - ref.float()).abs().max().item() / max(1.0, ref.abs().max().item()))
    return worst


def prep_cases(worst: float) -> float:
    """The fused prep on the same kind of batch (ragged, a prefix, an empty request, page_size 5), both styles;
    then 1209 tokens (several units per CTA of the persistent grid) and fp32 at head_dim 512 (two units per
    token)."""
    gen = torch.Generator().manual_seed(2)
    cases = [(style, [70, 0, 9], torch.bfloat16, 256, 16, 8) for style in ("gemma4", "gemma3")] + [
        ("gemma4", [1200, 0, 9], torch.bfloat16, 256, 16, 8),
        ("gemma3", [300, 0, 9], torch.float32, 512, 8, 4),
    ]
    for style, seqs, dtype, d, hq, hkv in cases:
        case = random_batch(
            gen,
            seq_lens=seqs,
            start_positions=[30, 4, 0],
            page_size=5,
            num_qo_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
            dtype=dtype,
            device="cuda",
        )
        w = torch.rand(d, generator=gen).to(device="cuda", dtype=dtype)
        outs = []
        for backend in ("cuda", "reference"):
            pool = case.pool.clone()
            q = pw.prepare_paged_qkv(
                case.q, case.k, case.v, pool, case.layout, case.layer, case.plan, q_norm_weight=w,
                k_norm_weight=w, eps=1e-6, rope_theta=10000.0, norm_style=style, backend=backend,
            )  # fmt: skip
            outs.append((q.float(), pool.float()))
        torch.cuda.synchronize()
        (q_cuda, pool_cuda), (q_ref, pool_ref) = outs
        worst = max(worst, (q_cuda - q_ref).abs().max().item() / 8, (pool_cuda - pool_ref).abs().max().item() / 8)
    return worst


if __name__ == "__main__":
    sys.exit(main())
