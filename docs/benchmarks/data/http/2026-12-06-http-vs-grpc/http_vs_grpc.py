"""The HTTP/JSON API against the gRPC `Infer`, one mesh a round (`concat`, one worker), sequential single-text requests
from one caller each: gRPC through the sync SDK, HTTP through one kept-alive connection (`http.client`), the order
alternating. Per arm: p50 and p99 ms, and the gateway's CPU ms a request from /proc.
`python http_vs_grpc.py ROUNDS REQUESTS MODEL OUT.json` (MODEL: null for the stack alone, minilm for the model)."""

import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from academus.client import Client
from academus.loadgen.bench import process_cpu_s
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, down, up

TEXT = "a sentence of about sixteen tokens, as the stack bench sends to the null model"


def grpc_arm(state, key: str, model: str, requests: int) -> list[float]:
    with Client(state.gateway, api_key=key) as client:
        for _ in range(50):
            client.infer(model, [TEXT], output="embedding")
        took = []
        for _ in range(requests):
            start = time.perf_counter()
            client.infer(model, [TEXT], output="embedding")
            took.append(time.perf_counter() - start)
    return took


def http_arm(state, key: str, model: str, requests: int) -> list[float]:
    host, port = state.http.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port))
    body = json.dumps({"inputs": TEXT, "model": model, "normalize": False})
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def one() -> None:
        connection.request("POST", "/embed", body, headers)
        answer = connection.getresponse()
        payload = answer.read()
        assert answer.status == 200, payload

    for _ in range(50):
        one()
    took = []
    for _ in range(requests):
        start = time.perf_counter()
        one()
        took.append(time.perf_counter() - start)
    connection.close()
    return took


def measure(arm, state, key: str, model: str, requests: int) -> dict[str, float]:
    gateway = next(s.pid for s in state.services if s.service == "gateway")
    cpu = process_cpu_s(gateway)
    took = sorted(arm(state, key, model, requests))
    return {"p50_ms": 1e3 * statistics.median(took), "p99_ms": 1e3 * took[int(0.99 * len(took))],
            "gateway_cpu_ms": 1e3 * (process_cpu_s(gateway) - cpu) / (requests + 50)}


def main(rounds: int, requests: int, model: str, out: Path) -> None:
    results = []
    for r in range(rounds):
        run = Path(tempfile.mkdtemp(prefix="http-vs-grpc-"))
        state = up(MeshOptions(run_dir=run, gateway_port=0, http_port=0, deployments=[Deployment("concat")],
                               env={"ACADEMUS_MODELS": model}))
        try:
            key = (run / ADMIN_KEY_FILE).read_text().strip()
            arms = [("grpc", grpc_arm), ("http", http_arm)]
            order = arms if r % 2 == 0 else arms[::-1]
            found = {name: measure(arm, state, key, model, requests) for name, arm in order}
        finally:
            down(run)
        found["http_over_grpc_p50"] = found["http"]["p50_ms"] / found["grpc"]["p50_ms"]
        found["http_over_grpc_cpu"] = found["http"]["gateway_cpu_ms"] / found["grpc"]["gateway_cpu_ms"]
        print(r, json.dumps(found))
        results.append(found)
    out.write_text(json.dumps({"command": sys.argv, "model": model, "requests": requests, "rounds": results}, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
