"""Academus's OpenAI embeddings route against LitServe's and Ray Serve's, each serving all-MiniLM-L6-v2 on one
machine, over HTTP/JSON.

`python peers.py ROUNDS PEER_PYTHON OUT.json [null]`: PEER_PYTHON is a virtual environment's python with the peers
(`pip install torch==2.13.0`, then `pip install litserve 'ray[serve]' transformers`). Each round starts each server
afresh, the arms' order rotating: `academus up` (its defaults: `concat` for the embedding model, one worker) with
`--http-port`; LitServe (litserve_server.py) and Ray Serve (ray_server.py) with the model as their users would write
it (peer_model.py), each batching up to 32 requests for 10 ms. On each: the cosine of its embeddings against
Academus's for 32 texts; 300 sequential requests from one caller (p50, p99); closed loops of 16 and 64 callers for
10 s each (req/s, p50, p99). One Rotten Tomatoes test snippet a request, `POST /v1/embeddings`, one kept-alive
connection a caller, from this process (on the same cores).

`null`: the servers alone. Academus serves its `null` model; the peers tokenize each text and answer zeros
(PEER_NULL), without batching (a batch's 10 ms wait would be all they measured). 1,000 sequential requests after
200, and closed loops of 64 and 256 callers."""

import asyncio
import contextlib
import json
import os
import signal
import socket
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

HERE = Path(__file__).resolve().parent
TEXTS = [s.text for s in from_task("sentiment")]
DURATION_S = 10.0
MODE = {"model": {"served": "minilm", "callers": (16, 64), "warm": 50, "sequential": 300, "peer_env": {}},
        "null": {"served": "null", "callers": (64, 256), "warm": 200, "sequential": 1000,
                 "peer_env": {"PEER_NULL": "1", "PEER_BATCH": "1"}}}


class Academus:
    name = "academus"

    def __init__(self, served: str) -> None:
        self.served = served

    def __enter__(self):
        self.run = Path(tempfile.mkdtemp(prefix="peers-academus-"))
        state = up(MeshOptions(run_dir=self.run, gateway_port=0, http_port=0, env={"ACADEMUS_MODELS": self.served}))
        self.url = f"http://{state.http}/v1/embeddings"
        self.headers = {"Authorization": f"Bearer {(self.run / ADMIN_KEY_FILE).read_text().strip()}"}
        asyncio.run(wait_ready(self.url, self.headers, self.served))
        return self

    def __exit__(self, *_):
        down(self.run)


class Peer:
    """A peer's server script in its own process group, on `port`."""

    def __init__(self, name: str, script: str, python: str, port: int, env: dict[str, str]) -> None:
        self.name, self.script, self.python, self.port, self.env = name, script, python, port, env
        self.served = "minilm"

    def __enter__(self):
        with socket.socket() as probe:   # a server left from before would answer in this one's place
            if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                raise RuntimeError(f"port {self.port} is taken: a server from before?")
        self.proc = subprocess.Popen(
            [self.python, str(HERE / self.script), str(self.port)], cwd=HERE,
            env={**os.environ, "PEER_MODEL_DIR": str(teacher_dir()), "HF_HUB_OFFLINE": "1",
                 "RAY_USAGE_STATS_ENABLED": "0", **self.env},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.url, self.headers = f"http://127.0.0.1:{self.port}/v1/embeddings", {}
        asyncio.run(wait_ready(self.url, {}))
        return self

    def __exit__(self, *_):
        self.proc.send_signal(signal.SIGTERM)   # Ray's script shuts its cluster down on it
        try:
            self.proc.wait(60)
        finally:   # LitServe's server processes outlive its main one: the whole group goes
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        time.sleep(2)


async def post(session: aiohttp.ClientSession, server, texts: list[str]) -> list[list[float]]:
    async with session.post(server.url, json={"input": texts, "model": server.served},
                            headers=server.headers) as answer:
        body = await answer.json()
        assert answer.status == 200, body
        return [d["embedding"] for d in body["data"]]


async def wait_ready(url: str, headers: dict, served: str = "minilm", timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.post(url, json={"input": ["ready?"], "model": served}, headers=headers) as answer:
                    if answer.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


def percentiles(took: list[float]) -> dict[str, float]:
    took = sorted(took)
    return {"p50_ms": 1e3 * statistics.median(took), "p99_ms": 1e3 * took[min(len(took) - 1, int(0.99 * len(took)))]}


async def measure(server, mode: dict) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        sample = [(await post(session, server, [text]))[0] for text in TEXTS[:32]]   # one text a request: the
        for text in TEXTS[32:32 + mode["warm"]]:                                    # peers batch requests
            await post(session, server, [text])
        took = []
        first = 32 + mode["warm"]
        for text in TEXTS[first:first + mode["sequential"]]:
            start = time.perf_counter()
            await post(session, server, [text])
            took.append(time.perf_counter() - start)
        found = {"sample": sample, "sequential": percentiles(took)}
        for callers in mode["callers"]:
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


def main(rounds: int, python: str, out: Path, mode_name: str = "model") -> None:
    mode, results = MODE[mode_name], []
    for r in range(rounds):
        servers = [Academus(mode["served"]), Peer("litserve", "litserve_server.py", python, 8931, mode["peer_env"]),
                   Peer("ray-serve", "ray_server.py", python, 8932, mode["peer_env"])]
        servers = servers[r % 3:] + servers[:r % 3]
        found = {"order": [s.name for s in servers]}
        for server in servers:
            with server as running:
                found[server.name] = asyncio.run(measure(running, mode))
        ours = found["academus"]
        found["ratios"] = {}
        for peer in ("litserve", "ray-serve"):
            theirs = found[peer]
            sample = theirs.pop("sample")   # zeros from `null`: no cosine
            if mode_name == "model":
                found[f"cosine_min_{peer}"] = float(min(cosines(ours["sample"], sample)))
            found["ratios"][peer] = {f"closed_{c}_rps": ours[f"closed_{c}"]["rps"] / theirs[f"closed_{c}"]["rps"]
                                     for c in mode["callers"]}
            found["ratios"][peer]["sequential_p50"] = ours["sequential"]["p50_ms"] / theirs["sequential"]["p50_ms"]
        ours.pop("sample")
        print(r, json.dumps(found), flush=True)
        results.append(found)
    out.write_text(json.dumps({"command": sys.argv, "rounds": results}, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), *sys.argv[4:5])
