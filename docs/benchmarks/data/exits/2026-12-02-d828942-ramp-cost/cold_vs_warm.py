"""Why a ramp costs more inside the forward than alone: the teacher's forward on one text (40 tokens) with a hook
after each of layers 1-5 that runs one ramp step twice in a row (pooling, the host head's logits, confidence
and prediction), timing each part by the thread's CPU clock. The first run follows the layer's matmuls; the
second finds its code and data in the caches.

python cold_vs_warm.py --artifacts A [--forwards 300]   (A holds `academus ramps train --task sentiment` ramps)
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import numpy as np
import torch

from academus.shared.models.model import load_encoder
from academus.shared.models.ramps import load_ramps, ramps_dir
from academus.shared.models.teacher_files import teacher_dir


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--artifacts", type=Path, required=True)
    parser.add_argument("--forwards", type=int, default=300)
    args = parser.parse_args()
    encoder, _ = load_encoder(teacher_dir())
    encoder.eval()
    ramps, _ = load_ramps(ramps_dir(args.artifacts, "sentiment"), 384, ["rotten", "fresh"])
    ids = torch.randint(1000, 20000, (1, 40))
    mask = torch.ones(1, 40, dtype=torch.long)
    weights = (mask.float() / 40).unsqueeze(1)
    parts: list[tuple[int, ...]] = []

    def step(hidden: torch.Tensor, layer: int) -> tuple[int, int, int]:
        start = time.thread_time_ns()
        pooled = torch.bmm(weights, hidden).squeeze(1)
        pooled_at = time.thread_time_ns()
        logits = ramps.host_logits(layer, pooled)
        logits_at = time.thread_time_ns()
        total = np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1)
        _conf, _pred = 1.0 / total, logits.argmax(axis=1)
        return pooled_at - start, logits_at - pooled_at, time.thread_time_ns() - logits_at

    def hook_for(layer: int):
        def hook(_module, _args, output) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            parts.append(step(hidden, layer) + step(hidden, layer))
        return hook

    for name, module in encoder.named_modules():
        if (match := re.search(r"layer\.(\d+)$", name)) and int(match.group(1)) < 5:
            module.register_forward_hook(hook_for(int(match.group(1)) + 1))
    with torch.inference_mode():
        for _ in range(args.forwards):
            encoder(ids, mask, torch.zeros_like(ids))
    median = np.median(np.array(parts[len(parts) // 5:]), axis=0) / 1e3
    names = ("pooling", "logits", "confidence")
    print(json.dumps({"torch_threads": torch.get_num_threads(), "steps_timed": len(parts) - len(parts) // 5,
                      "first_us": dict(zip(names, np.round(median[:3], 1).tolist(), strict=True)),
                      "second_us": dict(zip(names, np.round(median[3:], 1).tolist(), strict=True))}, indent=1))


if __name__ == "__main__":
    main()
