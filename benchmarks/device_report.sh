#!/usr/bin/env bash
# The oracle report on the GPU machine, in one call: install what it lacks from .report-wheels/ (made here by
# benchmarks/fetch_report_wheels.sh and carried), build the kernels, run `pagedwindow report --params gemma4_12b`
# (every notebook on backend cuda, 04 timing live), and pack it as $OUT/report.tar.gz (reports/<gpu>-<date>/).
# Usage (repository root, on the device): PAGEDWINDOW_COMMIT=<sha> bash benchmarks/device_report.sh [PARAMS]
# (default gemma4_12b; the device's copy of the tree has no .git, so the commit the banner names is passed in).
# A short table last; the whole log is $OUT/report-log.txt.
set -uo pipefail
PARAMS=${1:-gemma4_12b}
OUT=${OUT:-/tmp/pw-out}
mkdir -p "$OUT"
LOG=$OUT/report-log.txt
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export PAGEDWINDOW_CACHE_DIR=/tmp/pagedwindow-cache PAGEDWINDOW_REQUIRE_GPU=1
step() { echo; echo "### $*" | tee -a "$LOG"; }

step "environment: a venv over the system packages, with the report's wheels"
t0=$(date +%s)
VENV=/tmp/pw-report-venv
# torch may live outside the system site (a user site, a PYTHONPATH entry) that a venv does not see: name its
# directory on PYTHONPATH so the venv's pip counts what is there as installed
TORCH_SITE=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))") || exit 3
export PYTHONPATH=$PYTHONPATH:$TORCH_SITE
python3 -m venv --system-site-packages "$VENV" || exit 3
PY=$VENV/bin/python
$PY -m pip install -q --disable-pip-version-check --no-index --find-links .report-wheels \
  -r benchmarks/report-wheels.txt 2>&1 | tee -a "$LOG" || exit 3
$PY -m ipykernel install --sys-prefix --name python3 >/dev/null 2>&1 | tee -a "$LOG"
$PY -c "import papermill, nbconvert, torch, transformers; print('papermill', papermill.__version__, 'nbconvert',
nbconvert.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$LOG" \
  || exit 3
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
GPU=$($PY -c "import torch; from pagedwindow.bench import gpu_slug; print(gpu_slug(torch.cuda.get_device_name()))")
NAME=$GPU-$(date -u +%F)

step "build: the kernels for this GPU"
t1=$(date +%s)
$PY -m pagedwindow doctor --build 2>&1 | tee -a "$LOG"

step "pagedwindow report --params $PARAMS --out reports/$NAME"
t2=$(date +%s)
mkdir -p reports
# REPORT_TIMEOUT_S stops the report in time to pack what it has (the device's per-call limit)
timeout --signal=INT "${REPORT_TIMEOUT_S:-3600}" \
  $PY -m pagedwindow report --params "$PARAMS" --out "reports/$NAME" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
t3=$(date +%s)
tar -czf "$OUT/report.tar.gz" -C reports "$NAME" 2>&1 | tee -a "$LOG"
echo
echo "| step | result | seconds |"
echo "|---|---|---|"
echo "| environment | $(grep -h '^papermill' "$LOG" | tail -1) | $((t1 - t0)) |"
echo "| build (doctor --build) | $(grep -h 'loaded in' "$LOG" | tail -1); $(grep -h 'prefill kernel' "$LOG" | tail -1) | $((t2 - t1)) |"
echo "| report $PARAMS | rc=$rc, $(du -sh "reports/$NAME" | cut -f1) | $((t3 - t2)) |"
exit "$rc"
