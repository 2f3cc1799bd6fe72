#!/bin/bash
# The sequential path on one core against two: sequential_path.py (2026-12-02's script: the floors, then a fresh
# `fifo` and a fresh `concat` mesh, 1,500 sequential requests each) run whole under `taskset -c 0` (the launcher,
# the services it forks, the floors' processes and the client on one core) and plain, ROUNDS rounds, the order
# alternating.
#   bash one_core.sh ROUNDS
here=$(dirname "$0")
script="$here/../2026-12-02-726d4c6-sequential-path/sequential_path.py"
for r in $(seq 0 $(($1 - 1))); do
    if [ $((r % 2)) -eq 0 ]; then arms="one two"; else arms="two one"; fi
    for arm in $arms; do
        if [ "$arm" = one ]; then pin="taskset -c 0"; else pin=""; fi
        $pin python "$script" --rounds 1 --requests 1500 --out "$here/$arm-$r.json" > /dev/null
    done
done
