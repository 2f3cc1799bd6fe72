#!/bin/bash
# Here, on a CPU machine where `make prepare` and `academus distill --task sentiment` have run: stage what a
# GPU node with no network needs to serve and bench the sentiment deployments, as two payloads that each
# fit the 64 MiB a device transfer carries (teacher 45 MB and students 52 MB as fp16 do not fit together):
#   .whl  + .gpuA : the wheels the node's image lacks (pinned as this venv has them, for CPython 3.12),
#                   redis-server and its two libraries, the slimmed sentiment data, the teacher (fp16);
#   .gpuB         : the artifacts (heads, catalogue, sentiment students; fp16).
# Call A (run_a.sh) installs and widens into /tmp, which a warm machine keeps for call B (run_b.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
HERE=deploy/offline-gpu
source $HERE/wheels.sh
rm -rf .whl .gpuA .gpuB && mkdir -p .whl .gpuA/bin .gpuA/lib .gpuB
download_wheels .whl
redis=$(command -v redis-server)
cp "$redis" .gpuA/bin/
for lib in liblzf.so.1 libjemalloc.so.2; do cp "$(ldd "$redis" | awk -v l=$lib '$1 == l {print $3}')" .gpuA/lib/; done
teacher=$($PY -c "from academus.shared.models.model import teacher_dir; print(teacher_dir())")
$PY $HERE/pack.py sentiment-data "${ACADEMUS_DATA_DIR:-.academus/data}" .gpuA
$PY $HERE/pack.py teacher "$teacher" .gpuA
$PY $HERE/pack.py artifacts "${ACADEMUS_ARTIFACTS:-.academus/artifacts}" .gpuB --keep heads,models.json,students/sentiment
du -sh .whl .gpuA .gpuB
