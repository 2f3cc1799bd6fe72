"""Early exits past the capacity, live: a Poisson schedule over a fresh mesh an arm (one padded sentiment deployment,
ramps on), every request's outcome, and the worker's exit counters over the run.

`python overload.py ARTIFACTS ROUNDS RATE SECONDS OUT [ARM,ARM,...] [FIRST]`, FIRST the first round's number (0 by
default: a later run goes on with the next schedules and the order where an earlier one stopped), arms as in
2026-12-03's closed_loop_cpu.py: vanilla, early (ramps stood down while the worker's compute is saturated, the
default), early-when-saturated (ACADEMUS_EXITS_WHEN_SATURATED=1). Each request has a 5 s deadline. Per arm: answered
a second (goodput), the refusals by code, the answered requests' first and final result p50 and p99. The order of
the arms alternates between rounds."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

from academus.client import AcademusError, AsyncClient
from academus.loadgen.exits_bench import drifting_order
from academus.loadgen.exits_live import one_request, padded_mesh, worker_counts
from academus.shared.training.data import fetch, load_task

sys.path.insert(0, str(Path(__file__).parents[1] / "2026-12-03-capacity"))
from closed_loop_cpu import ARMS

DEADLINE_S = 5.0


async def timed(client: AsyncClient, kind: str, text: str) -> tuple[str, float, float]:
    """(status code, seconds to the first result, to the final one)."""
    try:
        first, final, _, _ = await asyncio.wait_for(one_request(client, kind, "sentiment", text), DEADLINE_S)
        return "OK", first, final
    except AcademusError as e:
        return e.code, 0.0, 0.0
    except TimeoutError:
        return "DEADLINE_EXCEEDED", 0.0, 0.0


def run(arm: str, texts: list[str], rate: float, seconds: float, artifacts: Path, seed: int) -> dict:
    kind, env = ARMS[arm]
    with padded_mesh("sentiment", artifacts, env) as (state, key):

        async def measure() -> dict:
            async with AsyncClient(state.gateway, api_key=key, timeout=DEADLINE_S) as client:
                for text in texts[:32]:
                    await one_request(client, kind, "sentiment", text)
                rng, at, tasks = random.Random(seed), 0.0, []
                seen, start = worker_counts(state), time.perf_counter()
                for i in range(len(texts) * 100):
                    at += rng.expovariate(rate)
                    if at >= seconds:
                        break
                    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                    tasks.append(asyncio.ensure_future(timed(client, kind, texts[i % len(texts)])))
                results = await asyncio.gather(*tasks)
                after = worker_counts(state)
            ok = [(first, final) for code, first, final in results if code == "OK"]
            first, final = np.array([o[0] for o in ok]) * 1e3, np.array([o[1] for o in ok]) * 1e3
            codes: dict[str, int] = {}
            for code, _, _ in results:
                codes[code] = codes.get(code, 0) + 1
            return {"arm": arm, "sent": len(results), "codes": codes, "goodput_rps": round(len(ok) / seconds, 1),
                    "first_p50_ms": round(float(np.median(first)), 1),
                    "final_p50_ms": round(float(np.median(final)), 1),
                    "final_p99_ms": round(float(np.percentile(final, 99)), 1),
                    **{name: after[name] - seen[name] for name in after}}

        return asyncio.run(measure())


def main() -> None:
    artifacts, rounds, rate, seconds, out = (Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]),
                                             float(sys.argv[4]), Path(sys.argv[5]))
    arms = sys.argv[6].split(",") if len(sys.argv) > 6 else ["vanilla", "early", "early-when-saturated"]
    first = int(sys.argv[7]) if len(sys.argv) > 7 else 0
    test = load_task("sentiment", fetch(None)).test
    results = []
    for r in range(first, first + rounds):
        texts = [test[i].text for i in drifting_order("sentiment", test, seed=r)]
        for arm in arms if r % 2 == 0 else arms[::-1]:
            results.append(run(arm, texts, rate, seconds, artifacts, seed=r) | {"round": r})
            print(json.dumps(results[-1]), flush=True)
    out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
