#!/usr/bin/env bash
# A hung worker under load, the checkout's scheduler (which gives up a departed worker's batches) against OLD's, on
# fresh meshes, the arms' order alternating between rounds. OLD: a tree laid out as the `academus` package
# (a directory holding `academus` -> the commit's worktree); its arm runs the bench, the mesh's launcher and the
# services it forks from it.
#   bash freeze_ab.sh ROUNDS OUT OLD [chaos_bench options...]
set -euo pipefail
rounds=$1 out=$2 old=$3
shift 3
mkdir -p "$out"
for ((r = 0; r < rounds; r++)); do
    if ((r % 2 == 0)); then order="new old"; else order="old new"; fi
    for name in $order; do
        if [[ $name == new ]]; then path=""; else path=$old; fi
        echo "round $r: $name"
        PYTHONPATH=$path python -m academus.loadgen.chaos_bench --faults worker-freeze --out "$out/$name-$r" "$@" \
            > "$out/$name-$r.log" 2>&1
        grep -E "^(reference|worker-freeze) " "$out/$name-$r.log"
    done
done
