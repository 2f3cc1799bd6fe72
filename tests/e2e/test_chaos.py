"""Faults under a light Poisson load on a supervised mesh (issue 38; the full bench: loadgen/chaos_bench.py):
what dies is restarted on its address, and every request gets a result or a status, none hangs. The mesh keeps
a standby process per worker, scheduler and gateway (`up --standby`); Redis and the others restart cold."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from academus.client import AcademusError, Client
from academus.loadgen import runner, schedule, texts
from academus.loadgen.chaos_bench import current_pid, gauges_back_to_zero, restarts, serving
from academus.loadgen.runner import GatewaySpread, RunResult
from academus.shared.cli.mesh import ADMIN_KEY_FILE, MeshState, create_key, down, pid_alive, wait_exit, wait_placed
from academus.shared.runtime.logs import logged_events
from academus.shared.runtime.slices import autogroup_nice
from academus.shared.state.keys import Keys
from tests.conftest import SuiteLauncher, parent_pid
from tests.e2e.conftest import start_mesh, wait_for

pytestmark = pytest.mark.e2e
MODEL = "spam"
TIMEOUT_S = 10.0
HANG_MARGIN_MS = 1000.0   # an answer this long past its deadline counts as hung
WORKERS = 2


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, ready_launcher: SuiteLauncher) -> Iterator[MeshState]:
    """Its services and standbys forked from the suite's launcher, which listens before it starts."""
    run_dir = tmp_path_factory.mktemp("chaos-run")
    state = start_mesh(run_dir, workers=WORKERS, gateways=2, env={"ACADEMUS_MODELS": MODEL}, supervise=True,
                       standby=True)
    yield state
    if (run_dir / "mesh.json").exists():
        down(run_dir)


def key_of(mesh: MeshState) -> str:
    return (Path(mesh.run_dir) / ADMIN_KEY_FILE).read_text().strip()


def pid_of(mesh: MeshState, name: str) -> int:
    return current_pid(Path(mesh.run_dir), name)


def under_load(mesh: MeshState, fault: Callable[[], None], seconds: float = 6.0, at: float = 2.0) -> RunResult:
    """Poisson 10 req/s of real texts over two connections to the mesh's port, `fault()` at `at` s; every
    request's record (the load generator waits for every answer)."""
    samples = texts.from_task("spam", limit=64)
    arrivals = schedule.poisson(10, seconds, seed=3)

    async def run() -> RunResult:
        async with GatewaySpread([mesh.gateway] * 2, key_of(mesh), TIMEOUT_S, own_connections=True) as spread:
            load = asyncio.create_task(runner.run(spread, MODEL, arrivals, samples, TIMEOUT_S, seconds))
            await asyncio.sleep(at)
            fault()
            return await load

    result = asyncio.run(run())
    assert len(result.records) == len(arrivals)
    hung = [r for r in result.records if r.latency_ms > TIMEOUT_S * 1e3 + HANG_MARGIN_MS]
    assert not hung, [(r.code, r.latency_ms) for r in hung]
    return result


def kill(mesh: MeshState, name: str, sig: signal.Signals) -> Callable[[], None]:
    def fault() -> None:
        os.kill(pid_of(mesh, name), sig)

    return fault


def wait_restarted(mesh: MeshState, name: str, old_pid: int, count: int = 1) -> None:
    run_dir = Path(mesh.run_dir)
    wait_for(lambda: restarts(run_dir)[name] == count and pid_of(mesh, name) != old_pid
             and pid_alive(pid_of(mesh, name)) and serving(run_dir, name), timeout_s=60, what=f"{name} restarted")


def answered_ok(mesh: MeshState, key: str) -> bool:
    try:
        with Client(mesh.gateway, api_key=key, timeout=5) as client:
            return client.infer(MODEL, ["win a free prize now"]).predictions[0].label in {"spam", "ham"}
    except AcademusError:   # not yet: the caller waits and asks again
        return False


def standby_of(mesh: MeshState, name: str) -> int | None:
    return next(s.standby_pid for s in MeshState.load(Path(mesh.run_dir)).services if s.name == name)


