"""Kernel time of pagedwindow built two or more ways (nvcc flags), the builds taking turns round by round.

``python3 benchmarks/variant_ab.py --variant base: --variant new:-DNAME=VALUE [--workloads ...] [--rounds 3]
[--cta-tile-q 128] [--json out.json]``

Each variant is ``label:flags`` (``$PAGEDWINDOW_NVCC_FLAGS`` of its build; empty: the default build). Every
round runs each variant once, in a fresh process (one library per process), in a shuffled order; a process
checks each workload's output against the reference, then times it with ``bench.median_ms`` (host queued
ahead) at the plan's default tile or the given one. The table gives each variant's median over the rounds and
its ratio to the first variant's (below 1: faster).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

DEFAULT_WORKLOADS = ("prefill_1x8192", "prefill_8x2048", "chunk_2048_on_6144", "prompts_32x128", "chunk_512_on_30000")


def child(workloads: list[str], tile: int | None) -> None:
    """One build's kernel ms per workload, as one JSON line on stdout."""
    import torch

    from pagedwindow import bench

    device = torch.device("cuda")
    times = {}
    for name in workloads:
        w = bench.WORKLOADS[name]
        gen = torch.Generator().manual_seed(0)
        sets = [bench.make_inputs(w, gen, device, tile) for _ in range(2)]
        want = bench.reference_output(w, sets[0])
        made = [bench.system_pagedwindow(w, inp) for inp in sets]  # (call, its output)
        for call, _ in made:
            call()
        torch.cuda.synchronize()
        err = (made[0][1]().float() - want.float()).abs().max().item()
        bound = bench.OUTPUT_TOLERANCE * want.float().abs().max().item()
        if not err <= bound:
            raise SystemExit(f"{name}: max |out - ref| {err:.3e} over the bound {bound:.3e}")
        times[name] = bench.median_ms([call for call, _ in made], 200)
        del sets, made
        torch.cuda.empty_cache()
    print(json.dumps(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", default=[], help="label:nvcc flags (repeat; two or more)")
    parser.add_argument("--workloads", nargs="*", default=list(DEFAULT_WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cta-tile-q", type=int, default=None)
    parser.add_argument("--json", help="write every round's times here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.workloads, args.cta_tile_q)
        return

    from pagedwindow.bench import shuffled_rounds

    variants = dict(v.split(":", 1) for v in args.variant)
    rounds: dict[str, list[dict]] = {label: [] for label in variants}
    cmd = [sys.executable, __file__, "--child", "--workloads", *args.workloads]
    if args.cta_tile_q:
        cmd += ["--cta-tile-q", str(args.cta_tile_q)]
    for order in shuffled_rounds(list(variants), args.rounds):
        for label in order:
            env = dict(os.environ, PAGEDWINDOW_NVCC_FLAGS=variants[label])
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"variant {label} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            rounds[label].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"{label}: {rounds[label][-1]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"variants": variants, "cta_tile_q": args.cta_tile_q, "rounds": rounds}, f, indent=1)
    first = next(iter(variants))
    print(
        "\n| workload | "
        + " | ".join(f"{v} ms" for v in variants)
        + " | "
        + " | ".join(f"{v} / {first}" for v in list(variants)[1:])
        + " |"
    )
    print("|---|" + "---|" * (2 * len(variants) - 1))
    for name in args.workloads:
        med = {v: statistics.median(r[name] for r in rounds[v]) for v in variants}
        ratios = [f"{med[v] / med[first]:.3f}" for v in list(variants)[1:]]
        print(f"| {name} | " + " | ".join(f"{med[v]:.4f}" for v in variants) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
