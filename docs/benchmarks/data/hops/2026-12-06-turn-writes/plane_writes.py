"""The node-local plane's writes: one system call a frame (`direct`) against a turn's first frame at once and the
rest of the turn together (`turn`, TurnWriter), and against every frame of a turn at its end (`deferred`), both
ends. A server process of its own serves a no-op method over
the plane; this process calls it over MultiplexChannel(local=open_local). Each arm starts its own server, the
order alternating. It runs on a tree with turn_writer.diff applied (TurnWriter, not adopted).

    python plane_writes.py ROUNDS OUT.json

Per arm: 2,000 sequential calls (p50, p99), then closed loops of 1, 8 and 64 callers for 5 s (calls a second, and
each process's CPU µs a call, from /proc)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
import uvloop

from academus.loadgen.bench import process_cpu_s
from academus.shared.runtime import local_plane
from academus.shared.runtime.heap import keep_freed_pages
from academus.shared.runtime.local_plane import LocalPlane, open_local, socket_dir
from academus.shared.runtime.multiplex import MultiplexChannel, serve_multiplexed

METHOD = "/t.Probe/Answer"
SECONDS = 5.0


def direct(arm: str) -> None:
    """`direct`: every message written on the spot, as before TurnWriter; `deferred`: every message of a turn
    written together at its end, the first too."""
    if arm == "direct":
        local_plane.TurnWriter.write = lambda self, message: self.transport.write(message)
    elif arm == "deferred":
        def deferred(self, message: bytes) -> None:
            self.pending.append(message)
            if len(self.pending) == 1:
                asyncio.get_running_loop().call_soon(self.flush)
        local_plane.TurnWriter.write = deferred


async def answer(request: bytes, context) -> bytes:
    return b"ok"


async def serve(arm: str, ports: multiprocessing.Queue) -> None:
    direct(arm)
    server = grpc.aio.server()
    handlers = {"Answer": grpc.unary_unary_rpc_method_handler(answer)}
    servicer = serve_multiplexed(server, lambda s: s.add_registered_method_handlers("t.Probe", handlers))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await LocalPlane(servicer, socket_dir(), "probe").start()
    ports.put(port)
    await server.wait_for_termination()


def run_server(arm: str, ports: multiprocessing.Queue) -> None:
    keep_freed_pages()
    uvloop.run(serve(arm, ports))


async def closed(call, callers: int) -> int:
    done = 0
    end = time.perf_counter() + SECONDS

    async def caller() -> None:
        nonlocal done
        while time.perf_counter() < end:
            await call(b"x", timeout=5)
            done += 1
    await asyncio.gather(*(caller() for _ in range(callers)))
    return done


async def measure(port: int, server_pid: int) -> dict:
    channel = MultiplexChannel(grpc.aio.insecure_channel(f"127.0.0.1:{port}"), local=open_local)
    call = channel.unary_unary(METHOD)
    try:
        for _ in range(200):
            await call(b"w", timeout=5)
            if channel.is_local:
                break
            await asyncio.sleep(0.01)
        assert channel.is_local
        took = []
        for _ in range(2000):
            start = time.perf_counter()
            await call(b"s", timeout=5)
            took.append((time.perf_counter() - start) * 1e6)
        took.sort()
        out = {"sequential_us": {"p50": round(statistics.median(took), 1),
                                 "p99": round(took[int(0.99 * len(took))], 1)}}
        for callers in (1, 8, 64):
            before = (process_cpu_s(server_pid), time.process_time())
            calls = await closed(call, callers)
            server_s, client_s = process_cpu_s(server_pid) - before[0], time.process_time() - before[1]
            out[str(callers)] = {"calls_per_s": round(calls / SECONDS), "server_us": round(1e6 * server_s / calls, 2),
                                 "client_us": round(1e6 * client_s / calls, 2)}
        return out
    finally:
        await channel.close()


def one_arm(arm: str) -> dict:
    direct(arm)
    ports: multiprocessing.Queue = multiprocessing.Queue()
    server = multiprocessing.Process(target=run_server, args=(arm, ports), daemon=True)
    server.start()
    try:
        return uvloop.run(measure(ports.get(timeout=30), server.pid))
    finally:
        server.terminate()
        server.join()


def main() -> None:
    rounds, out = int(sys.argv[1]), Path(sys.argv[2])
    results = []
    for r in range(rounds):
        arms = ["direct", "turn", "deferred"]
        order = arms if r % 2 == 0 else arms[::-1]
        row = {"order": order}
        for arm in order:   # a process an arm: its patch there alone
            done = subprocess.run([sys.executable, __file__, "--arm", arm], capture_output=True, text=True, check=True)
            row[arm] = json.loads(done.stdout.splitlines()[-1])
        print(json.dumps(row), flush=True)
        results.append(row)
    out.write_text(json.dumps({"command": sys.argv, "rounds": results}, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "--arm":
        print(json.dumps(one_arm(sys.argv[2])))
    else:
        main()
