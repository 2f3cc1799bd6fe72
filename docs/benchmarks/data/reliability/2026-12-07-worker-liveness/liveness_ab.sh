#!/usr/bin/env bash
# A lost worker's groups re-planned at once (on: the resource manager's liveness watch and the scheduler's wait
# for the re-plan, the defaults) against the heartbeat's TTL alone (off: ACADEMUS_WATCH_WORKERS=false,
# ACADEMUS_REGROUP_WAIT_S=0): `chaos_bench --faults worker-kill` on a fresh mesh an arm, ROUNDS rounds, the order
# alternating. Each run's summary.json goes under OUT/<round>-<arm>.
#   [ACADEMUS_ADAPT_INTERVAL_S=3600] liveness_ab.sh ROUNDS OUT [chaos_bench options...]
# With the adaptation held off the student number stays at its start, every group spanning both workers; with it
# on, whether the groups span both at the kill depends on where the load left the number.
set -euo pipefail
rounds=$1 out=$2
shift 2
for ((r = 0; r < rounds; r++)); do
  if ((r % 2 == 0)); then arms="on off"; else arms="off on"; fi
  for arm in $arms; do
    if [[ $arm == on ]]; then watch=true wait=1; else watch=false wait=0; fi
    ACADEMUS_WATCH_WORKERS=$watch ACADEMUS_REGROUP_WAIT_S=$wait python -m academus.loadgen.chaos_bench --faults worker-kill --out "$out/$r-$arm" "$@" \
      | grep -E '^(reference|worker-kill) ' || true
  done
done
python - "$out" <<'PY'
import json, pathlib, sys
rows = []
for path in sorted(pathlib.Path(sys.argv[1]).glob("*/summary.json")):
    run = json.loads(path.read_text())["runs"]["worker-kill"]
    rows.append((path.parent.name, run["sent"], run["failed"], run["lost"], run["recover_s"], run.get("errors", {})))
for name, sent, failed, lost, recover, errors in rows:
    print(f"{name:8} sent {sent:5} failed {failed:3} lost {lost} recover_s {recover} errors {errors}")
PY
