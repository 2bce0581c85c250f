"""Kernel time of pagedwindow built two or more ways (nvcc flags, or another source tree), the builds taking turns
round by round.

``python3 benchmarks/variant_ab.py --variant base: --variant new:-DNAME=VALUE [--src base=prior/src] [--prep]
[--unchecked new] [--workloads ...] [--rounds 3] [--cta-tile-q 128] [--json out.json]``

Each variant is ``label:flags`` (``$PAGEDWINDOW_NVCC_FLAGS`` of its build; empty: the default build); ``--src
label=DIR`` runs that variant from another copy of the package (e.g. a prior commit's ``src`` unpacked beside
this tree, whose ``kernels`` sit beside it). Every round runs each variant once, in a fresh process (one library
per process), in a shuffled order; a process checks each workload's output against the reference, then times it
with ``bench.median_ms`` (host queued ahead): the attention workloads (``bench``'s names or sweep points', e.g.
``decode_b1_kv4096_w1023``) at the plan's default tile or the given one, or with ``--prep`` the prep workloads
(``prepare_paged_qkv``, checked as ``bench --prep`` checks it). The table gives each variant's median over the
rounds with the rounds' range, and its ratio to the first variant's (below 1: faster). For the attention
workloads it also says whether every variant wrote the same output bits (each process hashes its output; the
inputs come from one seed), which a change meant to keep every sum's order must do. ``--unchecked label`` (attention
workloads only) times that variant without checking its output: a measurement build whose output is not attention
(e.g. a bound on the loop's time with one operand taken from registers).
"""

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys

DEFAULT_WORKLOADS = ("prefill_1x8192", "prefill_8x2048", "chunk_2048_on_6144", "prompts_32x128", "chunk_512_on_30000")
DEFAULT_PREP_WORKLOADS = ("prep_8192", "prep_512_on_30000", "prep_decode_64x1")


def parse_variants(specs: list[str], sources: list[str]) -> dict[str, dict]:
    """``label:flags`` specs and ``label=DIR`` sources -> ``{label: {"flags": ..., "src": DIR or None}}`` in the
    specs' order. Raises ValueError for a spec without ``:``, an empty or repeated label, a source naming no
    variant or given twice, or fewer than two variants."""
    variants: dict[str, dict] = {}
    for spec in specs:
        label, sep, flags = spec.partition(":")
        if not sep or not label:
            raise ValueError(f"variant {spec!r} is not label:flags")
        if label in variants:
            raise ValueError(f"variant {label!r} is given twice")
        variants[label] = {"flags": flags, "src": None}
    if len(variants) < 2:
        raise ValueError(f"give two or more variants, got {len(variants)}")
    for source in sources:
        label, sep, path = source.partition("=")
        if not sep or not path:
            raise ValueError(f"source {source!r} is not label=DIR")
        if label not in variants:
            raise ValueError(f"source {source!r} names no variant (variants: {', '.join(variants)})")
        if variants[label]["src"] is not None:
            raise ValueError(f"variant {label!r} is given two sources")
        variants[label]["src"] = path
    return variants


def variant_env(env: dict[str, str], variant: dict) -> dict[str, str]:
    """The child process's environment: ``env`` with the variant's nvcc flags, and its package directory first on
    ``PYTHONPATH`` when it has one."""
    out = dict(env, PAGEDWINDOW_NVCC_FLAGS=variant["flags"])
    if variant["src"] is not None:
        path = os.path.abspath(variant["src"])
        out["PYTHONPATH"] = path + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return out


def prep_child(workloads: list[str]) -> None:
    """One build's ``prepare_paged_qkv`` kernel ms per prep workload, as one JSON line on stdout."""
    import torch

    from pagedwindow import bench, bench_prep

    device = torch.device("cuda")
    times = {}
    for name in workloads:
        w = bench_prep.PREP_WORKLOADS[name]
        gen = torch.Generator().manual_seed(0)
        sets = [bench_prep.make_prep_inputs(w, gen, device) for _ in range(2)]
        want = bench_prep.prep_reference(sets[0])
        record = bench_prep.new_prep_record("pagedwindow", w)
        first = bench_prep.check_prep_system(record, "pagedwindow", w, sets[0], want, "cuda")
        if first is None:
            raise SystemExit(f"{name}: {record['status']}")
        calls = [first.call, bench_prep.system_pagedwindow(w, sets[1]).call]
        times[name] = bench.median_ms(calls, 200)
        del sets, want, first, calls
        torch.cuda.empty_cache()
    print(json.dumps(times))


