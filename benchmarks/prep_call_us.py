"""Host µs of one whole ``prepare_paged_qkv`` call at the decode step (64 requests x 1 token), as
``host_cost.py`` times a call: for comparing two versions of the library on one machine (run it once per
``PYTHONPATH``). Usage on a GPU machine: ``python3 benchmarks/prep_call_us.py LABEL``."""

from __future__ import annotations

import sys

import torch
from host_cost import host_us_per_call  # benchmarks/host_cost.py, beside this script

from pagedwindow import bench_prep as bp


def main() -> None:
    w = bp.PREP_WORKLOADS["prep_decode_64x1"]
    inputs = bp.make_prep_inputs(w, torch.Generator().manual_seed(0), torch.device("cuda"))
    call = bp.system_pagedwindow(w, inputs).call  # the bench's own call (backend="cuda")
    us = host_us_per_call({"call": call}, n=200, rounds=15)["call"]
    print(f"| {sys.argv[1] if len(sys.argv) > 1 else 'this'} | {us:.2f} |")


if __name__ == "__main__":
    main()
