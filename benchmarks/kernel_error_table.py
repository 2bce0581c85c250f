"""Worst kernel error per case family against the tolerance rule (GPU): the table the GPU suite's asserts hide.

Rule (docs/design.md §8): max |kernel - fp64| <= 2 * max |plain bf16 torch - fp64| + 1e-3.
The cases are the GPU suite's (``pagedwindow.testing.KERNEL_GEOMETRIES`` x ``KERNEL_WINDOWS``). Run on a GPU from the
repository root: ``PYTHONPATH=src python3 benchmarks/kernel_error_table.py``.
"""

import sys
from collections import defaultdict

import torch

from pagedwindow.testing import (
    KERNEL_GEOMETRIES,
    KERNEL_SM_SCALE,
    KERNEL_WINDOWS,
    dense_attention,
    error_bound,
    max_abs_err,
    run_kernel_case,
)


def families(geometry, window_left):
    page_size, seqs, starts, (hq, hkv), tile = geometry
    yield f"page_size {page_size}"
    yield f"window_left {window_left}"
    yield f"GQA group {hq // hkv}"
    yield f"tile {tile or 'default'}"
    if any(starts):
        yield "start_pos > 0"
    if 0 in seqs:
        yield "seq_len 0 request"


def main() -> int:
    worst = defaultdict(lambda: (0.0, 0.0, 0.0))  # family -> (err, bound, ratio)
    failures = 0
    for geometry in KERNEL_GEOMETRIES:
        for window_left in KERNEL_WINDOWS:
            case, out, _ = run_kernel_case(geometry, window_left, seed=7)
            rows = case.plan.total_tokens
            exact = dense_attention(case, sm_scale=KERNEL_SM_SCALE, window_left=window_left)
            plain = dense_attention(case, sm_scale=KERNEL_SM_SCALE, window_left=window_left, dtype=torch.bfloat16)
            bound = error_bound(max_abs_err(plain, exact))
            err = max_abs_err(out[:rows], exact)
            failures += err > bound
            for family in families(geometry, window_left):
                if err / bound > worst[family][2]:
                    worst[family] = (err, bound, err / bound)
    print("| case family | worst max abs err | its bound | err / bound |")
    print("|---|---|---|---|")
    for family, (err, bound, ratio) in sorted(worst.items()):
        print(f"| {family} | {err:.3e} | {bound:.3e} | {ratio:.2f} |")
    print(f"cases over the bound: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
