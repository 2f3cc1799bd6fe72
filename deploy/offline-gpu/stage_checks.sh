#!/bin/bash
# Here, where `academus prepare` and `academus ramps train --task spam|sentiment` have run: stage the in-process
# GPU checks (early exits, `loadgen.exits_device`; STI, `loadgen.sti_device`) as two payloads that each fit the
# 64 MiB a device transfer carries beside the tree:
#   .gpuA        : the teacher (fp16), alone;
#   .whl + .gpuB : the wheels the node's image lacks, both tasks' data slimmed, the heads and the ramps.
# Call A (`checks.sh A`) puts the teacher in /tmp; call B (`checks.sh B`), on the machine A left warm, installs
# the rest and runs the checks. The shard artifact is built there (`shard build --quick`): it does not fit.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
HERE=deploy/offline-gpu
source $HERE/wheels.sh
rm -rf .whl .gpuA .gpuB && mkdir -p .whl .gpuA .gpuB
download_wheels .whl
teacher=$($PY -c "from academus.shared.models.model import teacher_dir; print(teacher_dir())")
$PY $HERE/pack.py teacher "$teacher" .gpuA
$PY $HERE/pack.py sentiment-data "${ACADEMUS_DATA_DIR:-.academus/data}" .gpuB
$PY $HERE/pack.py spam-data "${ACADEMUS_DATA_DIR:-.academus/data}" .gpuB
$PY $HERE/pack.py artifacts "${ACADEMUS_ARTIFACTS:-.academus/artifacts}" .gpuB --keep heads,ramps,models.json
du -sh .whl .gpuA .gpuB
