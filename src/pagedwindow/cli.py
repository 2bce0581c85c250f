"""The ``pagedwindow`` command: ``report``, ``bench`` and ``doctor``.

Exit codes: 0 success, 1 a gate failed (``report``), 2 a usage error (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import sys

EXIT_USAGE = 2
DESCRIPTION = (
    "Sliding-window paged attention at head_dim 256 (Gemma 4's local layers). Run the oracle notebooks "
    "as an HTML report, benchmark against peers on a GPU, or check what would run on this machine."
)
EPILOG = "exit codes: 0 success, 1 a gate failed (report), 2 a usage error"


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="pagedwindow", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"pagedwindow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{report,bench,doctor}")

    text = "run the oracle notebooks through papermill and render an HTML report"
    report = sub.add_parser("report", help=text, description=text[0].upper() + text[1:] + ".", epilog=EPILOG)
    report.add_argument(
        "--params",
        default="default",
        help="parameter set: a name in notebooks/params (smoke, default, gemma4_12b) or a YAML path",
    )
    report.add_argument("--out", default=None, help="report directory (default: reports/<params>)")
    report.add_argument(
        "--notebooks",
        nargs="*",
        default=None,
        help="notebooks to run: stems, file names or unique prefixes such as 02 (default: all)",
    )

    text = "time pagedwindow against its peers on the Gemma-4 workloads (needs a CUDA GPU)"
    bench = sub.add_parser(
        "bench",
        help=text,
        epilog=EPILOG,
        description=text[0].upper() + text[1:] + ": end-to-end, kernel and plan time.",
    )
    bench.add_argument(
        "--out", default="benchmarks/results", help="directory for <gpu>-<date>[-label].json, its table and plots"
    )
    bench.add_argument(
        "--workloads",
        nargs="*",
        default=None,
        help="workload names (default: all): the bench's, or sweep points' as the sweep names them "
        "(decode_b1_kv4096_w1023; sweep_<slice>_b<batch>_n<new>_c<cached>_p<page>_w<window>), on its grids or off",
    )
    bench.add_argument("--systems", nargs="*", default=None, help="systems to time (default: all)")
    bench.add_argument(
        "--sweep",
        action="store_true",
        help="time the sweep (batch 1-512, new tokens 1-32k, cached 0-128k, page sizes 1-128, windows 0/255/1023/"
        "none; the paged kernels only): each point's speed-up over FlashInfer's best into the JSON and "
        "<stem>-sweep.png; alone unless --workloads names others too",
    )
    bench.add_argument(
        "--decode-sweep",
        action="store_true",
        help="the sweep's decode slices only (batch 1-512, cached length 1-128k, window 1023 / none)",
    )
    bench.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    bench.add_argument(
        "--cta-tile-q",
        type=int,
        default=None,
        help="force the plans' query tile (16, 64 or 128; default: each plan's own choice)",
    )
    bench.add_argument(
        "--label", default=None, help="suffix of the result file names, e.g. a kernel variant (letters, digits, . _ -)"
    )
    bench.add_argument(
        "--prep",
        action="store_true",
        help="time only the Gemma prep (q/k/v norms, RoPE, paged K/V write: prepare_paged_qkv against HF torch ops "
        "and FlashInfer) into <gpu>-<date>-prep[-label].json; --workloads / --systems then name prep workloads "
        "(prep_8192, prep_512_on_30000, prep_decode_64x1) and systems (pagedwindow, hf_torch_append, flashinfer)",
    )

    text = "print what would run on this machine and why (builds nothing unless --build)"
    doctor_parser = sub.add_parser("doctor", help=text, description=text[0].upper() + text[1:] + ".")
    doctor_parser.add_argument(
        "--build", action="store_true", help="on a GPU: build (or verify) and load the kernels, then report them"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        return doctor(build_kernels=args.build)
    from .report import ReportUsageError

    try:
        if args.command == "report":
            from .report import run_report

            return run_report(params=args.params, out=args.out, notebooks=args.notebooks)
        return bench(args)
    except ReportUsageError as exc:
        print(f"pagedwindow {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE


def bench(args: argparse.Namespace) -> int:
    """Check the arguments (label, names, tile, output directory, a GPU) before measuring anything; run it."""
    from .report import check_name, check_out_dir

    if args.label is not None:
        check_name("--label", args.label)
    import torch

    from .bench import MAKERS, WORKLOADS, run_bench, workload_named
    from .bench_sweep import POINT_NAME_FORMS
    from .tiles import SUPPORTED_CTA_TILE_Q

    if args.prep:
        from .bench_prep import PREP_MAKERS, PREP_WORKLOADS

        workloads, systems = list(PREP_WORKLOADS), PREP_MAKERS
        unknown_workloads = [n for n in args.workloads or () if n not in PREP_WORKLOADS]
        given_flags = (
            ("--sweep", args.sweep),
            ("--decode-sweep", args.decode_sweep),
            ("--cta-tile-q", args.cta_tile_q is not None),
        )
        refused = [flag for flag, given in given_flags if given]
        if refused:
            print(f"pagedwindow bench: {' and '.join(refused)} cannot be used with --prep", file=sys.stderr)
            return EXIT_USAGE
    else:  # the bench's workloads, or sweep points by name (decode_b1_kv4096_w1023): what run_bench accepts
        workloads, systems = [*WORKLOADS, *POINT_NAME_FORMS], MAKERS
        unknown_workloads = [n for n in args.workloads or () if workload_named(n) is None]
    unknown_systems = [n for n in args.systems or () if n not in systems]
    for what, unknown, known in (("workload", unknown_workloads, workloads), ("system", unknown_systems, systems)):
        if unknown:
            print(f"pagedwindow bench: unknown {what}(s) {unknown}; known: {', '.join(known)}", file=sys.stderr)
            return EXIT_USAGE
    if args.cta_tile_q is not None and args.cta_tile_q not in SUPPORTED_CTA_TILE_Q:
        print(
            f"pagedwindow bench: --cta-tile-q {args.cta_tile_q} is not one of {SUPPORTED_CTA_TILE_Q}", file=sys.stderr
        )
        return EXIT_USAGE
    out = check_out_dir(args.out)
    if not torch.cuda.is_available():
        print("pagedwindow bench: needs a CUDA GPU; none is available", file=sys.stderr)
        return EXIT_USAGE
    try:
        out.mkdir(parents=True, exist_ok=True)  # fail now, not after the measurements
    except OSError as exc:
        print(f"pagedwindow bench: output directory {out}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.prep:
        from .bench_prep import run_prep_bench

        return run_prep_bench(
            out=args.out, workloads=args.workloads, systems=args.systems, quick=args.quick, label=args.label
        )
    return run_bench(
        out=args.out,
        workloads=args.workloads,
        systems=args.systems,
        sweep=args.sweep,
        quick=args.quick,
        cta_tile_q=args.cta_tile_q,
        label=args.label,
        decode_sweep=args.decode_sweep,
    )


def doctor(*, build_kernels: bool = False) -> int:
    """Print versions, the GPU, nvcc, the kernel ``backend='auto'`` would use, the cache and (once the library is
    built, or ``build_kernels``) the K/V copy path; exit 0. A failed build is printed, not raised."""
    import platform
    import subprocess

    import torch

    from . import __version__

    print(f"pagedwindow {__version__}")
    print(f"python {platform.python_version()} ({sys.executable})")
    print(f"torch {torch.__version__} ({f'CUDA {torch.version.cuda}' if torch.version.cuda else 'CPU-only'} build)")
    try:
        from . import cuda as cuda_backend
        from .cuda import build, ops
    except (ImportError, OSError) as exc:
        print(
            f"CUDA backend: cannot be imported ({type(exc).__name__}: {exc}); backend='auto' runs the PyTorch reference"
        )
        return 0
    nvcc: str | None = None
    try:
        found = build.find_nvcc()
    except build.BuildError as exc:
        print(f"nvcc: {str(exc).removeprefix('nvcc ')}")
    else:
        nvcc = found
        try:
            out = build.nvcc_version(found)
            version = next((line for line in out.splitlines() if "release" in line), out.splitlines()[-1])
        except (OSError, subprocess.SubprocessError, IndexError) as exc:
            version = f"'nvcc --version' failed: {exc}"
        print(f"nvcc: {nvcc} ({version.strip()})")
    try:
        print(f"kernel sources: {build.source_paths()[0].parent}")
        sources = True
    except build.BuildError as exc:
        print(f"kernel sources: {exc}")
        sources = False
    print(f"kernel cache: {build.cache_root()}")
    if not torch.cuda.is_available():
        print("CUDA available: no")
        print("no GPU: backend='auto' runs the PyTorch reference")
        return 0
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    target = build.target_for_capability(major, minor)
    print("CUDA available: yes")
    print(f"GPU {index}: {torch.cuda.get_device_name(index)}, compute capability {major}.{minor} (target {target})")
    try:
        kernel = cuda_backend.prefill_kernel(torch.device("cuda", index))
        print(f"prefill kernel for backend='auto': {kernel} ({ops.prefill_entry(target)})")
    except RuntimeError as exc:  # a bad $PAGEDWINDOW_PREFILL_KERNEL
        print(f"prefill kernel for backend='auto': {exc}")
        return 0
    if nvcc is None or not sources:
        print("backend='auto' runs the PyTorch reference: the kernels cannot be built (see above)")
        return 0
    try:
        key = build.build_key(target, nvcc)
        entry = build.cache_root() / f"{target}-{key}"
    except (build.BuildError, OSError, subprocess.SubprocessError) as exc:
        print(f"kernel library: unknown ({exc})")
        return 0
    if build_kernels:
        import time

        started = time.perf_counter()
        try:
            ops.library(torch.device("cuda", index))
        except (build.BuildError, OSError) as exc:
            print(f"kernel library: the build failed, backend='auto' runs the PyTorch reference: {exc}")
            return 0
        print(f"kernel library: built or verified and loaded in {time.perf_counter() - started:.1f} s")
    library = build.verified_library(entry, key)
    if library is None:
        print(f"kernel library: not built yet (or damaged); the first CUDA call builds it into {entry}")
        return 0
    print(f"kernel library: {library} (built and verified; backend='auto' runs the CUDA kernels on bf16 head_dim 256)")
    if build_kernels:
        from .cuda import launch_gate

        gate = launch_gate.module()
        if gate is None:
            reason = launch_gate.unavailable_reason()
            print(f"call gate: unavailable, calls take the checked Python path: {reason}")
        else:
            print(f"call gate: {gate.__file__} (loaded; eager calls check and launch in one C call)")
    else:
        print("call gate: built on the first eager call (doctor --build builds it now)")
    from .layout import PagedKvLayout, checked_paged_geometry

    for page_size in (16, 5):  # the K/V copy path depends on the pool: one that allows bulk copies, one that not
        layout = PagedKvLayout(1, 8, 256, page_size)
        pool = layout.allocate(2, device=torch.device("cuda", index))
        geometry = checked_paged_geometry("doctor", layout, pool, 0, 256, 8)
        path = cuda_backend.kv_copy_path(pool, geometry, 8)
        print(f"K/V copy path, bf16 pool of page {page_size}, 8 KV heads: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
