"""Start, stop and failure: graceful SIGTERM of a busy worker, a lost worker, `academus down`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import redis

from academus.client import AcademusError, Client
from academus.shared.cli.mesh import ADMIN_KEY_FILE, STATE_FILE, down, wait_exit
from academus.shared.runtime.config import LAUNCHER
from academus.shared.state.keys import Keys
from tests.conftest import parent_pid
from tests.e2e.conftest import metric, start_mesh

pytestmark = pytest.mark.e2e
LONG = [f"{i} " + "a long sentence that keeps the worker busy for a while " * 30 for i in range(64)]


def busy_worker(state) -> object:
    """The worker currently running a batch, from its in-flight gauge."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for s in state.services:
            if s.name.startswith("worker") and metric(s.metrics_port, "academus_rpc_in_flight",
                                                        service="worker", method="Run") >= 1:
                return s
        time.sleep(0.05)
    raise AssertionError("no worker became busy")


def test_sigterm_finishes_in_flight_work_then_deregisters_and_lost_worker_is_unavailable(tmp_path, monkeypatch):
    monkeypatch.delenv(LAUNCHER.name)   # plain processes, as `up --no-launcher` starts (the suite's others fork)
    state = start_mesh(tmp_path / "run", workers=2, launcher=False)
    assert {parent_pid(s.pid) for s in state.services} == {os.getpid()}
    key = (tmp_path / "run" / ADMIN_KEY_FILE).read_text().strip()
    keys, r = Keys(state.key_prefix), redis.Redis.from_url(state.redis_url, decode_responses=True)
    try:
        results: list = []
        thread = threading.Thread(target=lambda: results.append(
            Client(state.gateway, api_key=key, timeout=60).infer("spam", LONG)))
        thread.start()
        victim = busy_worker(state)
        os.kill(victim.pid, signal.SIGTERM)
        thread.join()
        # in-flight work finished on the terminated worker, which then left placements and exited
        assert len(results[0].predictions) == 64 and results[0].metadata.worker_id == victim.name
        assert wait_exit(victim.pid, 30)
        assert victim.name not in r.smembers(keys.placement("spam"))
        stopped = stop_event(tmp_path / "run", victim.name)   # each step of the stop, timed
        assert {"tasks", "local_plane", "server"} <= set(stopped["seconds"]) and stopped["local_connections_cut"] >= 0
        survivor = next(s for s in state.services if s.name.startswith("worker") and s is not victim)
        with Client(state.gateway, api_key=key) as client:
            assert client.infer("spam", ["still served"]).metadata.worker_id == survivor.name
            # the last worker dies without deregistering: UNAVAILABLE at once, not a hang
            os.kill(survivor.pid, signal.SIGKILL)
            assert wait_exit(survivor.pid, 30)
            start = time.monotonic()
            with pytest.raises(AcademusError) as info:
                client.infer("spam", ["nobody home"], timeout=10)
            assert info.value.code == "UNAVAILABLE" and time.monotonic() - start < 5
        # the heartbeat TTL then removes it from placements
        end = time.monotonic() + 15
        while r.smembers(keys.placement("spam")) and time.monotonic() < end:
            time.sleep(0.2)
        assert r.smembers(keys.placement("spam")) == set()
    finally:
        down(tmp_path / "run")
    assert not (tmp_path / "run" / STATE_FILE).exists()
    assert all(wait_exit(s.pid, 5) for s in state.services)
    with pytest.raises(redis.exceptions.ConnectionError):
        r.ping()  # the mesh's own redis-server stopped too


def stop_event(run_dir, service: str) -> dict:
    """The `stopped` event in a service's log."""
    lines = (run_dir / "logs" / f"{service}.log").read_text().splitlines()
    return next(e for e in map(json.loads, reversed(lines)) if e.get("event") == "stopped")


def infer_on_own_connection(address: str, key: str) -> str:
    """One request on a connection of its own (a local subchannel pool: no connection shared in-process)."""
    import grpc

    from academus.client.types import build_request, call_metadata, from_response
    from academus.v1 import inference_pb2_grpc

    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        reply = inference_pb2_grpc.InferenceStub(channel).Infer(
            build_request("spam", ["win a free prize now"], "", None, None, "", ""), timeout=30,
            metadata=call_metadata(key))
    return from_response(reply).predictions[0].label


