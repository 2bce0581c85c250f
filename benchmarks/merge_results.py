"""Merge bench results from runs on one GPU that timed different systems (e.g. FlashInfer fa3 in a later call,
when one call cannot carry the peers or run them all in its time limit) into one result, with the sweep summary
recomputed over every system.

``python3 benchmarks/merge_results.py --label sweep --out benchmarks/results A.json B.json``
"""

import argparse

from pagedwindow.bench import merge_results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="result JSON files of `pagedwindow bench`")
    parser.add_argument("--label", required=True, help="label of the merged result's file name")
    parser.add_argument("--out", default="benchmarks/results", help="directory of the merged result")
    args = parser.parse_args()
    print(f"wrote {merge_results(args.paths, args.out, args.label)}")


if __name__ == "__main__":
    main()