def test_a_killed_scheduler_is_restarted_on_its_address_and_serves_again(mesh):
    old, standby = pid_of(mesh, "scheduler"), standby_of(mesh, "scheduler")
    result = under_load(mesh, kill(mesh, "scheduler", signal.SIGKILL))
    assert {r.code for r in result.records} <= {"OK", "UNAVAILABLE", "DEADLINE_EXCEEDED"}, \
        result.report()["error_examples"]
    # A DEADLINE_EXCEEDED is only admission's prompt refusal: under a loaded test run the standby counted 11-13 s of
    # work ahead of a 10 s deadline and refused two requests at once, its seeded batch times 76-85 ms. Admission
    # now refuses by the deadline at the measured batch times, not a batch in flight for seconds; that case was not
    # reproduced, so a few such refusals stay allowed. None may wait out its deadline.
    refused = [r for r in result.records if r.code == "DEADLINE_EXCEEDED"]
    assert all("cannot be met" in r.details and r.latency_ms < 1000 for r in refused), result.report()["error_examples"]
    assert len(refused) <= 0.05 * len(result.records), result.report()["error_examples"]
    wait_restarted(mesh, "scheduler", old)
    assert pid_of(mesh, "scheduler") == standby
    restarted = MeshState.load(Path(mesh.run_dir))
    assert [s.address for s in restarted.services] == [s.address for s in mesh.services]
    wait_for(lambda: answered_ok(mesh, key_of(mesh)), timeout_s=30, what="requests answered again")
    # it admits on the batch times its predecessor reported, not on nothing (the first one found none)
    log = Path(mesh.run_dir) / "logs" / "scheduler.log"
    assert '"timings_seeded"' in log.read_text()


def test_a_killed_worker_loses_no_request_and_its_standby_takes_its_place(mesh, ready_launcher):
    old, standby = pid_of(mesh, "worker-0"), standby_of(mesh, "worker-0")
    assert standby is not None and pid_alive(standby)
    assert parent_pid(standby) == ready_launcher.pid, "forked from the launcher"
    assert standby_of(mesh, "adapter_store") is None   # off the request path: no standby
    result = under_load(mesh, kill(mesh, "worker-0", signal.SIGKILL))
    assert [r.code for r in result.records if r.code != "OK"] == []
    wait_restarted(mesh, "worker-0", old)
    wait_placed(MeshState.load(Path(mesh.run_dir)), WORKERS, 60)
    assert pid_of(mesh, "worker-0") == standby   # the standby serves, under its own pid
    assert f'"event": "standby_serves", "pid": {standby}' in (Path(mesh.run_dir) / "logs" / "worker-0.log").read_text()
    behind = standby_of(mesh, "worker-0")
    assert behind not in (None, standby) and pid_alive(behind)   # and a new one waits behind it


def test_sigterm_of_one_of_two_gateways_fails_no_request(mesh):
    old, standby = pid_of(mesh, "gateway"), standby_of(mesh, "gateway")
    result = under_load(mesh, kill(mesh, "gateway", signal.SIGTERM))
    assert [r.code for r in result.records if r.code != "OK"] == []
    wait_restarted(mesh, "gateway", old)
    assert pid_of(mesh, "gateway") == standby   # on the port the other gateway shares
    assert_handed_over(mesh, "gateway", old, standby)


def test_a_sigterm_scheduler_hands_its_place_to_its_standby_and_fails_no_request(mesh):
    old, standby = pid_of(mesh, "scheduler"), standby_of(mesh, "scheduler")
    result = under_load(mesh, kill(mesh, "scheduler", signal.SIGTERM))
    assert [r.code for r in result.records if r.code != "OK"] == []
    wait_restarted(mesh, "scheduler", old, count=2)   # its kill above was the first
    assert pid_of(mesh, "scheduler") == standby
    assert_handed_over(mesh, "scheduler", old, standby)


def test_a_sigterm_worker_drains_then_its_standby_takes_its_place(mesh):
    """A worker does not hand over early: its standby would compute beside it (docs/design/supervision.md)."""
    old, standby = pid_of(mesh, "worker-1"), standby_of(mesh, "worker-1")
    result = under_load(mesh, kill(mesh, "worker-1", signal.SIGTERM))
    assert [r.code for r in result.records if r.code != "OK"] == []
    wait_restarted(mesh, "worker-1", old)
    assert pid_of(mesh, "worker-1") == standby
    stopped, served = event_of(mesh, "worker-1", "stopped", old), event_of(mesh, "worker-1", "serving", standby)
    assert stopped["handed_over"] is None and stopped["ts"] <= served["ts"]
    supervisor_log = Path(mesh.run_dir) / "logs" / "supervisor.log"
    assert not any(e["process"] == "worker-1" for e in logged_events(supervisor_log, "handed_over"))
    wait_placed(MeshState.load(Path(mesh.run_dir)), WORKERS, 60)


