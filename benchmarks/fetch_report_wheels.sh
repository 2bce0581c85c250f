#!/usr/bin/env bash
# Download the wheels the GPU machine needs for `pagedwindow report` (benchmarks/report-wheels.txt) into
# .report-wheels/, as CPython 3.12 x86_64 Linux wheels (that machine's Python). About 20 MB; carry it to the
# device next to the tree and run benchmarks/device_report.sh there. Usage: bash benchmarks/fetch_report_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-.report-wheels}
mkdir -p "$DEST"
python3 -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any \
  -r benchmarks/report-wheels.txt -d "$DEST"
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST"
