#!/usr/bin/env bash
# One call on the GPU machine: build the kernels, run the GPU suite, memcheck, the error table, the benchmark;
# a short table last. Usage (repository root, on the device): bash benchmarks/device_run.sh [pytest paths...]
# Env: SUITE_PARTS=N runs the whole GPU suite as N processes at once (no pytest paths given; 12 on 16 cores);
# SKIP_SUITE / SKIP_MMA_SYNC_SUITE / SKIP_MEMCHECK / SKIP_BENCH / SKIP_HOST_COST=1 skip a step; BENCH_ARGS adds bench flags,
# HOST_COST_ARGS host_cost.py flags. FlashInfer comes from .whl/peer-site.tar.xz (benchmarks/pack_peer_site.sh: the
# wheels installed and xz-packed, 19 MB, so the tree fits beside it in one call) or else from .whl/*.whl;
# VARIANTS="label:VAR=value,VAR=value:tile ..." times pagedwindow alone for each kernel variant (environment, e.g.
# PAGEDWINDOW_PREFILL_KERNEL or PAGEDWINDOW_NVCC_FLAGS, and plan tile) after the main bench.
# PREP_BENCH=1 adds a step after the bench (off by default; independent of SKIP_BENCH): the Gemma prep suite,
# `bench --prep` (prepare_paged_qkv against HF's torch ops + append and FlashInfer's rmsnorm/rope/append), with
# PREP_BENCH_ARGS its flags (e.g. "--quick" or "--workloads prep_8192"); its <gpu>-<date>-prep.json/.md/-bandwidth.png
# land in $OUT. Only the prep: SKIP_MMA_SYNC_SUITE=1 SKIP_MEMCHECK=1 SKIP_BENCH=1 SKIP_HOST_COST=1 PREP_BENCH=1
# bash benchmarks/device_run.sh tests/test_bench_prep.py (the suite step then runs that file's GPU test only).
# DECODE_SWEEP=1 adds a last step: `bench --decode-sweep --quick` (DECODE_SWEEP_ARGS its flags, e.g. "--systems
# pagedwindow flashinfer_fa2"), its <gpu>-<date>-decode-sweep.json/.md in $OUT.
# PLAN_FORMS=1 adds a step after the host cost: planning by CSR form against FlashInfer fa2's plan, interleaved,
# at every batch shape of the sweep (`benchmarks/plan_profile.py --forms --shapes sweep`; PLAN_FORMS_ARGS adds
# flags), its rows in $OUT/<gpu>-<date>-plan-forms.json.
# AB_ARGS="--variant main: --src main=ab/main/src --variant new: --workloads ... --rounds 4" runs variant_ab.py first
# (before anything else loads the GPU), its JSON in $OUT/ab.json; unpack the base tree beside this one before the
# call (git archive <base> src kernels | tar -x -C ab/main: the device's copy of the tree may carry no history).
# Results: $OUT/log.txt, the main bench's JSON/MD, <gpu>-<date>-host-cost.json (named like the bench's files, after
# the GPU present), and every bench file in $OUT/bench.tar.gz; at the end every file under $OUT again in
# $OUT/all.tar.gz (a call brings back only so many files).
set -uo pipefail
OUT=${OUT:-/tmp/pw-out}
mkdir -p "$OUT"
LOG=$OUT/log.txt
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export PAGEDWINDOW_CACHE_DIR=/tmp/pagedwindow-cache PAGEDWINDOW_REQUIRE_GPU=1
if [ -f .whl/peer-site.tar.xz ]; then  # the peers' packages, installed here and packed small (pack_peer_site.sh)
  mkdir -p /tmp/site && tar -xJf .whl/peer-site.tar.xz -C /tmp/site && export PYTHONPATH=$PYTHONPATH:/tmp/site
elif ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
step() { echo; echo "### $*" | tee -a "$LOG"; }
echo "PAGEDWINDOW_NVCC_FLAGS='${PAGEDWINDOW_NVCC_FLAGS:-}' PAGEDWINDOW_PREFILL_KERNEL='${PAGEDWINDOW_PREFILL_KERNEL:-}'" \
  | tee -a "$LOG"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$LOG"
