"""The gateway's two directory questions a request (the edge refusal, then the pick), an old core against the
working tree's, in process: `python directory_ab.py ROUNDS OLD_CORE_PY` (OLD_CORE_PY: services/gateway/core.py
before the memo). 50,000 requests an arm a round, the order alternating; one and four deployments serve the model."""

import asyncio
import importlib.util
import statistics
import sys
import time
from types import ModuleType

from academus.services.gateway import core as new
from academus.shared.runtime.config import ModelSelection
from academus.shared.state.keys import Keys


def load_old(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("old_core", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_core"] = module   # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def directory(mod: ModuleType, deployments: int):
    d = mod.SchedulerDirectory(None, Keys("x"))
    d.deployments = [mod.Deployment(f"127.0.0.1:{5000 + i}", "concat", ModelSelection.parse(""))
                     for i in range(deployments)]
    d._refreshed_at = time.monotonic()
    return d


async def us_a_request(d, requests: int) -> float:
    start = time.perf_counter()
    for _ in range(requests):
        d.refuse_if_full("null", "")
        await d.pick(frozenset(), "null", "")
    return (time.perf_counter() - start) / requests * 1e6


async def main(rounds: int, old: ModuleType) -> None:
    for deployments in (1, 4):
        ratios = []
        for r in range(rounds):
            arms = [("old", old), ("new", new)] if r % 2 == 0 else [("new", new), ("old", old)]
            us = {name: await us_a_request(directory(mod, deployments), 50_000) for name, mod in arms}
            ratios.append(us["new"] / us["old"])
            print(deployments, r, {k: round(v, 3) for k, v in us.items()})
        print(f"deployments {deployments}: new/old median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), load_old(sys.argv[2])))
