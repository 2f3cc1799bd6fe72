#!/bin/bash
# GPU node, call B (carry .gpuB; on the machine call A left warm): the artifacts widened into /tmp/gpuB,
# then each "name|command" argument in turn, its output in /tmp/gpu/NAME.log. $OUT gets run_b.log and
# results.tgz, refreshed after each command (the device tool brings back at most 8 files, even on a timeout).
set -u
cd "$(dirname "$0")/../.."
exec > >(tee "$OUT/run_b.log") 2>&1
date -u
[ -f /tmp/gpuA/ready ] || { echo "call A's set-up is not on this machine (a fresh one): run call A again"; exit 2; }
rm -rf /tmp/gpuB && mkdir -p /tmp/gpuB && cp -r .gpuB/artifacts .gpuB/narrowed.json /tmp/gpuB/ || exit 5
source deploy/offline-gpu/env.sh
python3 deploy/offline-gpu/pack.py unpack /tmp/gpuB || exit 7
for spec in "$@"; do
  name=${spec%%|*}; cmd=${spec#*|}
  echo "== $(date -u +%T) $name: $cmd"
  eval "$cmd" > "/tmp/gpu/$name.log" 2>&1; echo "rc=$? $(date -u +%T)"; tail -c 1500 "/tmp/gpu/$name.log"; echo
  nvidia-cuda-mps-control <<< quit 2>/dev/null; sleep 1   # the next mesh's resource manager starts its own
  tar czf "$OUT/results.tgz" --exclude=traces --exclude='*.jsonl' -C /tmp gpu; ls -la "$OUT/results.tgz"
done
date -u