def assert_handed_over(mesh: MeshState, name: str, old: int, standby: int) -> None:
    """The supervisor gave `old`'s place to `standby` while `old` still ran, and `standby` served before `old`
    stopped: the service was never missing."""
    assert {"process": name, "pid": standby, "draining": old}.items() <= \
        logged_events(Path(mesh.run_dir) / "logs" / "supervisor.log", "handed_over")[-1].items()
    wait_for(lambda: not pid_alive(old), 30, f"the old {name} drained")
    stopped, served = event_of(mesh, name, "stopped", old), event_of(mesh, name, "serving", standby)
    assert stopped["handed_over"] is True and served["ts"] <= stopped["ts"]


def event_of(mesh: MeshState, name: str, event: str, pid: int) -> dict:
    """The first `event` that process `pid` logged in `name`'s log (a service and its standby share it)."""
    return next(e for e in logged_events(Path(mesh.run_dir) / "logs" / f"{name}.log", event) if e.get("pid") == pid)


def test_a_killed_redis_is_restarted_with_its_keys(mesh):
    run_dir = Path(mesh.run_dir)
    key = create_key(MeshState.load(run_dir), "made-before")
    assert answered_ok(mesh, key)   # Redis wrote it to its AOF before it replied: a kill -9 cannot lose it
    client, keys = redis.Redis.from_url(mesh.redis_url), Keys(mesh.key_prefix)
    old = pid_of(mesh, "redis")
    result = under_load(mesh, kill(mesh, "redis", signal.SIGKILL))
    assert {r.code for r in result.records} <= {"OK", "UNAVAILABLE"}
    wait_restarted(mesh, "redis", old)
    assert client.exists(keys.api_key(key))   # reloaded from the AOF, not a gateway's cache
    wait_for(lambda: answered_ok(mesh, key), timeout_s=30, what="the key made before answered")
    report = json.loads(subprocess.run([sys.executable, "-m", "academus.shared.cli", "--run-dir", str(run_dir),
                                        "status", "--json"], capture_output=True, text=True, timeout=60).stdout)
    assert report["redis"]["restarts"] == 1 and report["supervisor"]["health"] == "RUNNING"
    assert all(s["restarts"] == restarts(run_dir)[s["name"]] for s in report["services"])


