"""The resource manager's two readings of a worker's health checks, against a real gRPC server in its own process:
a stopped process (SIGSTOP) is silent, a dead one refuses, and a continued one answers again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from academus.services.resource_manager.server import worker_probe, worker_silent
from academus.shared.cli.redis_server import free_port
from academus.shared.runtime.serving import PeerHealth

HANG_S = 0.3

SERVER = """
import asyncio, sys
import grpc
from grpc_health.v1 import health, health_pb2_grpc

async def main():
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_insecure_port(sys.argv[1])
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


@pytest.fixture
def worker() -> Iterator[tuple[subprocess.Popen, str]]:
    address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen([sys.executable, "-c", SERVER, address], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    yield process, address
    if process.poll() is None:
        os.kill(process.pid, signal.SIGCONT)
        process.kill()
        process.wait()


async def test_a_stopped_worker_is_silent_and_answers_again_once_continued(worker):
    process, address = worker
    health = PeerHealth()
    assert await worker_silent(health, HANG_S, address, "r1") is True
    os.kill(process.pid, signal.SIGSTOP)
    assert await worker_silent(health, HANG_S, address, "r1") is False
    assert await worker_probe(health, address, "r1") is True   # a hung port does not refuse: not dead
    os.kill(process.pid, signal.SIGCONT)
    assert await worker_silent(health, HANG_S, address, "r1") is True


async def test_a_dead_worker_refuses_and_is_not_silent(worker):
    process, address = worker
    health = PeerHealth()
    assert await worker_silent(health, HANG_S, address, "r1") is True
    process.kill()
    process.wait()
    assert await worker_silent(health, HANG_S, address, "r1") is None
    assert await worker_probe(health, address, "r1") is False
