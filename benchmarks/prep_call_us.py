"""Host µs of one whole ``prepare_paged_qkv`` call at the decode step (64 requests x 1 token), as
``prep_host_profile.py`` times it: for comparing two versions of the library on one machine (run it once per
``PYTHONPATH``). Usage on a GPU machine: ``python3 benchmarks/prep_call_us.py LABEL``."""

from __future__ import annotations

import sys

import torch
from prep_host_profile import per_call_us

from pagedwindow import bench_prep as bp


def main() -> None:
    w = bp.PREP_WORKLOADS["prep_decode_64x1"]
    inputs = bp.make_prep_inputs(w, torch.Generator().manual_seed(0), torch.device("cuda"))
    call = bp.system_pagedwindow(w, inputs).call  # the bench's own call (backend="cuda")
    print(f"| {sys.argv[1] if len(sys.argv) > 1 else 'this'} | {per_call_us(call):.2f} |")


if __name__ == "__main__":
    main()
