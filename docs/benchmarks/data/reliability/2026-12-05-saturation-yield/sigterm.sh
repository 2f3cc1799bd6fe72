#!/usr/bin/env bash
# SIGTERM of the students' scheduler and of the gateway at twice the capacity, 30 s runs: the workers yielding
# while saturated (ACADEMUS_SATURATED_NICE=10, the default) against equal shares (0), order alternating.
# Usage: bash sigterm.sh ROUNDS OUTDIR  (from the repository root, real students distilled)
set -u
rounds=$1; out=$2
for r in $(seq 0 $((rounds - 1))); do
  if (( r % 2 == 0 )); then arms="10 0"; else arms="0 10"; fi
  for nice in $arms; do
    d=$out/saturated$nice-r$r; mkdir -p "$d"
    ACADEMUS_SATURATED_NICE=$nice timeout 1200 python -m academus.loadgen.chaos_bench \
      --faults scheduler-term,gateway-term --duration 30 --out "$d" > "$d/out.txt" 2>&1
  done
done