def output_digest(out) -> str:
    """A short hash of a tensor's values, bit for bit as stored."""
    import torch

    flat = out.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def child(workloads: list[str], tile: int | None, check: bool = True) -> None:
    """One build's kernel ms per attention workload and a hash of its output, as one JSON line on stdout:
    ``{"ms": {workload: ms}, "digest": {workload: hash}}``; the output checked against the reference unless
    ``check`` is false."""
    import torch

    from pagedwindow import bench

    device = torch.device("cuda")
    times, digests = {}, {}
    from workload_names import attention_workload  # beside this script

    for name in workloads:
        w = attention_workload(name)
        gen = torch.Generator().manual_seed(0)
        sets = [bench.make_inputs(w, gen, device, tile) for _ in range(2)]
        want = bench.reference_output(w, sets[0])
        made = [bench.system_pagedwindow(w, inp) for inp in sets]  # (call, its output)
        for call, _ in made:
            call()
        torch.cuda.synchronize()
        err = (made[0][1]().float() - want.float()).abs().max().item()
        bound = bench.OUTPUT_TOLERANCE * want.float().abs().max().item()
        if check and not err <= bound:
            raise SystemExit(f"{name}: max |out - ref| {err:.3e} over the bound {bound:.3e}")
        digests[name] = output_digest(made[0][1]())
        times[name] = bench.median_ms([call for call, _ in made], 200)
        del sets, made
        torch.cuda.empty_cache()
    print(json.dumps({"ms": times, "digest": digests}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", default=[], help="label:nvcc flags (repeat; two or more)")
    parser.add_argument("--src", action="append", default=[], help="label=DIR: that variant's package directory")
    parser.add_argument("--prep", action="store_true", help="time prepare_paged_qkv on the prep workloads")
    parser.add_argument("--workloads", nargs="*", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cta-tile-q", type=int, default=None)
    parser.add_argument("--json", help="write every round's times here")
    parser.add_argument(
        "--unchecked", action="append", default=[], help="label: time that variant without checking its output"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-check", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    workloads = args.workloads or list(DEFAULT_PREP_WORKLOADS if args.prep else DEFAULT_WORKLOADS)
    if args.child:
        if args.prep:
            prep_child(workloads)
        else:
            child(workloads, args.cta_tile_q, check=not args.no_check)
        return
    try:
        variants = parse_variants(args.variant, args.src)
        for label in args.unchecked:
            if label not in variants:
                raise ValueError(f"--unchecked {label!r} names no variant (variants: {', '.join(variants)})")
            if args.prep:
                raise ValueError("--unchecked applies to attention workloads, not --prep")
        if not args.prep:
            from workload_names import attention_workload  # beside this script

            for name in workloads:
                attention_workload(name)
    except ValueError as exc:
        parser.error(str(exc))

    from pagedwindow.bench import shuffled_rounds

    rounds: dict[str, list[dict]] = {label: [] for label in variants}
    digests: dict[str, dict[str, list[str]]] = {label: {} for label in variants}  # attention workloads only
    cmd = [sys.executable, __file__, "--child", "--workloads", *workloads] + (["--prep"] if args.prep else [])
    if args.cta_tile_q:
        cmd += ["--cta-tile-q", str(args.cta_tile_q)]
    for order in shuffled_rounds(list(variants), args.rounds):
        for label in order:
            env = variant_env(dict(os.environ), variants[label])
            proc = subprocess.run(
                cmd + (["--no-check"] if label in args.unchecked else []), env=env, capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise SystemExit(f"variant {label} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            if not args.prep:
                for name, digest in result["digest"].items():
                    digests[label].setdefault(name, []).append(digest)
                result = result["ms"]
            rounds[label].append(result)
            print(f"{label}: {rounds[label][-1]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "variants": {label: v["flags"] for label, v in variants.items()},
                    "sources": {label: v["src"] for label, v in variants.items()},
                    "prep": args.prep,
                    "unchecked": args.unchecked,
                    "cta_tile_q": args.cta_tile_q,
                    "rounds": rounds,
                    "output_digests": None if args.prep else digests,
                },
                f,
                indent=1,
            )
    print("\n" + "\n".join(table(rounds, workloads, None if args.prep else digests)))


def same_output(digests: dict[str, dict[str, list[str]]], name: str) -> str:
    """``"same bits"`` when every process of every variant hashed workload ``name``'s output alike; else which
    variants' outputs differ from the first variant's (or vary between its own rounds)."""
    labels = list(digests)
    first = set(digests[labels[0]][name])
    if len(first) > 1:
        return f"{labels[0]} varies between rounds"
    differ = [v for v in labels[1:] if set(digests[v][name]) != first]
    return "same bits" if not differ else "differ: " + ", ".join(differ)


def table(rounds: dict[str, list[dict]], workloads: list[str], digests=None) -> list[str]:
    """Markdown rows: per workload each variant's median ms over its rounds with the rounds' range (a bimodal or
    noisy workload shows there, not in the median alone), then each variant's median over the first variant's;
    with ``digests`` (``{variant: {workload: [hash per round]}}``) a last column saying whether the outputs were
    the same bits (:func:`same_output`)."""
    labels = list(rounds)
    first = labels[0]
    lines = [
        "| workload | "
        + " | ".join(f"{v} ms (rounds)" for v in labels)
        + " | "
        + " | ".join(f"{v} / {first}" for v in labels[1:])
        + (" | outputs |" if digests else " |"),
        "|---|" + "---|" * (2 * len(labels) - 1 + (1 if digests else 0)),
    ]
    for name in workloads:
        times = {v: [r[name] for r in rounds[v]] for v in labels}
        med = {v: statistics.median(t) for v, t in times.items()}
        cells = [f"{med[v]:.4f} ({min(times[v]):.4f}–{max(times[v]):.4f})" for v in labels]
        ratios = [f"{med[v] / med[first]:.3f}" for v in labels[1:]]
        last = f" | {same_output(digests, name)} |" if digests else " |"
        lines.append(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(ratios) + last)
    return lines


if __name__ == "__main__":
    main()
