# Sourced on the GPU node by run_a.sh and run_b.sh: the project importable as `academus.*` straight from
# this tree (pip install -e needs a network there), the carried wheels first, and where the widened
# weights and the data live.
mkdir -p /tmp/ns/academus /tmp/gpu
for d in shared services loadgen; do ln -sfn "$PWD/$d" /tmp/ns/academus/$d; done
ln -sfn "$PWD/protos/academus/v1" /tmp/ns/academus/v1
ln -sfn "$PWD/shared/client" /tmp/ns/academus/client
export PYTHONPATH=/tmp/ns:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 ACADEMUS_TEACHER_DIR=/tmp/gpuA/teacher \
  ACADEMUS_DATA_DIR=/tmp/gpuA/data ACADEMUS_ARTIFACTS=/tmp/gpuB/artifacts
