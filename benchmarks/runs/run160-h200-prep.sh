#!/usr/bin/env bash
# The closing set of issue 13 alone, for an H200 call on a short budget (run from the repository root, carrying
# .whl/peer-site.tar.xz): the build, the prep's and the Hugging Face oracle's CUDA tests (tests/hf -m cuda with the
# prep op's own CUDA tests) in parallel parts, then `bench --prep` on prep_8192 and prep_decode_64x1 against
# FlashInfer's three ops and HF's torch ops + append_paged_kv. LIMIT: seconds the whole script may take.
set -uo pipefail
R=$OUT/r; mkdir -p $R
trap 'tar -czf $OUT/all.tar.gz -C $OUT r' EXIT
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 PAGEDWINDOW_REQUIRE_GPU=1 PAGEDWINDOW_CACHE_DIR=/tmp/pwc
T0=$(date +%s)
LIMIT=${LIMIT:-280}
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
stamp() { echo "$1 done at $(( $(date +%s) - T0 ))s" | tee -a $R/times.txt; tar -czf $OUT/all.tar.gz -C $OUT r; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $R/gpu.txt
mkdir -p /tmp/site && tar -xJf .whl/peer-site.tar.xz -C /tmp/site
SITE=/tmp/site
python3 -m pagedwindow doctor --build > $R/doctor.txt 2>&1; echo "doctor rc $?" >> $R/doctor.txt; stamp build
python3 -m pytest --collect-only -q -m cuda -p no:cacheprovider tests/hf tests/test_cuda_prepare.py \
  tests/test_prepare_qkv.py tests/test_bench_prep.py 2>/dev/null | grep '::' > /tmp/ids.txt
wc -l < /tmp/ids.txt > $R/nids.txt
split -n r/8 /tmp/ids.txt /tmp/part.
for f in /tmp/part.*; do
  [ -s "$f" ] || continue
  i=${f##*.}; cp -r /tmp/pwc /tmp/pwc-$i
  ( mapfile -t ids < "$f"
    PYTHONPATH=$PYTHONPATH:$SITE PAGEDWINDOW_CACHE_DIR=/tmp/pwc-$i timeout $(( $(left) - 70 )) python3 -m pytest -q \
      -m cuda -p no:cacheprovider "${ids[@]}" > $R/tests-$i.txt 2>&1; echo "rc $?" >> $R/tests-$i.txt ) &
done
wait; stamp tests
PYTHONPATH=$PYTHONPATH:$SITE timeout $(( $(left) - 3 )) python3 -m pagedwindow.cli bench --prep --label run160-prep \
  --workloads prep_8192 prep_decode_64x1 --out $R/res > $R/prep.txt 2>&1; echo "rc $?" >> $R/prep.txt; stamp prep
echo "=== summary"; cat $R/gpu.txt; tail -n 1 $R/doctor.txt; cat $R/nids.txt
for f in $R/tests-*.txt; do tail -n 2 $f | tr '\n' ' '; echo; done
grep -h "^FAILED" $R/tests-*.txt | head -8
grep -E "^\| prep_.*(pass|fail)" $R/prep.txt; grep -E "prep_.*e2e" $R/prep.txt; cat $R/times.txt
