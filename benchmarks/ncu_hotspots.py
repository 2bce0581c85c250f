"""Where a kernel's warps stall, per SASS instruction, from an Nsight Compute report.

``python3 benchmarks/ncu_hotspots.py source.csv[.gz] [N] [--per UNITS]`` reads the CSV that
``ncu -i REPORT --page source --csv --print-source sass`` writes, and prints the N instructions (default 40) with
the most warp-stall samples, in address order, with each one's share of all samples, plus the share of samples
on each kind of instruction (tensor-core GEMMs, barriers, async copies, ...). With ``--per UNITS``, it prints
instead the warp instructions executed per unit of work (e.g. the prep kernel's tokens) by opcode.
"""

import csv
import gzip
import re
import sys
from collections import Counter

KINDS = (  # first match wins: (kind, regex on the SASS text)
    ("wgmma (HGMMA)", r"\bHGMMA\b"),
    ("wgmma wait (WARPGROUP.DEPBAR/ARRIVE)", r"\bWARPGROUP\."),
    ("mbarrier (SYNCS)", r"\bSYNCS\."),
    ("named barrier (BAR)", r"\bBAR\."),
    ("cp.async (LDGSTS)", r"\bLDGSTS\b"),
    ("global load (LDG)", r"\bLDG\b"),
    ("global store (STG)", r"\bSTG\b"),
    ("shared load/store (LDS/STS)", r"\b(LDS|STS)\b"),
    ("shuffle (SHFL)", r"\bSHFL\b"),
    ("exp2 / rcp (MUFU)", r"\bMUFU\b"),
    ("branch (BRA/BSYNC/WARPSYNC)", r"\b(BRA|BSYNC|BSSY|WARPSYNC)\b"),
    ("other", r"."),
)


def read_rows(path):
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"') and "Source" in line)
    return list(csv.DictReader(lines[start:]))


def executed_per_unit(rows, units: float, top: int) -> None:
    """Warp instructions executed per unit of work, in total and by opcode (predicates dropped)."""
    by_opcode = Counter()
    for r in rows:
        text = re.sub(r"^@!?U?P\w+\s+", "", r.get("Source", "").strip())
        by_opcode[text.split()[0] if text else "?"] += int(r.get("Instructions Executed") or 0)
    print(f"{sum(by_opcode.values()) / units:.1f} warp instructions executed per unit ({units:g} units)")
    for opcode, n in by_opcode.most_common(top):
        print(f"  {n / units:8.1f}  {opcode}")


def main() -> int:
    args = sys.argv[1:]
    units = None
    if "--per" in args:
        i = args.index("--per")
        units = float(args[i + 1])
        del args[i : i + 2]
    path = args[0]
    top = int(args[1]) if len(args) > 1 else 40
    rows = read_rows(path)
    if units is not None:
        executed_per_unit(rows, units, top)
        return 0
    col = next(c for c in rows[0] if c.startswith("Warp Stall Sampling (All"))
    samples = [(float(r[col] or 0), r) for r in rows]
    total = sum(s for s, _ in samples) or 1.0
    kinds = Counter()
    for s, r in samples:
        text = r.get("Source", "")
        kinds[next(k for k, rx in KINDS if re.search(rx, text))] += s
    print(f"{len(rows)} instructions, {total:.0f} stall samples")
    for kind, s in kinds.most_common():
        print(f"  {100 * s / total:5.1f} %  {kind}")
    print(f"\ntop {top} instructions by samples (address order):")
    best = sorted(samples, key=lambda x: -x[0])[:top]
    for s, r in sorted(best, key=lambda x: int(x[1].get("Address", "0"), 16) if x[1].get("Address") else 0):
        print(f"  {r.get('Address', ''):>8} {100 * s / total:5.1f} %  {r.get('Source', '')[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
