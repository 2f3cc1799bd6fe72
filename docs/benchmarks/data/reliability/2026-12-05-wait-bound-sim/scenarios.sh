#!/bin/bash
# The wait bound on the simulated clock (python -m academus.loadgen.wait_bound_sim, 1 s bound, sentiment's
# lengths, `due_first`): batches as fast as the `null` model's on this machine (one group, a full batch of 12 ms
# beyond 1 ms of overhead) against the default scenario's (two groups, 200 ms beyond 20 ms), with and without
# stalls (a share of the batches taking FACTOR times their time) and log-normal jitter. One JSON line a run.
#   bash scenarios.sh > scenarios.jsonl
FAST="--groups 1 --full-batch-ms 12 --overhead-ms 1 --duration 20"
SLOW="--duration 60"
run() {
    python -m academus.loadgen.wait_bound_sim --seeds 2 "${@:2}" | tail -1 | python3 -c "
import json, sys
d = json.load(sys.stdin)
for seed, x in enumerate(d['arms']['due_first']):
    print(json.dumps({'scenario': '$1', 'seed': seed, 'rate_rps': d['rate_rps'], **{k: x[k] for k in (
        'answered_rps', 'refused', 'wait_p50_s', 'wait_p99_s', 'over_bound', 'over_twice_bound')}}))"
}
run "fast, load 0.7, stalls 1% x10" $FAST --load 0.7 --stalls 0.01:10
run "fast, load 2" $FAST --load 2
run "fast, load 2, jitter 0.3" $FAST --load 2 --jitter 0.3
run "fast, load 2, stalls 1% x10" $FAST --load 2 --stalls 0.01:10
run "slow, load 2" $SLOW --load 2
run "slow, load 2, jitter 0.3" $SLOW --load 2 --jitter 0.3
run "slow, load 2, stalls 2% x5" $SLOW --load 2 --stalls 0.02:5
