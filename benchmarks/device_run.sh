#!/usr/bin/env bash
# One call on the GPU machine: build the kernels, run the GPU suite, memcheck, benchmark; short table last.
# Usage (repository root, on the device): bash benchmarks/device_run.sh [pytest args...]
set -uo pipefail
OUT=${OUT:-/tmp/pw-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export PAGEDWINDOW_CACHE_DIR=/tmp/pagedwindow-cache PAGEDWINDOW_REQUIRE_GPU=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

t0=$(date +%s)
python3 - <<'PY' 2>&1 | tee "$OUT/build.txt"
import time, torch
from pagedwindow.cuda import build, ops
t = time.time(); lib = ops.library(torch.device("cuda")); print(f"built/loaded in {time.time() - t:.1f}s")
report = (build.build_shared_library("sm_90a").parent / "ptxas.txt").read_text()
for r in build.parse_ptxas_report(report):
    print(f"{r.function[:60]:60} regs {r.registers} stack {r.stack_frame} spill {r.spill_stores}/{r.spill_loads}")
PY
t1=$(date +%s)
python3 -m pytest -q -m cuda -p no:cacheprovider --junitxml="$OUT/gpu-junit.xml" "${@:-tests}" 2>&1 | tee "$OUT/gpu-tests.txt" | tail -40
suite_rc=${PIPESTATUS[0]}
t2=$(date +%s)
memcheck_rc=skipped
if [ "${SKIP_MEMCHECK:-0}" != 1 ] && command -v compute-sanitizer >/dev/null; then
  compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/memcheck_case.py > "$OUT/memcheck.txt" 2>&1
  memcheck_rc=$?
  tail -4 "$OUT/memcheck.txt"
fi
t3=$(date +%s)
bench_rc=skipped
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m pagedwindow.cli bench --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt" | grep -v "^Traceback\|^  " | tail -60
  bench_rc=${PIPESTATUS[0]}
fi
t4=$(date +%s)
echo
echo "| step | result | seconds |"
echo "|---|---|---|"
echo "| build | $(tail -n +1 "$OUT/build.txt" | head -1) | $((t1 - t0)) |"
echo "| GPU suite (-m cuda, REQUIRE_GPU=1) | rc=$suite_rc: $(tail -1 "$OUT/gpu-tests.txt") | $((t2 - t1)) |"
echo "| compute-sanitizer memcheck | rc=$memcheck_rc: $(grep -h 'ERROR SUMMARY' "$OUT/memcheck.txt" 2>/dev/null) | $((t3 - t2)) |"
echo "| bench | rc=$bench_rc | $((t4 - t3)) |"
