#!/usr/bin/env bash
# A hung worker under load with the resource manager's hang check on (the defaults) and off
# (ACADEMUS_WORKER_HANG_S=0: the heartbeat's TTL drops it), on fresh meshes, the arms' order alternating between
# rounds. The caller's environment reaches the mesh (ACADEMUS_ADAPT_INTERVAL_S=3600 holds the student number).
#   bash hang_ab.sh ROUNDS OUT [chaos_bench options...]
set -euo pipefail
rounds=$1 out=$2
shift 2
mkdir -p "$out"
for ((r = 0; r < rounds; r++)); do
    if ((r % 2 == 0)); then order="on off"; else order="off on"; fi
    for name in $order; do
        if [[ $name == on ]]; then hang=1.5; else hang=0; fi
        echo "round $r: $name"
        ACADEMUS_WORKER_HANG_S=$hang python -m academus.loadgen.chaos_bench --faults worker-freeze \
            --out "$out/$name-$r" "$@" > "$out/$name-$r.log" 2>&1
        grep -E "^(reference|worker-freeze) " "$out/$name-$r.log"
    done
done
