#!/usr/bin/env bash
# Twice the capacity for 40 s with every service's stall tracer at 30 ms, a worker setting at two values, order
# alternating; steal.py beside each run. Usage, from the repository root (real students distilled):
#   bash ab.sh ROUNDS OUTDIR [VARIABLE PREFIX ON OFF]
# By default the workers at ACADEMUS_COMPUTE_NICE=10 against 0, runs named nice10-rN, nice0-rN. From ba92591 a
# saturated worker yields in both arms unless ACADEMUS_SATURATED_NICE=0 is set (bfc1716's runs had no such setting).
set -u
rounds=$1; out=$2; var=${3:-ACADEMUS_COMPUTE_NICE}; prefix=${4:-nice}; on=${5:-10}; off=${6:-0}
here=$(dirname "$0")
for r in $(seq 0 $((rounds - 1))); do
  if (( r % 2 == 0 )); then arms="$on $off"; else arms="$off $on"; fi
  for value in $arms; do
    d=$out/$prefix$value-r$r; mkdir -p "$d"
    python3 "$here/steal.py" 230 "$d/steal.jsonl" &
    env ACADEMUS_LOOP_STALL_MS=30 "$var=$value" timeout 900 python -m academus.loadgen.chaos_bench \
      --faults none --duration 40 --out "$d" > "$d/out.txt" 2>&1
    wait
  done
done
