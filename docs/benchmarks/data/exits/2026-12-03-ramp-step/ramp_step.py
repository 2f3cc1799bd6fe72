"""The ramp step of a padded batch alone, outside the forward: `ExitRun` made and one active ramp (sentiment's
layer 2) run on a random layer output, in wall and CPU microseconds a step (all threads), 2,000 steps a shape.

`python ramp_step.py ARTIFACTS [--busy]`: with `--busy` a second process keeps the other core busy meanwhile
(a plain Python loop), as the model's own threads and the mesh's services do in serving."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from academus.services.worker.exits import ExitRun, ModelExits
from academus.shared.models.exits import ActiveRamps, ControllerSettings, ThresholdRule, controller_for
from academus.shared.models.ramps import load_ramps, ramps_dir

STEPS = 2000


def main() -> None:
    artifacts, busy = Path(sys.argv[1]), "--busy" in sys.argv
    ramps, manifest = load_ramps(ramps_dir(artifacts, "sentiment"), 384, ["rotten", "fresh"])
    controller = controller_for(ramps.layers, manifest.extra, ControllerSettings(), ramps.evidence)
    controller.active = ActiveRamps((2,), ThresholdRule((0.9,)))
    exits = ModelExits(ramps, controller)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    out = {"torch_threads": torch.get_num_threads(), "busy": busy, "steps": {}}
    try:
        for texts, tokens in ((2, 40), (8, 40), (8, 64)):
            hidden, mask = torch.randn(texts, tokens, 384), torch.ones(texts, tokens, dtype=torch.long)
            mask[0, tokens // 2:] = 0

            def step(texts=texts, hidden=hidden, mask=mask) -> None:
                run = ExitRun(exits, texts, lambda rows, layer, probs: None)
                run.mask = mask
                run.hidden(2, hidden)

            for _ in range(200):
                step()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(STEPS):
                step()
            out["steps"][f"{texts}x{tokens}"] = {"wall_us": round((time.perf_counter() - wall) / STEPS * 1e6, 1),
                                                 "cpu_us": round((time.process_time() - cpu) / STEPS * 1e6, 1)}
    finally:
        if spinner is not None:
            spinner.kill()
    print(json.dumps(out))


if __name__ == "__main__":
    with torch.inference_mode():
        np.random.seed(0)
        main()