def answers_after_a_kill(call, in_a_row: int, timeout_s: float) -> int:
    """Calls until `in_a_row` succeed one after the other; returns how many succeeded in all. For a moment
    after a gateway dies its listener outlives it (the kernel closes a dead process' files a little later),
    and a new connection the kernel hands to it is reset."""
    import grpc

    end, answered, streak = time.monotonic() + timeout_s, 0, 0
    while streak < in_a_row:
        try:
            call()
            answered, streak = answered + 1, streak + 1
        except grpc.RpcError:
            if time.monotonic() > end:
                raise
            streak = 0
            time.sleep(0.2)
    return answered


def gateway_calls(gateways) -> list[float]:
    return [metric(g.metrics_port, "academus_rpc_seconds_count", service="gateway", method="Infer")
            for g in gateways]


def test_gateways_share_one_port_each_serves_and_one_lost_leaves_the_other(tmp_path):
    """`academus up --gateways 2`: both bind the mesh's one gateway port (SO_REUSEPORT), the kernel spreads
    connections over them, and when one dies new connections reach the other. Each also has a port of its
    own, where the load generator sends every other request. This mesh's hops are a gRPC call each
    (ACADEMUS_HOP_STREAMS=false, the ablation), the other meshes' ride multiplexed streams."""
    state = start_mesh(tmp_path / "run", env={"ACADEMUS_MODELS": "spam", "ACADEMUS_HOP_STREAMS": "false"}, gateways=2)
    try:
        gateways = [s for s in state.services if s.name.startswith("gateway")]
        assert [g.name for g in gateways] == ["gateway", "gateway-1"]
        assert state.gateways() == [g.address for g in gateways] and state.gateway not in state.gateways()
        key = (tmp_path / "run" / ADMIN_KEY_FILE).read_text().strip()
        labels = {infer_on_own_connection(state.gateway, key) for _ in range(24)}
        assert labels <= {"spam", "ham"} and labels
        served = gateway_calls(gateways)
        assert sum(served) == 24 and min(served) > 0, served
        infer_on_own_connection(gateways[1].address, key)      # its own port reaches that process only
        assert gateway_calls(gateways) == [served[0], served[1] + 1]
        served = spread_load(tmp_path, state, gateways)
        hops = [(s, "/academus.v1.Scheduler/Schedule" if s.name.startswith("scheduler") else "/academus.v1.Worker/Run")
                for s in state.services if s.name.startswith(("scheduler", "worker"))]
        assert not any(metric(s.metrics_port, "academus_multiplexed_calls_total", method=m) for s, m in hops)
        os.kill(gateways[1].pid, signal.SIGKILL)
        assert wait_exit(gateways[1].pid, 10)
        answered = answers_after_a_kill(lambda: infer_on_own_connection(state.gateway, key), 6, 10)
        assert gateway_calls(gateways[:1]) == [served[0] + answered]    # every answer came from the survivor
    finally:
        down(tmp_path / "run")


def spread_load(tmp_path, state, gateways) -> list[float]:
    """`academus loadgen --procs 2` against the mesh: its processes send to both gateways' own ports in
    turn, and the report's per-gateway counts are the ones each gateway served. The load stays well under the
    mesh's capacity on a loaded 2-core machine (short reviews, not spam's long emails, through the spam model),
    with a long deadline, so admission refuses nothing. Returns those counts."""
    before = gateway_calls(gateways)
    proc = subprocess.run([sys.executable, "-m", "academus.shared.cli", "--run-dir", state.run_dir, "loadgen", "run",
                           "--model", "spam", "--schedule", "poisson:6", "--duration", "4", "--texts", "task:sentiment",
                           "--timeout", "30", "--procs", "2", "--out", str(tmp_path / "spread")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    run = json.loads(proc.stdout.splitlines()[-1])["runs"][0]
    sent = {g.address: run["by_gateway"][g.address]["sent"] for g in gateways}
    assert sum(sent.values()) == run["sent"] == run["completed"] > 10 and not run["errors"], (run["by_gateway"],
                                                                                           run["error_examples"])
    assert max(sent.values()) - min(sent.values()) <= 2, sent     # each process alternates, from its own start
    assert set(run["send_late_ms"]) == {"p50", "p99", "max"}   # an open loop's, over both processes' sends
    after = gateway_calls(gateways)
    assert [a - b for a, b in zip(after, before, strict=True)] == [sent[g.address] for g in gateways]
    return after
