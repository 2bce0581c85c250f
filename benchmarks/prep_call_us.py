"""Host µs of one whole ``prepare_paged_qkv`` call at the decode step (64 requests x 1 token), as
``prep_host_profile.py`` times it: for comparing two versions of the library on one machine (run it once per
``PYTHONPATH``). Usage on a GPU machine: ``python3 benchmarks/prep_call_us.py LABEL``."""

from __future__ import annotations

import sys

import torch
from prep_host_profile import per_call_us

import pagedwindow as pw
from pagedwindow import bench_prep as bp


def main() -> None:
    w = bp.PREP_WORKLOADS["prep_decode_64x1"]
    i = bp.make_prep_inputs(w, torch.Generator().manual_seed(0), torch.device("cuda"))

    def call():
        pw.prepare_paged_qkv(
            i.q,
            i.k,
            i.v,
            i.pool,
            i.layout,
            0,
            i.plan,
            q_norm_weight=i.q_norm_weight,
            k_norm_weight=i.k_norm_weight,
            eps=bp.EPS,
            rope_theta=bp.ROPE_THETA,
            norm_style=bp.NORM_STYLE,
            out_q=i.out_q,
        )

    print(f"| {sys.argv[1] if len(sys.argv) > 1 else 'this'} | {per_call_us(call):.2f} |")


if __name__ == "__main__":
    main()