def test_clients_killed_mid_call_leave_the_mesh_serving_and_its_gauges_at_zero(mesh):
    """The bench's clients-kill, short: 20 clients of one process, each its own connection with 2 long requests
    on the wire, killed -9. The gateways serve on, the calls left behind are cancelled downstream, and every
    queue and in-flight gauge reads 0 again."""
    run_dir = Path(mesh.run_dir)
    doomed = subprocess.Popen([sys.executable, "-m", "academus.loadgen.chaos_bench", "doomed-client", mesh.gateway,
                               key_of(mesh), MODEL, "20", "2"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert doomed.stdout.readline().strip() == "ready"
    doomed.stdin.write("go\n")
    doomed.stdin.flush()
    assert doomed.stdout.readline().split() == ["sent", "20"]
    doomed.kill()
    assert doomed.wait(30) == -signal.SIGKILL   # 40 long texts on two CPU workers: not all answered by then
    assert all(serving(run_dir, name) for name in ("gateway", "gateway-1", "scheduler"))
    wait_for(lambda: answered_ok(mesh, key_of(mesh)), timeout_s=30, what="a request answered after the kill")
    settled_s, left = gauges_back_to_zero(run_dir, 60.0)
    assert settled_s is not None, left


def test_the_refusal_probe_tells_its_refusals_apart_by_where_they_were_given(mesh):
    """The light client of chaos_bench's overload row, as a tenant at 20 times its quota of 1 request a second:
    every refusal it meets is the gateway's quota's, and it says so."""
    from academus.loadgen.chaos_bench import make_tenant

    key = asyncio.run(make_tenant(mesh, "probe-over-quota", 1.0))
    probe = subprocess.Popen([sys.executable, "-m", "academus.loadgen.chaos_bench", "refusal-probe", mesh.gateway, key,
                              MODEL, "20", "5"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert probe.stdout.readline().strip() == "ready"   # its start-up is not part of the 2 s
        time.sleep(2.0)     # about 40 requests
        out, _ = probe.communicate("stop\n", timeout=60)
    finally:
        probe.kill()
    figures = json.loads(out.strip().splitlines()[-1])
    refused = figures["RESOURCE_EXHAUSTED"]["count"]
    assert refused >= 10 and figures["refusals_by_origin"] == {"quota": figures["RESOURCE_EXHAUSTED"]}


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="the kernel has no autogroups")
def test_saturated_workers_yield_the_cores_and_take_them_back(mesh):
    """Poisson load past what the workers compute keeps their compute pools busy: each worker's autogroup goes to
    the default saturated_nice (10) while it lasts, so the gateways and schedulers get the cores, and back to 0
    within seconds of its end."""
    workers = [f"worker-{k}" for k in range(WORKERS)]
    seen: dict[str, set[int | None]] = {name: set() for name in workers}
    samples = texts.from_task("spam", limit=64)
    arrivals = schedule.poisson(300, 8.0, seed=5)

    async def load_and_watch() -> RunResult:
        async with GatewaySpread([mesh.gateway] * 2, key_of(mesh), TIMEOUT_S, own_connections=True) as spread:
            load = asyncio.create_task(runner.run(spread, MODEL, arrivals, samples, TIMEOUT_S, 8.0))
            while not load.done():
                for name in workers:
                    seen[name].add(autogroup_nice(pid_of(mesh, name)))
                await asyncio.sleep(0.2)
            return await load

    result = asyncio.run(load_and_watch())
    assert sum(r.code == "OK" for r in result.records) > 0
    assert all(10 in values for values in seen.values()), seen
    wait_for(lambda: all(autogroup_nice(pid_of(mesh, name)) == 0 for name in workers), timeout_s=15,
             what="every worker's autogroup back at 0")
    events = logged_events(Path(mesh.run_dir) / "logs" / "worker-0.log", "saturation_yield")
    assert [e["yielding"] for e in events[-2:]] == [True, False]


def test_a_frozen_worker_is_routed_around_and_the_same_process_rejoins_once_continued(mesh):
    """A hung worker (SIGSTOP) keeps its connections open, so nothing refuses: the resource manager finds it silent
    to its health checks and drops it, well before its heartbeat's key lapses. The other worker answers meanwhile,
    and the batches the hung one held run there once it was dropped: no request fails. Continued, the same process
    registers again and serves: the supervisor restarts nothing."""
    run_dir = Path(mesh.run_dir)
    victim, restarted = pid_of(mesh, "worker-0"), restarts(run_dir)["worker-0"]
    manager_log = run_dir / "logs" / "resource_manager.log"
    lost_before = len(logged_events(manager_log, "worker_lost"))
    try:
        result = under_load(mesh, lambda: os.kill(victim, signal.SIGSTOP), seconds=8.0, at=1.0)
    finally:
        os.kill(victim, signal.SIGCONT)
    # the batches on the worker when it froze are given up once it was dropped, and run on the other worker
    assert [r.code for r in result.records if r.code != "OK"] == [], result.report()["error_examples"]
    assert any(r.code == "OK" and r.sent_at > 1.0 + 6.0 for r in result.records)   # after its key's 5 s TTL
    lost = logged_events(manager_log, "worker_lost")[lost_before:]
    assert [(e["worker_id"], e["how"]) for e in lost] == [("worker-0", "silent")]   # dropped by its silence,
    # not reaped when its key lapsed
    keys, client = Keys(mesh.key_prefix), redis.Redis.from_url(mesh.redis_url)
    wait_for(lambda: client.exists(keys.worker("worker-0")) and serving(run_dir, "worker-0"), timeout_s=30,
             what="the continued worker registered again")
    wait_placed(MeshState.load(run_dir), WORKERS, 60)
    assert pid_of(mesh, "worker-0") == victim and restarts(run_dir)["worker-0"] == restarted


def test_down_stops_the_supervisor_first_and_nothing_comes_back(mesh):
    state = MeshState.load(Path(mesh.run_dir))
    stopped = down(Path(mesh.run_dir))
    assert stopped[0] == "supervisor" and stopped[-1] == "redis"
    assert wait_exit(state.supervisor_pid, 10)
    assert all(wait_exit(s.pid, 10) for s in state.services)
    assert not any(pid_alive(s.pid) for s in state.services)   # stopped, and none started again
    standbys = [s.standby_pid for s in state.services if s.standby_pid]
    assert len(standbys) == WORKERS + 3 and not any(pid_alive(pid) for pid in standbys)   # and the two gateways' and
    # the scheduler's: the supervisor stopped them
    logs = Path(mesh.run_dir) / "logs"
    for proc in (s for s in state.services if s.handover):
        last = [e for e in logged_events(logs / f"{proc.name}.log", "stopped") if e.get("pid") == proc.pid]
        assert [e["handed_over"] for e in last] == [False], proc.name
    # the supervisor withdrew its offers first: a service that found one would have left its ask behind
    assert not any((Path(mesh.run_dir) / "handover").iterdir())
