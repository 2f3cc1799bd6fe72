#!/usr/bin/env bash
# A hung worker or scheduler under load with a hang check on (the defaults) and off (SETTING=0), on fresh meshes,
# the arms' order alternating between rounds. The caller's environment reaches the mesh
# (ACADEMUS_ADAPT_INTERVAL_S=3600 holds the student number).
#   bash hang_ab.sh ROUNDS OUT FAULT SETTING [chaos_bench options...]
#   FAULT: worker-freeze or scheduler-freeze; SETTING: ACADEMUS_WORKER_HANG_S or ACADEMUS_SCHEDULER_HANG_S
set -euo pipefail
rounds=$1 out=$2 fault=$3 setting=$4
shift 4
mkdir -p "$out"
for ((r = 0; r < rounds; r++)); do
    if ((r % 2 == 0)); then order="on off"; else order="off on"; fi
    for name in $order; do
        echo "round $r: $name"
        if [[ $name == on ]]; then
            python -m academus.loadgen.chaos_bench --faults "$fault" --out "$out/$name-$r" "$@" > "$out/$name-$r.log" 2>&1
        else
            env "$setting=0" python -m academus.loadgen.chaos_bench --faults "$fault" --out "$out/$name-$r" "$@" \
                > "$out/$name-$r.log" 2>&1
        fi
        grep -E "^(reference|$fault) " "$out/$name-$r.log"
    done
done
