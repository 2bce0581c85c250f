"""One pagedwindow launch of a benchmark workload, for a profiler (``ncu``) to attach to.

``python3 benchmarks/profile_case.py prefill_8x2048 128`` runs the workload twice (a warm-up, then the profiled
launch) with the given plan tile.
"""

import sys

import torch

from pagedwindow import bench


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "prefill_8x2048"
    tile = int(sys.argv[2]) if len(sys.argv) > 2 else None
    w = bench.WORKLOADS[name]
    inputs = bench.make_inputs(w, torch.Generator().manual_seed(0), torch.device("cuda"), tile)
    call, _ = bench.system_pagedwindow(w, inputs)
    call()
    call()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
