#!/bin/bash
# Two code versions on the mesh at a fixed rate past capacity, a fresh mesh a run, the order alternating:
#   bash mesh_ab.sh ROUNDS RATE OUT NAME=DIR NAME=DIR
# DIR/academus is a checkout of that version, put first on PYTHONPATH (the mesh's processes inherit it). Each run is
# `chaos_bench --faults none` (sentiment and its students, 30 s of Poisson RATE req/s); its summary goes to
# OUT/NAME-ROUND/. summarize.py OUT reads them.
set -euo pipefail
rounds=$1 rate=$2 out=$3
shift 3
arms=("$@")
for ((r = 0; r < rounds; r++)); do
    order=("${arms[@]}")
    if ((r % 2)); then order=("${arms[1]}" "${arms[0]}"); fi
    for arm in "${order[@]}"; do
        name=${arm%%=*} dir=${arm#*=}
        PYTHONPATH=$dir python -m academus.loadgen.chaos_bench --faults none --rate "$rate" --duration 30 \
            --out "$out/$name-$r" > "$out/$name-$r.txt" 2>&1
        echo "round $r: $name done" >&2
    done
done
