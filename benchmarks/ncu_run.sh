#!/usr/bin/env bash
# Profile one pagedwindow launch with Nsight Compute (device machine, repository root, after device_run.sh has
# built the kernels): bash benchmarks/ncu_run.sh WORKLOAD TILE LABEL [KERNEL_REGEX]. WORKLOAD and TILE as
# benchmarks/profile_case.py takes them (TILE "default": the policy's); KERNEL_REGEX picks the kernel profiled
# (default pw_prefill; e.g. pw_decode, pw_prepare_qkv). Clocks are left as the card runs them. PW_SRC: the
# package directory to profile (default src; e.g. a prior version unpacked beside it).
# Writes $OUT/ncu-LABEL.txt (the sections), $OUT/ncu-LABEL-hotspots.txt (stall samples per instruction) and
# $OUT/ncu-LABEL-source.csv.gz (every SASS instruction with its executed count and samples). NCU_SAMPLING_INTERVAL:
# the warp-sampling period, 2^(5 + N) cycles (default auto; 0 for a kernel of a few microseconds).
set -uo pipefail
OUT=${OUT:-/tmp/pw-out}
export PYTHONPATH=${PW_SRC:-$PWD/src}${PYTHONPATH:+:$PYTHONPATH} PAGEDWINDOW_CACHE_DIR=${PAGEDWINDOW_CACHE_DIR:-/tmp/pagedwindow-cache}
rep=/tmp/ncu-$3
ncu --clock-control none --warp-sampling-interval "${NCU_SAMPLING_INTERVAL:-auto}" \
  --kernel-name "regex:${4:-pw_prefill}" --launch-skip 1 --launch-count 1 --import-source no \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section SchedulerStats --section WarpStateStats --section SourceCounters --section LaunchStats \
  -f -o "$rep" python3 benchmarks/profile_case.py "$1" "$2" >/dev/null 2>&1 || echo "ncu rc=$?"
ncu -i "$rep.ncu-rep" --print-details all > "$OUT/ncu-$3.txt" 2>&1
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "/tmp/ncu-$3-source.csv" 2>&1
python3 benchmarks/ncu_hotspots.py "/tmp/ncu-$3-source.csv" 45 > "$OUT/ncu-$3-hotspots.txt" 2>&1
gzip -c "/tmp/ncu-$3-source.csv" > "$OUT/ncu-$3-source.csv.gz"
grep -E "Duration|Issue Slots Busy|No Eligible|L2 Cache Throughput|L1/TEX Cache Throughput" "$OUT/ncu-$3.txt" | head -8
head -16 "$OUT/ncu-$3-hotspots.txt"
