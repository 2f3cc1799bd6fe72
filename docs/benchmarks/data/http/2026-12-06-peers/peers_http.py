"""Academus's OpenAI route against infinity-emb's, serving the same all-MiniLM-L6-v2 on one machine, over HTTP/JSON.

`python peers_http.py ROUNDS INFINITY_BIN OUT.json`: each round starts each server afresh (the order alternating):
`academus up` (its defaults: `concat` for the embedding model, one worker) with `--http-port`, and
`infinity_emb v2 --model-id <the same model folder> --engine torch --device cpu` (its defaults otherwise). On each:
the cosine of its embeddings against the other's for 32 texts; 300 sequential requests from one caller (p50,
p99); closed loops of 16 and 64 callers for 10 s each (req/s, p50, p99). One Rotten Tomatoes test snippet a
request, `POST /v1/embeddings` (Academus) or `POST /embeddings` (infinity), one kept-alive connection a caller."""

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from academus.loadgen.texts import from_task
from academus.shared.cli.mesh import ADMIN_KEY_FILE, MeshOptions, down, up
from academus.shared.models.teacher_files import teacher_dir

TEXTS = [s.text for s in from_task("sentiment")]
CALLERS = (16, 64)
DURATION_S = 10.0


class Academus:
    name = "academus"

    def __enter__(self):
        self.run = Path(tempfile.mkdtemp(prefix="peers-academus-"))
        state = up(MeshOptions(run_dir=self.run, gateway_port=0, http_port=0, env={"ACADEMUS_MODELS": "minilm"}))
        self.url = f"http://{state.http}/v1/embeddings"
        self.headers = {"Authorization": f"Bearer {(self.run / ADMIN_KEY_FILE).read_text().strip()}"}
        return self

    def __exit__(self, *_):
        down(self.run)


class Infinity:
    name = "infinity"

    def __init__(self, binary: str) -> None:
        self.binary = binary

    def __enter__(self):
        port = 7997
        self.proc = subprocess.Popen(
            [self.binary, "v2", "--model-id", str(teacher_dir()), "--served-model-name", "minilm", "--port",
             str(port), "--engine", "torch", "--device", "cpu"],
            env={**os.environ, "HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1"},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.url, self.headers = f"http://127.0.0.1:{port}/embeddings", {}
        asyncio.run(wait_ready(self.url))
        return self

    def __exit__(self, *_):
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(30)


async def post(session: aiohttp.ClientSession, server, texts: list[str]) -> list[list[float]]:
    async with session.post(server.url, json={"input": texts, "model": "minilm"}, headers=server.headers) as answer:
        body = await answer.json()
        assert answer.status == 200, body
        return [d["embedding"] for d in body["data"]]


async def wait_ready(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.post(url, json={"input": ["ready?"], "model": "minilm"}) as answer:
                    if answer.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


def percentiles(took: list[float]) -> dict[str, float]:
    took = sorted(took)
    return {"p50_ms": 1e3 * statistics.median(took), "p99_ms": 1e3 * took[min(len(took) - 1, int(0.99 * len(took)))]}


async def measure(server) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        sample = await post(session, server, TEXTS[:32])
        for text in TEXTS[:50]:
            await post(session, server, [text])
        took = []
        for text in TEXTS[50:350]:
            start = time.perf_counter()
            await post(session, server, [text])
            took.append(time.perf_counter() - start)
        found = {"sample": sample, "sequential": percentiles(took)}
        for callers in CALLERS:
            found[f"closed_{callers}"] = await closed_loop(session, server, callers)
    return found


async def closed_loop(session: aiohttp.ClientSession, server, callers: int) -> dict[str, float]:
    took: list[float] = []
    end = time.perf_counter() + DURATION_S

    async def caller(k: int) -> None:
        i = k
        while time.perf_counter() < end:
            start = time.perf_counter()
            await post(session, server, [TEXTS[i % len(TEXTS)]])
            took.append(time.perf_counter() - start)
            i += callers

    started = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(callers)))
    return {"rps": len(took) / (time.perf_counter() - started), **percentiles(took)}


def cosines(a: list[list[float]], b: list[list[float]]) -> list[float]:
    x, y = np.asarray(a), np.asarray(b)
    return list(np.sum(x * y, 1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1)))


def main(rounds: int, infinity: str, out: Path) -> None:
    results = []
    for r in range(rounds):
        servers = [Academus(), Infinity(infinity)]
        found = {}
        for server in servers if r % 2 == 0 else servers[::-1]:
            with server as running:
                found[server.name] = asyncio.run(measure(running))
        same = cosines(found["academus"].pop("sample"), found["infinity"].pop("sample"))
        found["cosine_min"] = float(min(same))
        ours, theirs = found["academus"], found["infinity"]
        found["ratios"] = {f"closed_{c}_rps": ours[f"closed_{c}"]["rps"] / theirs[f"closed_{c}"]["rps"]
                           for c in CALLERS}
        found["ratios"]["sequential_p50"] = ours["sequential"]["p50_ms"] / theirs["sequential"]["p50_ms"]
        print(r, json.dumps(found), flush=True)
        results.append(found)
    out.write_text(json.dumps({"command": sys.argv, "rounds": results}, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
