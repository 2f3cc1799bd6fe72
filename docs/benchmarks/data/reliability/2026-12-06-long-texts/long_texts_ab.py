"""Small requests while another client sends the largest valid request back to back, this checkout against an
earlier tree: a fresh `concat` mesh serving `null` an arm, the order alternating. An arm is a process of its own with
PYTHONPATH naming its tree laid out as the `academus` package (empty for the checkout), so the mesh it starts runs
that code.

    python long_texts_ab.py ROUNDS OUT.json NAME=PYTHONPATH NAME=PYTHONPATH

Per arm: sequential small requests for 10 s alone (sync client, after 50); then for 10 s while a second process
sends 64 texts of about 100,000 characters a request (truncated), one after another: ASCII texts, then accented
ones (the tokenizers library's path). Each phase: the small requests' percentiles, the large requests' time, and the
gateway's CPU seconds a large request, from /proc."""

from __future__ import annotations

import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

PHASE_S, WARMUP = 10.0, 50
LARGE = {"ascii": "a fine film, ", "accented": "un film réussi, "}


def percentiles(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {"p50": round(ms[len(ms) // 2], 3), "p99": round(ms[int(len(ms) * 0.99)], 3), "max": round(ms[-1], 3)}


def small_requests(client) -> list[float]:
    times, end = [], time.perf_counter() + PHASE_S
    while time.perf_counter() < end:
        start = time.perf_counter()
        client.infer("null", ["a fine film"])
        times.append((time.perf_counter() - start) * 1e3)
    return times


def large_requests(gateway: str, key: str, phrase: str, stop, done) -> None:
    """Sends the largest request until `stop` is set; puts each one's milliseconds on `done`."""
    from academus.client import Client

    texts = [f"text {i} " + phrase * (99_980 // len(phrase)) for i in range(64)]
    with Client(gateway, api_key=key, timeout=60) as client:
        while not stop.is_set():
            start = time.perf_counter()
            client.infer("null", texts)
            done.put((time.perf_counter() - start) * 1e3)


def one_mesh() -> dict:
    from academus.client import Client
    from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, MeshState, down, up

    run = Path(tempfile.mkdtemp(prefix="academus-long-texts-"))
    up(MeshOptions(run_dir=run, gateway_port=0, deployments=[Deployment("concat")], env={"ACADEMUS_MODELS": "null"}))
    try:
        state = MeshState.load(run)
        key = (run / ADMIN_KEY_FILE).read_text().strip()
        gateway_pid = next(s.pid for s in state.services if s.name.startswith("gateway"))
        with Client(state.gateway, api_key=key) as client:
            for _ in range(WARMUP):
                client.infer("null", ["a fine film"])
            alone = small_requests(client)
            result = {"alone_ms": percentiles(alone), "alone_requests": len(alone)}
            for kind, phrase in LARGE.items():
                result[kind] = beside_large(client, state.gateway, key, phrase, gateway_pid)
        return result
    finally:
        down(run)


def beside_large(client, gateway: str, key: str, phrase: str, gateway_pid: int) -> dict:
    from academus.loadgen.bench import process_cpu_s

    stop, done = multiprocessing.Event(), multiprocessing.Queue()
    sender = multiprocessing.Process(target=large_requests, args=(gateway, key, phrase, stop, done))
    sender.start()
    done.get(timeout=120)   # the sender's first answer: it is sending from now on
    cpu_before = process_cpu_s(gateway_pid)
    beside = small_requests(client)
    stop.set()
    large = [done.get(timeout=120)]   # the one under way as the small requests ended, and those before it
    cpu_s = process_cpu_s(gateway_pid) - cpu_before
    sender.join(timeout=120)
    while not done.empty():
        large.append(done.get())
    return {"small_ms": percentiles(beside), "small_requests": len(beside), "large_ms": percentiles(large),
            "large_requests": len(large), "gateway_cpu_ms_a_large_request": round(cpu_s * 1e3 / len(large), 1)}


def main() -> None:
    from academus.loadgen.code_arms import trees_alternating

    trees_alternating(int(sys.argv[1]), dict(a.split("=", 1) for a in sys.argv[3:]), __file__, Path(sys.argv[2]))


if __name__ == "__main__":
    if sys.argv[1:] == ["--one"]:
        print(json.dumps(one_mesh()))
    else:
        main()
