#!/usr/bin/env bash
# Twice the capacity for 40 s with every service's stall tracer at 30 ms: the workers yielding while saturated
# (ACADEMUS_SATURATED_NICE=10, the default) against equal shares (0), order alternating.
# Usage: bash ab.sh ROUNDS OUTDIR  (from the repository root, real students distilled)
set -u
rounds=$1; out=$2; tools=$(dirname "$0")/../2026-12-05-loop-stalls
for r in $(seq 0 $((rounds - 1))); do
  if (( r % 2 == 0 )); then arms="10 0"; else arms="0 10"; fi
  for nice in $arms; do
    d=$out/saturated$nice-r$r; mkdir -p "$d"
    python3 "$tools/steal.py" 230 "$d/steal.jsonl" &
    ACADEMUS_LOOP_STALL_MS=30 ACADEMUS_SATURATED_NICE=$nice timeout 900 python -m academus.loadgen.chaos_bench \
      --faults none --duration 40 --out "$d" > "$d/out.txt" 2>&1
    wait
  done
done
