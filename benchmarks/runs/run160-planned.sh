#!/usr/bin/env bash
# Planned call 160 (not run: no device machine started on 2026-12-07). To run it from the repository root:
#   rm -rf ab && mkdir -p ab/new && git archive HEAD | tar -x -C ab/new
#   (cd ab/new && patch -p1 < ../../benchmarks/patches/decode-merge-grid-multi-row-tiles.patch)
#   device call: bash benchmarks/runs/run160-planned.sh, carrying .whl/peer-site.tar.xz
#   (on a short budget: LIMIT=<seconds> SUITE_S=<seconds per suite part>; results are tarred after each stage;
#   RUN=<number> names the results)
# One call. On an H200: the closing set of issues 13 and 11 on main's tree (the whole GPU suite with memcheck and
# racecheck beside it, the prep bars, the default-plan bench against fa2/fa3, the decode sweep against fa2/fa3).
# On an H100: tiles of more than 2 rows merged by the merge grid (benchmarks/patches/
# decode-merge-grid-multi-row-tiles.patch, applied to a copy of main in ab/new) against main at N=16 and N=4; the
# whole GPU suite with memcheck and racecheck on the patched tree; main's default plan against fa2/fa3 on the
# speculative sweep (plan_ms, e2e); the patch at tile 16 on the b4/b8 points.
set -uo pipefail
R=$OUT/r; mkdir -p $R
trap 'tar -czf $OUT/all.tar.gz -C $OUT r' EXIT
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 PAGEDWINDOW_REQUIRE_GPU=1 PAGEDWINDOW_CACHE_DIR=/tmp/pwc
T0=$(date +%s)
LIMIT=${LIMIT:-585}
RUN=${RUN:-160}  # the call's number, in the results' labels
SUITE_S=${SUITE_S:-300}  # seconds each suite part may take on the H200 (lower it with LIMIT on a short budget)
ROOT=$PWD
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
stamp() { echo "$1 done at $(( $(date +%s) - T0 ))s" | tee -a $R/times.txt; tar -czf $OUT/all.tar.gz -C $OUT r; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $R/gpu.txt
mkdir -p /tmp/site && tar -xJf .whl/peer-site.tar.xz -C /tmp/site
SITE=/tmp/site
suite() {  # $1: tree root (its src/ on PYTHONPATH, its tests/ collected); $2: seconds each part may take
  cd $1
  PYTHONPATH=$1/src:$SITE python3 -m pagedwindow doctor --build > $R/doctor.txt 2>&1; echo "doctor rc $?" >> $R/doctor.txt
  PYTHONPATH=$1/src:$SITE python3 -m pytest --collect-only -q -m cuda -p no:cacheprovider tests \
    --ignore=tests/test_notebooks.py --ignore=tests/test_notebook_params.py 2>/dev/null | grep '::' > /tmp/ids.txt
  wc -l < /tmp/ids.txt > $R/nids.txt
  split -n r/12 /tmp/ids.txt /tmp/part.
  for f in /tmp/part.*; do
    [ -s "$f" ] || continue
    i=${f##*.}; cp -r /tmp/pwc /tmp/pwc-$i
    ( mapfile -t ids < "$f"
      PYTHONPATH=$1/src:$SITE PAGEDWINDOW_CACHE_DIR=/tmp/pwc-$i timeout $2 python3 -m pytest -q -m cuda \
        -p no:cacheprovider "${ids[@]}" > $R/suite-$i.txt 2>&1; echo "rc $?" >> $R/suite-$i.txt ) &
  done
  cp -r /tmp/pwc /tmp/pwc-mc
  ( PYTHONPATH=$1/src PAGEDWINDOW_CACHE_DIR=/tmp/pwc-mc timeout $2 compute-sanitizer --tool memcheck --error-exitcode 9 \
      python3 benchmarks/memcheck_case.py > $R/memcheck.txt 2>&1; echo "rc $?" >> $R/memcheck.txt
    PYTHONPATH=$1/src PAGEDWINDOW_CACHE_DIR=/tmp/pwc-mc timeout $2 compute-sanitizer --tool racecheck --error-exitcode 9 \
      python3 benchmarks/memcheck_case.py > $R/racecheck.txt 2>&1; echo "rc $?" >> $R/racecheck.txt ) &
  cd $ROOT
}
suite_summary() {
  tail -n 1 $R/doctor.txt; cat $R/nids.txt
  for f in $R/suite-*.txt; do tail -n 2 $f | tr '\n' ' '; echo; done
  grep -h "^FAILED" $R/suite-*.txt | head -8; tail -n 2 $R/memcheck.txt $R/racecheck.txt
}
if grep -q H200 $R/gpu.txt; then
  ( PYTHONPATH=$PYTHONPATH:$SITE PAGEDWINDOW_CACHE_DIR=/tmp/pwc-warm timeout $(( SUITE_S + 100 )) python3 -m pagedwindow.cli bench --quick \
     --systems flashinfer_fa2 flashinfer_fa3 --workloads chunk_2048_on_6144 decode_64x4096 decode_b1_kv32768_w-1 --out /tmp/warm > $R/fi-warm.txt 2>&1
    PYTHONPATH=$PYTHONPATH:$SITE PAGEDWINDOW_CACHE_DIR=/tmp/pwc-warm timeout 300 python3 -m pagedwindow.cli bench --prep \
     --quick --systems flashinfer --workloads prep_decode_64x1 --out /tmp/warm >> $R/fi-warm.txt 2>&1
    echo "warm rc $? at $(( $(date +%s) - T0 ))s" >> $R/fi-warm.txt ) &
  WARM=$!
  suite $ROOT $SUITE_S
  for j in $(jobs -p); do [ "$j" = "$WARM" ] || wait $j; done
  stamp suite
  wait $WARM
  export PYTHONPATH=$PYTHONPATH:$SITE
  timeout $(left) python3 -m pagedwindow.cli bench --prep --label run$RUN --workloads prep_8192 prep_decode_64x1 \
    --out $R/res > $R/prep.txt 2>&1; echo "rc $?" >> $R/prep.txt; stamp prep
  timeout $(left) python3 -m pagedwindow.cli bench --label run$RUN --systems pagedwindow flashinfer_fa2 flashinfer_fa3 \
    --out $R/res > $R/bench.txt 2>&1; echo "rc $?" >> $R/bench.txt; stamp bench
  timeout $(left) python3 -m pagedwindow.cli bench --decode-sweep --quick --label run$RUN-decode-sweep \
    --systems pagedwindow flashinfer_fa2 flashinfer_fa3 --out $R/res > $R/dsweep.txt 2>&1; echo "rc $?" >> $R/dsweep.txt
  stamp dsweep
  echo "=== summary"; cat $R/gpu.txt; suite_summary; tail -n 1 $R/fi-warm.txt
  grep -E "^\| prep_.*(pass|fail)" $R/prep.txt
  grep -E "^\| (prefill|chunk|decode|prompts)" $R/bench.txt | grep -E "pagedwindow" | cut -c1-160
  grep -E "slower|below|points" $R/dsweep.txt | tail -n 5; cat $R/times.txt
  exit 0
fi
NEW=$ROOT/ab/new/src
timeout 170 python3 benchmarks/variant_ab.py --variant main: --variant n16:-DPW_DECODE_GRID_MERGE_MULTI_ROW_SPLITS=16 \
  --variant n4: --src n16=$NEW --src n4=$NEW --rounds 2 --workloads sweep_spec_b1_n4_c4096_p16_w1023 \
  sweep_spec_b1_n8_c4096_p16_w1023 sweep_spec_b2_n8_c4096_p16_w1023 sweep_spec_b4_n4_c4096_p16_w1023 \
  decode_b1_kv4096_w1023 decode_b4_kv4096_w1023 decode_64x4096 --json $R/ab.json > $R/ab.txt 2>&1
echo "rc $?" >> $R/ab.txt; stamp ab
suite $ROOT/ab/new 240
wait; stamp suite
WL=""
for n in 4 8 16; do for b in 1 2 4 8 16; do WL="$WL sweep_spec_b${b}_n${n}_c4096_p16_w1023"; done; done
for b in 1 2 4 8 16; do WL="$WL sweep_spec_b${b}_n8_c240_p16_w1023"; done
PYTHONPATH=$PYTHONPATH:$SITE timeout $(( $(left) - 20 )) python3 -m pagedwindow.cli bench --quick \
  --label run$RUN-spec --systems pagedwindow flashinfer_fa2 flashinfer_fa3 --workloads $WL --out $R/res > $R/spec.txt 2>&1
echo "rc $?" >> $R/spec.txt; stamp spec
timeout $(( $(left) - 5 )) python3 benchmarks/variant_ab.py --variant n16:-DPW_DECODE_GRID_MERGE_MULTI_ROW_SPLITS=16 \
  --variant n4: --src n16=$NEW --src n4=$NEW --rounds 2 --cta-tile-q 16 --workloads sweep_spec_b4_n8_c4096_p16_w1023 \
  sweep_spec_b8_n8_c4096_p16_w1023 --json $R/ab16.json > $R/ab16.txt 2>&1
echo "rc $?" >> $R/ab16.txt; stamp ab16
echo "=== summary"; cat $R/gpu.txt $R/times.txt; grep -A10 "^| workload" $R/ab.txt | cut -c1-200; tail -n 2 $R/ab.txt
suite_summary
grep -E "^- |slower" $R/spec.txt | head -30; tail -n 1 $R/spec.txt
grep -A4 "^| workload" $R/ab16.txt | cut -c1-200; tail -n 2 $R/ab16.txt
