"""One pagedwindow launch of a benchmark workload, for a profiler (``ncu``) to attach to.

``python3 benchmarks/profile_case.py NAME [TILE]`` runs the workload twice (a warm-up, then the profiled launch).
NAME is an attention workload of ``pagedwindow.bench`` (``prefill_8x2048``), a point of the sweep
(``decode_b1_kv4096_w1023``; ``pagedwindow.bench_sweep``), a shape of ``tile_probe.py``
(``probe_b8_n16_c240_w1023``: 8 requests of 16 new tokens on 240 cached keys, window 1023, page 16), or a prep
workload (``prep_8192``: one ``prepare_paged_qkv`` call). TILE is the attention plan's ``cta_tile_q`` (default:
the policy's).
"""

import re
import sys

import torch
from workload_names import attention_workload  # beside this script

from pagedwindow import bench, bench_prep


def make_call(name: str, tile: int | None):
    """The zero-argument call that launches workload ``name`` once on the current CUDA device."""
    device, gen = torch.device("cuda"), torch.Generator().manual_seed(0)
    if name in bench_prep.PREP_WORKLOADS:
        w = bench_prep.PREP_WORKLOADS[name]
        return bench_prep.system_pagedwindow(w, bench_prep.make_prep_inputs(w, gen, device)).call
    probe = re.fullmatch(r"probe_b(\d+)_n(\d+)_c(\d+)_w(-?\d+)", name)
    if probe:
        batch, new, cached, window = (int(v) for v in probe.groups())
        w = bench.Workload(name, (new,) * batch, (cached,) * batch, window, 16)
    else:
        try:
            w = attention_workload(name)
        except ValueError:
            known = "bench.WORKLOADS, the sweep, a probe shape or bench_prep.PREP_WORKLOADS"
            raise SystemExit(f"unknown workload {name!r}: not in {known}") from None
    call, _ = bench.system_pagedwindow(w, bench.make_inputs(w, gen, device, tile))
    return call


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "prefill_8x2048"
    tile = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "default" else None
    call = make_call(name, tile)
    call()
    call()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
