"""Academus's OpenAI embeddings route against LitServe's and Ray Serve's, each serving all-MiniLM-L6-v2 on one
machine, measured by Academus's own load generator over HTTP/JSON.

`python peers.py ROUNDS PEER_PYTHON OUT.json [null]`: PEER_PYTHON is a virtual environment's python with the peers
(`pip install torch==2.13.0`, then `pip install litserve 'ray[serve]' transformers`). Each round starts each server
afresh, the arms' order rotating: `academus up` (its defaults: `concat` for the embedding model, one worker) with
`--http-port`; LitServe (litserve_server.py) and Ray Serve (ray_server.py) with the model as their users would write
it (peer_model.py), each batching up to 32 requests for 10 ms. On each: the cosine of its embeddings against
Academus's for 32 texts; then `academus loadgen run --gateway http://HOST:PORT/v1/embeddings --schedule closed:N
--duration 10` (Rotten Tomatoes test snippets, one a request) with 1 caller after a 5 s warm-up, then 16 and 64.

`null`: the servers alone. Academus serves its `null` model; the peers tokenize each text and answer zeros
(PEER_NULL), without batching (a batch's 10 ms wait would be all they measured). Closed loops of 1, 64 and 256."""

import asyncio
import contextlib
import json
import os
import signal
import socket
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
DURATION_S, WARM_S = 10, 5
MODE = {"model": {"served": "minilm", "callers": (1, 16, 64), "peer_env": {}},
        "null": {"served": "null", "callers": (1, 64, 256), "peer_env": {"PEER_NULL": "1", "PEER_BATCH": "1"}}}


class Academus:
    name = "academus"

    def __init__(self, served: str) -> None:
        self.served = served

    def __enter__(self):
        self.run = Path(tempfile.mkdtemp(prefix="peers-academus-"))
        state = up(MeshOptions(run_dir=self.run, gateway_port=0, http_port=0, env={"ACADEMUS_MODELS": self.served}))
        self.url = f"http://{state.http}/v1/embeddings"
        self.key = (self.run / ADMIN_KEY_FILE).read_text().strip()
        asyncio.run(wait_ready(self))
        return self

    def __exit__(self, *_):
        down(self.run)


class Peer:
    """A peer's server script in its own process group, on `port`."""

    def __init__(self, name: str, script: str, python: str, port: int, env: dict[str, str]) -> None:
        self.name, self.script, self.python, self.port, self.env = name, script, python, port, env
        self.served, self.key = "minilm", "none"   # the peers take any key

    def __enter__(self):
        with socket.socket() as probe:   # a server left from before would answer in this one's place
            if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                raise RuntimeError(f"port {self.port} is taken: a server from before?")
        self.proc = subprocess.Popen(
            [self.python, str(HERE / self.script), str(self.port)], cwd=HERE,
            env={**os.environ, "PEER_MODEL_DIR": str(teacher_dir()), "HF_HUB_OFFLINE": "1",
                 "RAY_USAGE_STATS_ENABLED": "0", **self.env},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}/v1/embeddings"
        asyncio.run(wait_ready(self))
        return self

    def __exit__(self, *_):
        self.proc.send_signal(signal.SIGTERM)   # Ray's script shuts its cluster down on it
        try:
            self.proc.wait(60)
        finally:   # LitServe's server processes outlive its main one: the whole group goes
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        time.sleep(2)


async def embeddings(server, texts: list[str]) -> list[list[float]]:
    """Each text's embedding, one request a text (the peers batch requests, not a request's inputs)."""
    found = []
    async with aiohttp.ClientSession() as session:
        for text in texts:
            async with session.post(server.url, json={"input": [text], "model": server.served},
                                    headers={"Authorization": f"Bearer {server.key}"}) as answer:
                body = await answer.json()
                assert answer.status == 200, body
                found.append(body["data"][0]["embedding"])
    return found


async def wait_ready(server, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, AssertionError):
            await embeddings(server, ["ready?"])
            return
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{server.url} did not answer within {timeout_s} s")


def loadgen(server, callers: int, seconds: float) -> dict:
    """One closed loop of `callers` from Academus's load generator: requests a second, p50 and p99 of those
    answered, and the failures by code."""
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run(
            [sys.executable, "-m", "academus.loadgen", "run", "--gateway", server.url, "--key", server.key,
             "--model", server.served, "--schedule", f"closed:{callers}", "--duration", str(seconds),
             "--texts", "task:sentiment", "--timeout", "60", "--out", out],
            capture_output=True, text=True, check=True)
    run = json.loads(done.stdout.strip().splitlines()[-1])["runs"][0]
    return {"rps": run["throughput_rps"], "p50_ms": run["latency_ms"]["p50"], "p99_ms": run["latency_ms"]["p99"],
            "errors": run["errors"]}


def measure(server, mode: dict) -> dict:
    found = {"sample": asyncio.run(embeddings(server, [s.text for s in from_task("sentiment")[:32]]))}
    loadgen(server, 1, WARM_S)
    for callers in mode["callers"]:
        found[f"closed_{callers}"] = loadgen(server, callers, DURATION_S)
    return found


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
                found[server.name] = measure(running, mode)
        ours = found["academus"]
        found["ratios"] = {}
        for peer in ("litserve", "ray-serve"):
            theirs = found[peer]
            sample = theirs.pop("sample")   # zeros from `null`: no cosine
            if mode_name == "model":
                found[f"cosine_min_{peer}"] = float(min(cosines(ours["sample"], sample)))
            found["ratios"][peer] = {f"closed_{c}_rps": ours[f"closed_{c}"]["rps"] / theirs[f"closed_{c}"]["rps"]
                                     for c in mode["callers"]}
            found["ratios"][peer]["closed_1_p50"] = ours["closed_1"]["p50_ms"] / theirs["closed_1"]["p50_ms"]
        ours.pop("sample")
        print(r, json.dumps(found), flush=True)
        results.append(found)
    out.write_text(json.dumps({"command": sys.argv, "rounds": results}, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), *sys.argv[4:5])
