"""A representative launch of both kernels, small enough for compute-sanitizer (memcheck) to finish quickly.

Ragged batch, page_size 5 (tiles straddle pages), GQA 2, a prefix (start > 0), a seq-0 request, both tiles.
Prints the max error against the reference; exit code 1 when it is off.
"""

import sys

import torch

import pagedwindow as pw

sys.path.insert(0, ".")
from tests.cases import make_case  # noqa: E402


def main() -> int:
    worst = 0.0
    for tile in (16, 64, 128):
        gen = torch.Generator().manual_seed(tile)
        case = make_case(gen, seq_lens=[70, 0, 9], start_positions=[30, 4, 0], page_size=5, num_qo_heads=16,
                         num_kv_heads=8, head_dim=256, dtype=torch.bfloat16, device="cuda", cta_tile_q=tile)
        pw.append_paged_kv(case.k, case.v, case.pool, case.layout, case.layer, case.plan, backend="cuda")
        out = pw.batch_prefill_paged_window(case.q, case.pool, case.layout, case.layer, case.plan, sm_scale=0.0625,
                                            window_left=13, backend="cuda")
        ref = pw.batch_prefill_paged_window(case.q, case.pool, case.layout, case.layer, case.plan, sm_scale=0.0625,
                                            window_left=13, backend="reference")
        torch.cuda.synchronize()
        worst = max(worst, (out.float() - ref.float()).abs().max().item())
    print(f"memcheck case: max |cuda - reference| = {worst:.3e}")
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
