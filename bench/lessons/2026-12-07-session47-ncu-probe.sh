#!/usr/bin/env bash
# ncu of the peer-lead cases (needs the in-place build). One text report per case in $OUT/ncu.
set -uo pipefail
mkdir -p "$OUT/ncu"
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"  # bench/ and the Liger wheel gpu_check.sh installed
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct
for c in ${NCU_CASES:-softmax_bwd log_softmax_bwd ln_fwd_4096 ln_fwd_1024 rms_fwd_32768}; do
  echo "== ncu $c ($(date +%T))"
  timeout 80 ncu --profile-from-start off --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --metrics "$metrics" \
    python3 bench/lessons/2026-12-07-session47-ncu-probe.py "$c" >"$OUT/ncu/$c.txt" 2>&1
  grep -E "^  [A-Za-z_].*\(|gpu__time|dram__bytes|lts__t_sector|DRAM Throughput|Duration|Registers Per|Block Size|Grid Size|Dynamic Shared|Cluster Size|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Stall|==PROF==|rror" "$OUT/ncu/$c.txt" | head -150
done