STEM=$(python3 -c "import datetime, torch; from pagedwindow.bench import result_stem
print(result_stem(torch.cuda.get_device_name(), datetime.date.today().isoformat()))")
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$LOG"

ab="skipped"
ta=$(date +%s)
if [ -n "${AB_ARGS:-}" ]; then
  step "A/B: python3 benchmarks/variant_ab.py $AB_ARGS"
  eval python3 benchmarks/variant_ab.py "$AB_ARGS" --json "$OUT/ab.json" 2>&1 | tee -a "$LOG" | tail -20
  ab="rc=${PIPESTATUS[0]}"
fi

step build
t0=$(date +%s)
python3 - <<'PY' 2>&1 | tee -a "$LOG"
import time, torch
from pagedwindow.cuda import build, ops
t = time.time(); lib = ops.library(torch.device("cuda")); print(f"built/loaded in {time.time() - t:.1f}s")
report = (build.build_shared_library("sm_90a").parent / "ptxas.txt").read_text()
for r in build.parse_ptxas_report(report):
    print(f"{r.function[:64]:64} regs {r.registers} stack {r.stack_frame} spill {r.spill_stores}/{r.spill_loads}")
PY
t1=$(date +%s)
suite="skipped"
if [ "${SKIP_SUITE:-0}" != 1 ]; then
  step "GPU suite: pytest -m cuda ${*:-tests}"
  # The notebooks' tests need papermill and nbformat, which the device lacks; device_report.sh runs the notebooks.
  paths=("$@")
  [ ${#paths[@]} -gt 0 ] || paths=(tests --ignore=tests/test_notebooks.py --ignore=tests/test_notebook_params.py)
  parts=${SUITE_PARTS:-1}
  if [ "$parts" -gt 1 ] && [ $# -eq 0 ]; then
    # The whole suite as $parts processes at once (12 on a 16-core machine: about 2 minutes instead of 12), its
    # test ids dealt round robin, each process loading the kernels built above from its own copy of the cache, so
    # that no two processes build into one directory. Ids hold spaces (parameters), so they travel as arrays.
    python3 -m pytest --collect-only -q -m cuda -p no:cacheprovider "${paths[@]}" 2>/dev/null | grep '::' \
      > /tmp/pw-suite-ids.txt
    echo "$(wc -l < /tmp/pw-suite-ids.txt) GPU tests over $parts processes" | tee -a "$LOG"
    rm -f /tmp/pw-suite-ids.part*
    split -n "r/$parts" -d -a 2 /tmp/pw-suite-ids.txt /tmp/pw-suite-ids.part
    pids=()
    files=()
    for f in /tmp/pw-suite-ids.part*; do
      [ -s "$f" ] || continue  # pytest given no ids would run every test: a part with none runs nothing
      i=${f##*.part}
      files+=("$OUT/suite-part$i.txt")
      rm -rf "$PAGEDWINDOW_CACHE_DIR-part$i"  # a copy left by an earlier run would nest this one inside it
      cp -r "$PAGEDWINDOW_CACHE_DIR" "$PAGEDWINDOW_CACHE_DIR-part$i"
      ( mapfile -t ids < "$f"
        PAGEDWINDOW_CACHE_DIR="$PAGEDWINDOW_CACHE_DIR-part$i" python3 -m pytest -q -m cuda -p no:cacheprovider \
          "${ids[@]}" > "$OUT/suite-part$i.txt" 2>&1 ) &
      pids+=($!)
    done
    suite=""
    [ ${#pids[@]} -gt 0 ] || suite="no GPU tests collected (rc=5)"
    for k in "${!pids[@]}"; do
      wait "${pids[$k]}"; rc=$?
      tail -1 "${files[$k]}" | tee -a "$LOG"
      suite="$suite part$k rc=$rc: $(grep -E '(passed|failed|error)' "${files[$k]}" | tail -1);"
    done
  else
    python3 -m pytest -q -m cuda -p no:cacheprovider --maxfail=5 "${paths[@]}" 2>&1 | tee -a "$LOG" | tail -25
    suite="rc=${PIPESTATUS[0]}: $(grep -E '(passed|failed|error)' "$LOG" | tail -1)"
  fi
  if [ "${SKIP_MMA_SYNC_SUITE:-0}" != 1 ]; then
    step "GPU kernel suite again on the mma.sync kernel: PAGEDWINDOW_PREFILL_KERNEL=mma_sync"
    PAGEDWINDOW_PREFILL_KERNEL=mma_sync python3 -m pytest -q -m cuda -p no:cacheprovider --maxfail=5 \
      tests/test_cuda_kernels.py 2>&1 | tee -a "$LOG" | tail -5
    suite="$suite; mma_sync rc=${PIPESTATUS[0]}: $(grep -E '(passed|failed|error)' "$LOG" | tail -1)"
  fi
fi
t2=$(date +%s)
memcheck="skipped"
if [ "${SKIP_MEMCHECK:-0}" != 1 ] && command -v compute-sanitizer >/dev/null; then
  step "compute-sanitizer --tool memcheck python3 benchmarks/memcheck_case.py"
  compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/memcheck_case.py 2>&1 | tee -a "$LOG" | tail -3
  memcheck="rc=${PIPESTATUS[0]}: $(grep -h 'ERROR SUMMARY' "$LOG" | tail -1)"
  step "kernel error table: python3 benchmarks/kernel_error_table.py"
  python3 benchmarks/kernel_error_table.py 2>&1 | tee -a "$LOG"
fi
t3=$(date +%s)
bench="skipped"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  BENCH=/tmp/pw-bench
  mkdir -p $BENCH
  step "python3 -m pagedwindow.cli bench --out $BENCH ${BENCH_ARGS:-}"
  python3 -m pagedwindow.cli bench --out $BENCH ${BENCH_ARGS:-} 2>&1 | tee -a "$LOG" | grep -E "^\||GPU:" | tail -30
  bench="rc=${PIPESTATUS[0]}"
  cp $BENCH/*-20[0-9][0-9]-[0-9][0-9]-[0-9][0-9]*.json $BENCH/*-20[0-9][0-9]-[0-9][0-9]-[0-9][0-9]*.md "$OUT"/ 2>/dev/null
  for v in ${VARIANTS:-}; do
    IFS=: read -r label assignments tile <<<"$v"
    step "variant $label: ${assignments//,/ } bench --systems pagedwindow --cta-tile-q $tile"
    env ${assignments//,/ } python3 -m pagedwindow.cli bench --systems pagedwindow --out $BENCH --label "$label" \
      ${tile:+--cta-tile-q $tile} 2>&1 | tee -a "$LOG" | grep -E "^\| [a-z]" | tail -8
  done
  tar -czf "$OUT/bench.tar.gz" -C $BENCH .
fi
t4=$(date +%s)
if [ "${PREP_BENCH:-0}" = 1 ]; then
  PREP_DIR=/tmp/pw-bench-prep
  mkdir -p $PREP_DIR
  step "python3 -m pagedwindow.cli bench --prep --out $PREP_DIR ${PREP_BENCH_ARGS:-}"
  python3 -m pagedwindow.cli bench --prep --out $PREP_DIR ${PREP_BENCH_ARGS:-} 2>&1 | tee -a "$LOG" \
    | grep -E "^\||GPU:|HBM copy" | tail -40
  prep="rc=${PIPESTATUS[0]}"
  cp $PREP_DIR/*-prep*.json $PREP_DIR/*-prep*.md $PREP_DIR/*-prep*.png "$OUT"/ 2>/dev/null
fi
t4p=$(date +%s)
host="skipped"
if [ "${SKIP_HOST_COST:-0}" != 1 ]; then
  step "host cost per call and plan build: python3 benchmarks/host_cost.py"
  python3 benchmarks/host_cost.py --json "$OUT/$STEM-host-cost.json" ${HOST_COST_ARGS:-} 2>&1 | tee -a "$LOG" | tail -8
  host="rc=${PIPESTATUS[0]}"
fi
forms="skipped"
if [ "${PLAN_FORMS:-0}" = 1 ]; then
  step "plan by CSR form: python3 benchmarks/plan_profile.py --forms --shapes sweep"
  python3 benchmarks/plan_profile.py --forms --shapes sweep --reps 100 --json "$OUT/$STEM-plan-forms.json" \
    ${PLAN_FORMS_ARGS:-} 2>&1 | tee -a "$LOG" | tail -6
  forms="rc=${PIPESTATUS[0]}"
fi
t5=$(date +%s)
sweep="skipped"
if [ "${DECODE_SWEEP:-0}" = 1 ]; then
  SWEEP_DIR=/tmp/pw-bench-decode-sweep
  mkdir -p $SWEEP_DIR
  step "python3 -m pagedwindow.cli bench --decode-sweep --quick --label decode-sweep ${DECODE_SWEEP_ARGS:-}"
  python3 -m pagedwindow.cli bench --decode-sweep --quick --label decode-sweep --out $SWEEP_DIR \
    ${DECODE_SWEEP_ARGS:-} 2>&1 | tee -a "$LOG" | grep -E "^ *decode_b" | tail -100
  sweep="rc=${PIPESTATUS[0]}"
  cp $SWEEP_DIR/*-decode-sweep* "$OUT"/ 2>/dev/null
fi
t6=$(date +%s)
echo
echo "| step | result | seconds |"
echo "|---|---|---|"
if [ -n "${AB_ARGS:-}" ]; then echo "| A/B | $ab | $((t0 - ta)) |"; fi
echo "| build | $(grep -h 'built/loaded' "$LOG" | tail -1) | $((t1 - t0)) |"
echo "| GPU suite (-m cuda, REQUIRE_GPU=1) | $suite | $((t2 - t1)) |"
echo "| memcheck + error table | $memcheck | $((t3 - t2)) |"
echo "| bench | $bench | $((t4 - t3)) |"
if [ "${PREP_BENCH:-0}" = 1 ]; then echo "| prep bench | $prep | $((t4p - t4)) |"; fi
echo "| host cost, plan forms | $host; $forms | $((t5 - t4p)) |"
if [ "${DECODE_SWEEP:-0}" = 1 ]; then echo "| decode sweep | $sweep | $((t6 - t5)) |"; fi
tar -czf "$OUT/all.tar.gz" -C "$OUT" --exclude all.tar.gz . 2>/dev/null || true
