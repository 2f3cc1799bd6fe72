"""Re-adds the trained teacher of 55ef9a1 (the same weights) as `shard adapt` writes it from a689d25 on: its config
also names the tasks it was trained under (`academus_adapted_heads`). Run before `shard build --model minilm-wide`:

    python readd.py ARTIFACTS
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

from academus.shared.models.shards import ADAPTED_HEADS
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.user_models import add_model, remove_model

artifacts = Path(sys.argv[1])
old = artifacts / "models" / "minilm-wide"
with tempfile.TemporaryDirectory() as scratch:
    directory = Path(scratch) / "minilm-wide"
    shutil.copytree(teacher_dir(), directory, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "onnx",
                                                                             "openvino", "__pycache__", "*.py"))
    shutil.copyfile(old / "model.safetensors", directory / "model.safetensors")
    config = json.loads((old / "config.json").read_text())
    config[ADAPTED_HEADS] = ["sentiment", "spam"]
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("minilm-wide-sentiment-sti", "minilm-wide-spam-sti", "minilm-wide"):
        remove_model(artifacts, name)
    print(json.dumps(add_model(artifacts, "minilm-wide", directory, task="embed")))
