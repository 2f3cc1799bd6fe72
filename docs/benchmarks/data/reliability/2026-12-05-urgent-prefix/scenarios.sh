#!/bin/bash
# The wait bound on the simulated clock, before and after DAS counts a crowd of due texts (`_urgent`):
# python -m academus.loadgen.wait_bound_sim, 1 s bound, sentiment's lengths, both arms of the tool
# (`due_first` and DAS alone). Batches as fast as `null`'s (one group, 12 ms beyond 1 ms of overhead) and the
# default scenario's (two groups, 200 ms beyond 20 ms). The clock is simulated and the seeds fixed, so a
# version gives the same figures on every machine: the arms need no alternating.
#   PYTHONPATH=DIR bash scenarios.sh > OUT.jsonl   (DIR/academus: a checkout of the version to run)
FAST="--groups 1 --full-batch-ms 12 --overhead-ms 1 --duration 20"
SLOW="--duration 60"
run() {
    python -m academus.loadgen.wait_bound_sim --seeds 2 "${@:2}" | tail -1 | python3 -c "
import json, sys
d = json.load(sys.stdin)
for arm, runs in d['arms'].items():
    for seed, x in enumerate(runs):
        print(json.dumps({'scenario': '$1', 'arm': arm, 'seed': seed, 'rate_rps': d['rate_rps'], **{k: x[k] for k in (
            'answered_rps', 'refused', 'expired_after_admission', 'wait_p50_s', 'wait_p99_s', 'wait_max_s',
            'over_bound', 'over_twice_bound')}}), flush=True)"
}
run "fast, load 0.9" $FAST --load 0.9
run "fast, load 0.7, stalls 1% x10" $FAST --load 0.7 --stalls 0.01:10
run "fast, load 2" $FAST --load 2
run "fast, load 2, jitter 0.3" $FAST --load 2 --jitter 0.3
run "fast, load 2, stalls 1% x10" $FAST --load 2 --stalls 0.01:10
run "slow, load 0.9" $SLOW --load 0.9
run "slow, load 2" $SLOW --load 2
run "slow, load 2, jitter 0.3" $SLOW --load 2 --jitter 0.3
run "slow, load 2, stalls 2% x5" $SLOW --load 2 --stalls 0.02:5
