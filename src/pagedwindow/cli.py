"""``pagedwindow`` command line: ``report`` (oracle notebooks rendered to HTML) and ``bench`` (GPU benchmark)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedwindow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    report = sub.add_parser("report", help="run the oracle notebooks through papermill and render HTML")
    report.add_argument("--params", default="default",
                        help="parameter set: a name in notebooks/params (smoke, default, gemma4_12b) or a YAML path")
    report.add_argument("--out", default=None, help="report directory (default: reports/<params>)")
    report.add_argument("--notebooks", nargs="*", default=None, help="notebook names to run (default: all)")

    bench = sub.add_parser("bench", help="time pagedwindow against its peers on the Gemma-4 workloads (GPU): "
                                         "end-to-end, kernel and plan time")
    bench.add_argument("--out", default="benchmarks/results",
                       help="directory for <gpu>-<date>[-label].json, its table and plots")
    bench.add_argument("--workloads", nargs="*", default=None, help="workload names (default: all)")
    bench.add_argument("--systems", nargs="*", default=None, help="systems to time (default: all)")
    bench.add_argument("--sweep", action="store_true", help="also sweep kv length and window")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    bench.add_argument("--cta-tile-q", type=int, default=None,
                       help="force the plans' query tile (16, 64, 128; default: each plan's own choice)")
    bench.add_argument("--label", default=None, help="suffix of the result files (a kernel variant's name)")

    args = parser.parse_args(argv)
    if args.command == "report":
        from .report import run_report

        return run_report(params=args.params, out=args.out, notebooks=args.notebooks)
    from .bench import run_bench

    return run_bench(out=args.out, workloads=args.workloads, systems=args.systems, sweep=args.sweep,
                     quick=args.quick, cta_tile_q=args.cta_tile_q, label=args.label)


if __name__ == "__main__":
    sys.exit(main())
