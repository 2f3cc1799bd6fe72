#!/bin/bash
# GPU node, the in-process checks staged by stage_checks.sh, in two calls on one warm machine:
#   bash deploy/offline-gpu/checks.sh A     (carry .gpuA)        the teacher into /tmp/gpuA
#   bash deploy/offline-gpu/checks.sh B     (carry .whl, .gpuB)  wheels, data, heads and ramps; then the checks
# B runs early exits (`exits_device`, padded batches, vanilla against the tuned ramps: spam and sentiment at
# batches of 32 and 8), builds a quick shard artifact for sentiment and runs `sti_device` (compute against width,
# shards streamed from pinned memory). After each check $OUT holds checks.log, summary.jsonl (each check's
# last line) and logs.tgz (every check's output): the tool brings back at most 8 files, even on a timeout.
# CHECKS="exits" or "sti" runs one kind (default both). LOCAL=1 LOCAL_TEACHER=DIR runs B here on the CPU, without the installs, as a dry run.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/checks-out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/checks.log") 2>&1
date -u
if [ "${1:-}" = A ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
  rm -rf /tmp/gpuA && mkdir -p /tmp/gpuA && cp -r .gpuA/teacher .gpuA/narrowed.json /tmp/gpuA/ || exit 5
  touch /tmp/gpuA/ready; du -sh /tmp/gpuA; date -u; exit 0
fi
[ -n "${LOCAL:-}" ] || [ -f /tmp/gpuA/ready ] || { echo "call A's teacher is not on this machine (a fresh one): run A again"; exit 2; }
[ -n "${LOCAL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 3
rm -rf /tmp/gpuB && mkdir -p /tmp/gpuB /tmp/gpuA && cp -r .gpuB/artifacts /tmp/gpuB/ && rm -rf /tmp/gpuA/data \
  && cp -r .gpuB/data /tmp/gpuA/ || exit 5
source deploy/offline-gpu/env.sh
if [ -n "${LOCAL:-}" ]; then
  export ACADEMUS_TEACHER_DIR=${LOCAL_TEACHER:?} PYTHONPATH=/tmp/ns; DEVICE=cpu; PY=${PY:-.venv/bin/python}
else
  python3 deploy/offline-gpu/pack.py unpack /tmp/gpuA || exit 7; DEVICE=cuda; PY=python3
fi
export ACADEMUS_LAUNCHER=off
[ -n "${LOCAL:-}" ] || (cc -O3 -fPIC -shared -pthread -Wall -o shared/models/native/libshard_put.so \
  shared/models/native/shard_put.c && echo "C loader built") || echo "no C loader: NumPy decodes"
$PY -c "import torch, grpc; print('torch', torch.__version__, 'grpc', grpc.__version__, 'cuda', torch.cuda.is_available())"
LOGS=/tmp/gpu/checks; rm -rf $LOGS; mkdir -p $LOGS
check() {   # NAME SECONDS COMMAND...: its output to NAME.log in logs.tgz, its last line (JSON) to summary.jsonl
  local name=$1 seconds=$2; shift 2
  echo "== $(date -u +%T) $name: $*"
  timeout "$seconds" "$@" > "$LOGS/$name.log" 2>&1; local rc=$?
  echo "rc=$rc $(date -u +%T)"; tail -c 600 "$LOGS/$name.log"; echo
  tail -n 1 "$LOGS/$name.log" | grep '^{' | sed "s/^{/{\"check\": \"$name\", \"rc\": $rc, /" >> "$OUT/summary.jsonl"
  tar czf "$OUT/logs.tgz" -C /tmp/gpu checks
}
WARM=${WARM:-1024}; BATCHES=${BATCHES:-20}; ROUNDS=${ROUNDS:-3}
exits() {   # TASK BATCH
  check "exits-$1-b$2" 120 $PY -m academus.loadgen.exits_device --device $DEVICE --task "$1" --batch "$2" \
    --batches "$BATCHES" --warm "$WARM" --rounds "$ROUNDS"
}
CHECKS=" ${CHECKS:-exits sti} "   # which to run
FIRST=${FIRST-spam:32 sentiment:32}; THEN=${THEN-spam:8 sentiment:8}   # exits' task:batch runs, before STI and after
if [[ $CHECKS == *" exits "* ]]; then for run in $FIRST; do exits "${run%:*}" "${run#*:}"; done; fi
if [[ $CHECKS == *" sti "* ]]; then
  check shard-build 150 $PY -m academus.shared.cli.main shard build --model minilm --tasks sentiment --quick
  check sti-device 120 $PY -m academus.loadgen.sti_device --repeats "${REPEATS:-50}" --out $LOGS
fi
if [[ $CHECKS == *" exits "* ]]; then for run in $THEN; do exits "${run%:*}" "${run#*:}"; done; fi
date -u
