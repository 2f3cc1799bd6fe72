#!/bin/bash
# GPU node, call A (carry .whl and .gpuA): the wheels, redis-server, the data and the widened teacher into
# /tmp; then the CUDA unit test and the teacher on cuda:0. LOCAL=1 skips the installs (a dry run here).
set -u
cd "$(dirname "$0")/../.."
exec > >(tee "$OUT/run_a.log") 2>&1
date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; command -v nvidia-cuda-mps-control
[ -n "${LOCAL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 3
[ -n "${LOCAL:-}" ] || { cp .gpuA/bin/redis-server /usr/local/bin/ && cp .gpuA/lib/* /usr/local/lib/ && ldconfig; } || exit 4
rm -rf /tmp/gpuA && mkdir -p /tmp/gpuA && cp -r .gpuA/teacher .gpuA/data .gpuA/narrowed.json /tmp/gpuA/ || exit 5
source deploy/offline-gpu/env.sh
redis-server --version || exit 6
python3 deploy/offline-gpu/pack.py unpack /tmp/gpuA || exit 7
python3 -c "import torch, grpc, google.protobuf as pb, transformers as t; print('torch', torch.__version__, 'grpc', grpc.__version__, 'protobuf', pb.__version__, 'transformers', t.__version__, 'cuda', torch.cuda.is_available())" || exit 8
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/unit/test_compute_threads.py -k gpu 2>&1 | tail -2
python3 -c "
import torch
from academus.shared.models.model import TeacherEncoder, teacher_dir
model = TeacherEncoder.load(teacher_dir(), device='cuda:0' if torch.cuda.is_available() else 'cpu')
print('teacher on', next(model.parameters()).device)" || exit 9
touch /tmp/gpuA/ready; date -u
