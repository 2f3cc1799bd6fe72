"""Chaos bench (issue 38): a supervised mesh under a steady Poisson load of real requests, one fault a run, and
what each fault cost.

    python -m academus.loadgen.chaos_bench [--faults worker-kill,scheduler-kill,...] [--rate R | --load 2]
        [--duration 60] [--fault-at 10] [--workers 2] [--out .academus/results/chaos]

One mesh (`academus up`: every process supervised, restarted when it dies) serves sentiment and
sentiment-students with the default deployments (a scheduler each). Its capacity is measured first with a
short closed loop; the load, a tenant's (a quota it never reaches: each request takes its token in Redis),
is `--load` times it unless `--rate` gives it, half to each model. A fault-free run comes first (the
reference), then a run a fault on the same schedule, the mesh back to health between (`--gateways 2
--shards 2`: two gateways on the port and two schedulers a deployment, the fault hitting one):

  worker-kill, scheduler-kill, gateway-kill   kill -9 of worker-0, of the scheduler serving sentiment-students,
                                              of the gateway
  worker-term, scheduler-term, gateway-term   SIGTERM of the same
  worker-freeze, scheduler-freeze             SIGSTOP of the same, a hung process that holds its connections open,
                                              continued (SIGCONT) --thaw-at seconds later
  redis-kill                                  kill -9 of the mesh's Redis; an API key made before must still work
  clients-kill                                --clients clients (each its own connection, spread over
                                              --client-processes processes) killed -9 while their requests run
  tenant-flood                                a tenant with a small quota (--tenant-quota) sending 10x it

`--soak`: instead, one run at 70 % of capacity for --duration (the issue: 10 minutes) while tenants come and
go (every 2 s one puts an adapter on minilm, registers a model on it and sends requests to it; the oldest of
more than four is deleted with its adapters), reporting every process's RSS growth over the second half.

For each: requests lost (no result or status within the deadline + 50 ms), failed and errors by code (beside
the reference's), time to recover (from the fault to the first success, on the models it hit, of a request
sent after it), the victim's replacement serving, p99 of the traffic it did not hit against the reference's,
the time to a refusal (RESOURCE_EXHAUSTED) at the load generator, at a light client of its own process beside
an overload (10 req/s to the students: its loop is not saturated, as the load generator's is) and at the gateways
(the p99's histogram bucket, academus_rpc_error_seconds: their handlers' own share), each model's waits in its
schedulers' queues (the p99's bucket and the shares past 1 s and 2 s, against the queue's wait bound), the
scheduler queue and in-flight gauges back to zero after the load, every process's RSS over time (/proc), the
restarts the supervisor made, and the host's steal (/proc/stat: a pause of the host's stalls every process at
once). summary.json, a table on stdout, and PNGs a fault (timeline, RSS) go under --out; the mesh's logs under
--out/run/logs. Measurements: docs/benchmarks/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import redis
from prometheus_client.samples import Sample

from academus.client import AcademusError, AsyncClient, Client
from academus.loadgen import analysis, plots, runner, schedule, texts
from academus.loadgen.bench import process_memory_kib, write_summary
from academus.loadgen.runner import GatewaySpread, RunResult
from academus.loadgen.stats import percentile
from academus.shared.cli.mesh import (
    MeshOptions,
    MeshState,
    create_key,
    default_deployments,
    down,
    health,
    pid_alive,
    standby_ready,
    status,
    up,
    wait_placed,
)
from academus.shared.runtime.metrics import scrape
from academus.shared.runtime.redis_conn import connect
from academus.shared.state.keys import Keys
from academus.shared.state.tenants import TenantRegistry

MODELS = ("sentiment", "sentiment-students")
HIT_BY_SCHEDULER = MODELS[1]       # the scheduler faults hit the one serving this model
# the load's client connections, all to the mesh's port, as clients without a balancer in front: with several
# gateways the kernel spreads the connections over them, and one lost moves its connections to the others
CONNECTIONS = 4
PROBE_RATE = 10.0                  # the refusal probe's requests/s beside an overload
CLIENTS_LEAD_S = 5.0               # clients-kill starts its clients this long before the fault
LATE_MS = 50.0                     # an answer later than its deadline + this was lost
# texts the workers computed, and the work dropped unrun or stopped because no one waits for it any more
COUNTERS = ("academus_worker_batch_size_texts_sum", "academus_scheduler_dropped_total",
            "academus_worker_abandoned_total", "academus_worker_expired_total", "academus_multiplexed_unrun_total")
GAUGES = ("academus_scheduler_queue_depth", "academus_scheduler_buffer_depth", "academus_rpc_in_flight")
LOAD_QUOTA = 1e6                   # requests/s: the load's tenant never reaches it
LONG_TEXT = "a long review of a film that goes on and on about the plot, the actors and the music " * 6


@dataclass(frozen=True)
class Fault:
    name: str
    target: str                    # worker, scheduler, gateway, redis, clients or tenant
    signal: int = signal.SIGKILL   # SIGSTOP: the victim hangs (alive, silent) until --thaw-at seconds later


FAULTS = {f.name: f for f in (
    Fault("worker-kill", "worker"), Fault("scheduler-kill", "scheduler"), Fault("gateway-kill", "gateway"),
    Fault("worker-term", "worker", signal.SIGTERM), Fault("scheduler-term", "scheduler", signal.SIGTERM),
    Fault("gateway-term", "gateway", signal.SIGTERM), Fault("worker-freeze", "worker", signal.SIGSTOP),
    Fault("scheduler-freeze", "scheduler", signal.SIGSTOP), Fault("redis-kill", "redis"),
    Fault("clients-kill", "clients"), Fault("tenant-flood", "tenant"))}
# the targets: (what, limit) checked on each fault's figures
TARGETS = {"kill": (("lost", 0), ("excess_near_fault_pct", 5.0), ("recover_s", 5.0)),
           "term": (("lost", 0), ("excess_failed", 0)),
           "redis": (("excess_near_fault_pct", 5.0), ("key_works_after", True))}
NEAR_FAULT_S = 5.0   # a fault's cost: the failures of the seconds after it, this many at least
REFUSAL_P99_MS, GOODPUT_SHARE = 50.0, 0.9   # past capacity (--load > 1), the fault-free run's targets
SOAK_LOAD, SOAK_RSS_GROWTH_MIB = 0.7, 100.0  # --soak: the load, and the mesh's RSS growth allowed in its second half
CHURN_BASE, CHURN_MODEL, CHURN_S, CHURN_LIVE, CHURN_REQUESTS = "minilm", "support", 2.0, 4, 5


@dataclass
class Bench:
    args: argparse.Namespace
    run_dir: Path
    key: str
    rate: float
    samples: list[texts.Sample]
    capacity_rps: float | None = None
    reference: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)   # what the current run's fault reports beside the figures


@dataclass
class Victim:
    name: str          # a service's name in mesh.json, or "redis"
    pid: int
    models: tuple[str, ...]   # the models it serves (those whose recovery is timed)


# -- the mesh ------------------------------------------------------------------------------------------------

def start(args: argparse.Namespace) -> MeshState:
    """The default deployments, each as --shards scheduler processes."""
    models = [*MODELS, *([CHURN_BASE] if args.soak else [])]   # a soak's tenants' adapters sit on the base
    options = MeshOptions(run_dir=args.out / "run", gateway_port=0, workers=args.workers, gateways=args.gateways,
                          worker_threads=args.worker_threads, env={"ACADEMUS_MODELS": ",".join(models)},
                          standby=args.standby, launcher=args.launcher)
    return up(replace(options, deployments=[replace(d, shards=args.shards) for d in default_deployments(options)]))


def wait_ready(run_dir: Path, workers: int, timeout_s: float = 180.0) -> float:
    """Seconds until every process serves, every worker is placed again and every standby (`--standby`) is
    built: a fault then meets the mesh as a node that has run a while would."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        report, state = status(run_dir), MeshState.load(run_dir)
        if report["redis"]["health"] == "SERVING" and all(s["health"] == "SERVING" for s in report["services"]) \
                and all(standby_ready(s) for s in state.services if s.standby_pid):
            wait_placed(state, workers, timeout_s)
            return time.monotonic() - began
        time.sleep(0.2)
    raise TimeoutError(f"the mesh in {run_dir} not healthy after {timeout_s}s: {status(run_dir)}")


def find_victim(run_dir: Path, fault: Fault) -> Victim:
    state = MeshState.load(run_dir)
    if fault.target == "redis":
        return Victim("redis", state.redis_pid or 0, MODELS)
    if fault.target == "scheduler":
        address = scheduler_address(state, HIT_BY_SCHEDULER)
        proc = next(s for s in state.services if s.address == address)
        return Victim(proc.name, proc.pid, (HIT_BY_SCHEDULER,))
    name = {"worker": "worker-0", "gateway": "gateway"}[fault.target]
    return Victim(name, next(s.pid for s in state.services if s.name == name), MODELS)


def scheduler_address(state: MeshState, model: str) -> str:
    client, keys = redis.Redis.from_url(state.redis_url, decode_responses=True), Keys(state.key_prefix)
    for scheduler_id in client.smembers(keys.schedulers()):
        registration = client.hgetall(keys.scheduler(scheduler_id))
        if model in registration.get("models", "").split(","):
            return registration["address"]
    raise LookupError(f"no scheduler registered for {model}")


def current_pid(run_dir: Path, name: str) -> int:
    state = MeshState.load(run_dir)
    return (state.redis_pid or 0) if name == "redis" else next(s.pid for s in state.services if s.name == name)


def serving(run_dir: Path, name: str) -> bool:
    state = MeshState.load(run_dir)
    if name == "redis":
        try:
            return bool(redis.Redis.from_url(state.redis_url, socket_connect_timeout=0.5).ping())
        except redis.exceptions.RedisError:
            return False
    process = next(s for s in state.services if s.name == name)
    return health(process.address, 0.5, state.credentials(process)) == "SERVING"   # over the mesh's TLS if any


def serves_again(run_dir: Path, victim: Victim, limit_s: float) -> float | None:
    """Seconds from now until the victim serves and is registered again (its heartbeat's key, which lapsed while
    it was frozen); None past `limit_s`."""
    began = time.monotonic()
    while time.monotonic() - began < limit_s:
        if serving(run_dir, victim.name) and registered(run_dir, victim.name):
            return time.monotonic() - began
        time.sleep(0.05)
    return None


def registered(run_dir: Path, name: str) -> bool:
    """A worker's heartbeat key, or a scheduler's registration, is in Redis."""
    state = MeshState.load(run_dir)
    client, keys = redis.Redis.from_url(state.redis_url, decode_responses=True), Keys(state.key_prefix)
    if name.startswith("worker"):
        return bool(client.exists(keys.worker(name)))
    address = next(s.address for s in state.services if s.name == name)
    return any(client.hget(keys.scheduler(s), "address") == address for s in client.smembers(keys.schedulers()))


def replaced_after(run_dir: Path, victim: Victim, limit_s: float) -> float | None:
    """Seconds from now until a new process has replaced the victim and serves; None past `limit_s`."""
    began = time.monotonic()
    while time.monotonic() - began < limit_s:
        pid = current_pid(run_dir, victim.name)
        if pid != victim.pid and pid_alive(pid) and serving(run_dir, victim.name):
            return time.monotonic() - began
        time.sleep(0.05)
    return None


def restarts(run_dir: Path) -> dict[str, int]:
    state = MeshState.load(run_dir)
    return {"redis": state.redis_restarts} | {s.name: s.restarts for s in state.services}


def gauges(run_dir: Path) -> dict[str, float]:
    """The queue and in-flight gauges, summed per process (nonzero ones only)."""
    out = {}
    for s in MeshState.load(run_dir).services:
        try:
            total = sum(p.value for p in scrape(s.metrics_port) if p.name in GAUGES)
        except OSError:
            total = float("nan")   # not serving its metrics (yet)
        if total:
            out[s.name] = total
    return out


# every service's metric samples at one moment: (its package, e.g. "gateway", and the sample), one scrape a process
MeshMetrics = list[tuple[str, Sample]]


def mesh_metrics(run_dir: Path) -> MeshMetrics:
    return [(s.service, p) for s in MeshState.load(run_dir).services for p in scrape(s.metrics_port)]


def counters(metrics: MeshMetrics) -> dict[str, float]:
    """COUNTERS summed over the mesh's processes, one entry a name and label set: the work done and dropped."""
    out: dict[str, float] = {}
    for _, p in metrics:
        if p.name in COUNTERS:
            key = p.name + "".join(f",{k}={v}" for k, v in sorted(p.labels.items()) if k != "model")
            out[key] = out.get(key, 0.0) + p.value
    return out


def histogram_buckets(metrics: MeshMetrics, name: str, service: str, **labels: str) -> dict[float, float]:
    """A histogram's cumulative counts by upper bound (s), summed over the `service` processes and the label
    values not given in `labels`."""
    out: dict[float, float] = {}
    for of, p in metrics:
        if of == service and p.name == f"{name}_bucket" and all(p.labels.get(k) == v for k, v in labels.items()):
            bound = float(p.labels["le"])
            out[bound] = out.get(bound, 0.0) + p.value
    return out


def metric_figures(start: MeshMetrics, end: MeshMetrics) -> dict:
    """What the mesh counted between two reads with no process restarted between (each would count from 0):
    the work done and dropped, the gateways' time to a refusal (academus_rpc_error_seconds: their own share of
    it), and each model's waits in its schedulers' queues against the wait bound (ACADEMUS_MAX_QUEUE_WAIT_MS)."""
    counted, now = counters(start), counters(end)

    def refusals(metrics: MeshMetrics) -> dict[float, float]:
        return histogram_buckets(metrics, "academus_rpc_error_seconds", "gateway", code="RESOURCE_EXHAUSTED")

    def waits(metrics: MeshMetrics, model: str) -> dict[float, float]:
        return histogram_buckets(metrics, "academus_scheduler_queue_wait_seconds", "scheduler", model=model)

    queue_wait = {}
    for model in MODELS:
        before, after = waits(start, model), waits(end, model)
        queue_wait[model] = {"p99_ms": bucket_p99_ms(before, after), "over_1s": bucket_share_over(before, after, 1.0),
                             "over_2s": bucket_share_over(before, after, 2.0)}
    return {"counters": {k: round(v - counted.get(k, 0.0), 1) for k, v in now.items() if v != counted.get(k)},
            "gateway_refusal_p99_ms": bucket_p99_ms(refusals(start), refusals(end)), "queue_wait": queue_wait}


def bucket_share_over(before: dict[float, float], after: dict[float, float], bound_s: float) -> float | None:
    """The share of the observations between the two reads above `bound_s` (a bucket bound)."""
    total = after.get(float("inf"), 0.0) - before.get(float("inf"), 0.0)
    if total <= 0:
        return None
    within = after.get(bound_s, 0.0) - before.get(bound_s, 0.0)
    return round(1 - within / total, 4)


def bucket_p99_ms(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The bucket bound (ms) under which 99 % of the observations between the two reads fell (None: none)."""
    counts = {bound: after[bound] - before.get(bound, 0.0) for bound in sorted(after)}
    total = counts.get(float("inf"), 0.0)
    if total <= 0:
        return None
    return next(bound * 1e3 for bound, n in counts.items() if n >= 0.99 * total)


def gauges_back_to_zero(run_dir: Path, limit_s: float = 30.0) -> tuple[float | None, dict[str, float]]:
    """Seconds after the load until every queue and in-flight gauge reads 0 (None: not within `limit_s`),
    and what was left then."""
    began = time.monotonic()
    while (left := gauges(run_dir)) and time.monotonic() - began < limit_s:
        time.sleep(0.2)
    return (None if left else round(time.monotonic() - began, 2)), left


class RssSampler(threading.Thread):
    """Every mesh process's RSS (MiB, /proc/<pid>/status) every `period_s`, from `t0` (perf_counter), and the
    machine's steal so far (`host_steal_s`)."""

    def __init__(self, run_dir: Path, t0: float, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.t0, self.period_s = run_dir, t0, period_s
        self.samples: list[dict] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period_s):
            state = MeshState.load(self.run_dir)
            pids = {s.name: s.pid for s in state.services} | {"redis": state.redis_pid,
                                                                "supervisor": state.supervisor_pid}
            self.samples.append({"t": round(time.perf_counter() - self.t0, 2),
                                 "rss_mib": {n: rss_mib(p) for n, p in pids.items() if p},
                                 "steal_s": host_steal_s()})


def rss_mib(pid: int) -> float | None:
    return None if (kib := process_memory_kib(pid)) is None else round(kib / 1024, 1)   # None: gone, or a zombie


def host_steal_s(stat: Path = Path("/proc/stat")) -> float | None:
    """CPU seconds the hypervisor has kept from this machine's virtual CPUs since boot (steal, all CPUs summed);
    None where the kernel does not count it."""
    try:
        return int(stat.read_text().split("\n", 1)[0].split()[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def steal_figures(samples: list[dict]) -> dict[str, float] | None:
    """The host's steal over a run, and the most of it between two samples: a pause of the host's stalls every
    process at once, so a run's slowest requests (a refusal's p99 of a few dozen) may be the host's, not the mesh's."""
    values = [v for sample in samples if (v := sample.get("steal_s")) is not None]
    if len(values) < 2:
        return None
    return {"total_s": round(values[-1] - values[0], 2),
            "most_between_samples_s": round(max(b - a for a, b in itertools.pairwise(values)), 2)}


# -- load and faults -----------------------------------------------------------------------------------------

async def measure_capacity(bench: Bench, gateways: list[str]) -> float:
    """Requests/s the mesh completes under a closed loop on both models at once."""
    async with GatewaySpread(gateways, bench.key, bench.args.timeout, own_connections=True) as spread:
        runs = await asyncio.gather(*(runner.run_closed(spread, m, bench.args.capacity_callers, bench.samples,
                                                        bench.args.timeout, bench.args.capacity_s) for m in MODELS))
    return sum(answered_rps(run, run.duration_s) for run in runs)


def answered_rps(run: RunResult, seconds: float) -> float:
    """The run's answers with a result (code OK) a second, over `seconds`."""
    return sum(r.code == "OK" for r in run.records) / seconds


def arrivals(bench: Bench, model: int) -> list[float]:
    return schedule.poisson(bench.rate / len(MODELS), bench.args.duration, bench.args.seed + model)


async def inject(bench: Bench, fault: Fault, t0: float) -> tuple[float, Victim | None]:
    """Waits for the fault's time, injects it; returns when it happened (seconds from t0) and its victim."""
    if fault.target == "clients":   # started ahead: a Python process takes seconds to start on a loaded host
        await asyncio.sleep(max(0.0, bench.args.fault_at - CLIENTS_LEAD_S - (time.perf_counter() - t0)))
        clients = await start_clients(bench)
    await asyncio.sleep(max(0.0, bench.args.fault_at - (time.perf_counter() - t0)))
    if fault.target == "clients":
        bench.notes["clients_killed_mid_rpc"] = await kill_clients(clients)
        return time.perf_counter() - t0, None
    if fault.target == "tenant":
        return time.perf_counter() - t0, None
    victim = find_victim(bench.run_dir, fault)
    os.kill(victim.pid, fault.signal)
    return time.perf_counter() - t0, victim


async def back_after(bench: Bench, fault: Fault, injected: asyncio.Task) -> float | None:
    """Seconds from the fault until the victim's replacement serves, or a frozen victim, continued --thaw-at
    seconds after, serves again (None: no victim, or not within 120 s)."""
    _, victim = await injected
    if victim is None:
        return None
    if fault.signal != signal.SIGSTOP:
        return await asyncio.to_thread(replaced_after, bench.run_dir, victim, 120.0)
    began = time.monotonic()
    await asyncio.sleep(bench.args.thaw_at)
    os.kill(victim.pid, signal.SIGCONT)
    again = await asyncio.to_thread(serves_again, bench.run_dir, victim, 120.0)
    return None if again is None else time.monotonic() - began


async def start_clients(bench: Bench) -> list[asyncio.subprocess.Process]:
    """--clients clients over --client-processes processes, each client its own connection to the gateway,
    every one connected and waiting for the word to send."""
    gateway, args = MeshState.load(bench.run_dir).gateway, bench.args
    processes = max(1, min(args.client_processes, args.clients))
    shares = [args.clients // processes + (i < args.clients % processes) for i in range(processes)]
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, "-m", "academus.loadgen.chaos_bench", "doomed-client", gateway, bench.key, MODELS[0],
        str(share), str(args.client_requests), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        for share in shares]
    for proc in procs:
        await asyncio.wait_for(proc.stdout.readline(), 120)   # "ready"
    return procs


async def kill_clients(procs: list[asyncio.subprocess.Process]) -> dict[str, int]:
    """Has every process's clients send their requests at once and SIGKILLs it once they are on the wire; returns
    how many processes were killed with calls unanswered (not exited with every answer) and their clients."""
    for proc in procs:
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
    clients = []
    for proc in procs:
        clients.append(int((await asyncio.wait_for(proc.stdout.readline(), 60)).split()[1]))   # "sent N"
        with contextlib.suppress(ProcessLookupError):   # its calls all answered already: it has exited
            proc.kill()
    killed = [await proc.wait() == -signal.SIGKILL for proc in procs]
    return {"processes": sum(killed), "clients": sum(n for n, k in zip(clients, killed, strict=True) if k)}


async def refusal_probe(bench: Bench, stop: asyncio.Event) -> dict:
    """A light client of its own process beside an overload (PROBE_RATE req/s to the students): the time to a
    refusal as a client sees it whose own event loop is not saturated, as the load generator's is."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "academus.loadgen.chaos_bench", "refusal-probe", MeshState.load(bench.run_dir).gateway,
        bench.key, MODELS[1], str(PROBE_RATE), str(bench.args.timeout), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE)
    await stop.wait()
    out, _ = await proc.communicate(b"stop\n")
    return {"refusal_probe": json.loads(out.decode().strip().splitlines()[-1])}


def probe_client(argv: list[str]) -> int:
    """`refusal-probe GATEWAY KEY MODEL RATE TIMEOUT`: says "ready" once its client is made, then Poisson RATE req/s
    of one short text each until a line on stdin; prints the answers' and the refusals' counts and latencies (p50,
    p99 ms) as one JSON line."""
    gateway, key, model, rate, timeout = argv[0], argv[1], argv[2], float(argv[3]), float(argv[4])

    async def probe() -> dict:
        records: list[tuple[str, float]] = []
        refusals: dict[str, list[float]] = {}     # by origin
        arrivals = iter(schedule.poisson(rate, 3600, seed=7))
        async with AsyncClient(gateway, api_key=key, timeout=timeout, own_connection=True) as client:
            print("ready", flush=True)   # the caller times its run from here, after the imports

            async def one() -> None:
                sent, origin = time.perf_counter(), None
                try:
                    await client.infer(model, ["a light client beside the overload"])
                    code = "OK"
                except AcademusError as e:
                    code = e.code
                    origin = refusal_origin(e.details) if code == "RESOURCE_EXHAUSTED" else None
                ms = (time.perf_counter() - sent) * 1e3
                records.append((code, ms))
                if origin is not None:
                    refusals.setdefault(origin, []).append(ms)

            start, calls = time.perf_counter(), []
            stopped = asyncio.ensure_future(asyncio.to_thread(sys.stdin.readline))
            while not stopped.done():
                await asyncio.wait([stopped], timeout=max(0.0, next(arrivals) - (time.perf_counter() - start)))
                calls.append(asyncio.ensure_future(one()))
            await asyncio.gather(*calls)
        by_code = {code: [m for c, m in records if c == code] for code in sorted({c for c, _ in records})}
        return {code: latencies(ms) for code, ms in by_code.items()} | {
            "refusals_by_origin": {origin: latencies(ms) for origin, ms in sorted(refusals.items())}}

    print(json.dumps(asyncio.run(probe())), flush=True)
    return 0


def doomed_client(argv: list[str]) -> int:
    """`doomed-client GATEWAY KEY MODEL CLIENTS N`: opens CLIENTS clients, each on its own connection, says "ready";
    on a line on stdin has each send N long requests at once, says "sent CLIENTS" once they are on the wire, and
    waits for their answers (or to be killed)."""
    gateway, key, model, clients, count = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])

    async def send() -> None:
        async with contextlib.AsyncExitStack() as stack:
            opened = [await stack.enter_async_context(AsyncClient(gateway, api_key=key, timeout=60,
                                                                  own_connection=True)) for _ in range(clients)]
            await asyncio.gather(*(c.infer(model, ["a connection made before"]) for c in opened))
            print("ready", flush=True)
            await asyncio.to_thread(sys.stdin.readline)
            calls = [asyncio.ensure_future(c.infer(model, [f"{c_i} {i} {LONG_TEXT}"]))
                     for c_i, c in enumerate(opened) for i in range(count)]
            await asyncio.sleep(0.05)
            print(f"sent {clients}", flush=True)
            await asyncio.gather(*calls, return_exceptions=True)

    asyncio.run(send())
    return 0


async def tenant_load(bench: Bench, gateways: list[str], key: str) -> RunResult:
    """The flooding tenant: 10x its quota from the fault's time to the end, on the first model."""
    span = bench.args.duration - bench.args.fault_at
    times = [bench.args.fault_at + t for t in schedule.poisson(10 * tenant_quota(bench), span, bench.args.seed + 7)]
    async with GatewaySpread(gateways, key, bench.args.timeout, own_connections=True) as spread:
        return await runner.run(spread, MODELS[0], times, bench.samples, bench.args.timeout, bench.args.duration)


def tenant_quota(bench: Bench) -> float:
    return bench.args.tenant_quota or max(1.0, round(bench.rate / 20, 1))


async def make_tenant(state: MeshState, name: str, quota: float) -> str:
    client = connect(state.redis_url)
    try:
        registry = TenantRegistry(client, Keys(state.key_prefix))
        if name in await registry.tenants():
            await registry.delete_tenant(name)
        return await registry.create_tenant(name, rate=quota, burst=max(1, round(quota)))
    finally:
        await client.aclose()


Beside = Callable[[asyncio.Event], Awaitable[dict]]   # runs beside the load until the event; its figures


async def loaded_run(bench: Bench, fault: Fault | None, beside: Beside | None = None) -> tuple[list[RunResult], dict]:
    """The load on both models, with `fault` injected at its time and `beside` running meanwhile (its figures
    under "beside"); the runs and what the fault left."""
    state = MeshState.load(bench.run_dir)
    gateways = [state.gateway] * CONNECTIONS
    tenant_key = ""
    if fault is not None and fault.target == "tenant":
        tenant_key = await make_tenant(state, "chaos-flood", tenant_quota(bench))
    sampler = RssSampler(bench.run_dir, time.perf_counter())
    sampler.start()
    async with GatewaySpread(gateways, bench.key, bench.args.timeout, own_connections=True) as spread:
        t0 = sampler.t0
        loads = [runner.run(spread, m, arrivals(bench, i), bench.samples, bench.args.timeout, bench.args.duration)
                 for i, m in enumerate(MODELS)]
        flood = [tenant_load(bench, gateways, tenant_key)] if tenant_key else []
        injected = asyncio.create_task(inject(bench, fault, t0)) if fault is not None else None
        back = asyncio.create_task(back_after(bench, fault, injected)) if injected is not None else None
        stop = asyncio.Event()
        besides = asyncio.create_task(beside(stop)) if beside is not None else None
        results = await asyncio.wait_for(asyncio.gather(*loads, *flood), bench.args.duration + 120)
        stop.set()
        at, victim = await injected if injected is not None else (None, None)
    sampler.done.set()
    extra = {"fault_at_s": None if at is None else round(at, 3), "rss": sampler.samples}
    if besides is not None:
        extra["beside"] = await besides
    if victim is not None:
        back_s = await back
        extra |= {"victim": victim.name, "affected_models": list(victim.models),
                  "victim_back_s": None if back_s is None else round(back_s, 3)}
    if tenant_key:
        extra["tenant"] = tenant_summary(results[-1])
        results = results[:-1]
    return list(results), extra


def tenant_summary(run: RunResult) -> dict:
    refused = [r.latency_ms for r in run.records if r.code == "RESOURCE_EXHAUSTED"]
    return {"sent": len(run.records), "ok": sum(r.code == "OK" for r in run.records),
            "errors": dict(Counter(r.code for r in run.records if r.code != "OK")),
            "refusal_p50_ms": round(percentile(refused, 50), 3) if refused else None}


def probe_key(bench: Bench) -> str:
    """A tenant key made before the fault, checked to work."""
    key = create_key(MeshState.load(bench.run_dir), "chaos-probe")
    with Client(MeshState.load(bench.run_dir).gateway, api_key=key, timeout=10) as client:
        client.infer(MODELS[0], ["made before the fault"])
    return key   # Redis wrote it to its AOF before it replied: a kill -9 (not a power cut) cannot lose it


def key_works(bench: Bench, key: str, limit_s: float = 60.0) -> dict:
    """The key still in Redis after the restart, and a request with it answered."""
    state = MeshState.load(bench.run_dir)
    stored = bool(redis.Redis.from_url(state.redis_url).exists(Keys(state.key_prefix).api_key(key)))
    began, code = time.monotonic(), ""
    with Client(state.gateway, api_key=key, timeout=5) as client:
        while time.monotonic() - began < limit_s:
            try:
                client.infer(MODELS[0], ["made before the fault"])
                return {"key_in_redis_after": stored, "key_works_after": True}
            except AcademusError as e:
                code = e.code
                time.sleep(0.5)
    return {"key_in_redis_after": stored, "key_works_after": False, "key_error": code}


# -- figures -------------------------------------------------------------------------------------------------

def summarize(bench: Bench, runs: list[RunResult], extra: dict) -> dict:
    timeout_ms = bench.args.timeout * 1e3
    records = [r for run in runs for r in run.records]
    expected = sum(len(arrivals(bench, i)) for i in range(len(MODELS)))
    late = sum(r.latency_ms > timeout_ms + LATE_MS for r in records)
    failed = [r for r in records if r.code != "OK"]
    at = extra.get("fault_at_s")
    affected = set(extra.get("affected_models", ()))
    unhit = [run for run in runs if run.model not in affected] or runs
    goodput = {run.model: answered_rps(run, bench.args.duration) for run in runs}
    out = {"sent": expected, "answered": len(records), "ok": len(records) - len(failed),
           "lost": expected - len(records) + late, "failed": len(failed),
           "failed_pct": round(100 * len(failed) / max(expected, 1), 2),
           "errors": dict(Counter(r.code for r in failed)),
           "error_examples": runner.error_examples(records, per_code=2),
           "p99_ms": p99(unhit), "p99_models": [run.model for run in unhit],
           "refusal_p99_ms": refusal_p99(records),
           "refusals_by_origin": refusals_by_origin(records),
           "goodput_rps": round(sum(goodput.values()), 1),
           "goodput_rps_by_model": {model: round(rps, 1) for model, rps in goodput.items()},
           "send_late_p99_ms": round(percentile([r.late_ms for r in records], 99), 2),
           "failed_by_second": failed_by_second(records, bench.args.duration)}
    if at is not None:
        out["errors_after_fault"] = dict(Counter(r.code for r in failed if r.sent_at >= at))
        out["recover_s"] = recover_s(runs, affected, at) if affected else None
    return out | {k: v for k, v in extra.items() if k != "rss"}


def p99(runs: list[RunResult]) -> float | None:
    latencies = [r.latency_ms for run in runs for r in run.records if r.code == "OK"]
    return round(percentile(latencies, 99), 2) if latencies else None


def refusal_p99(records: list) -> float | None:
    """How long a RESOURCE_EXHAUSTED took to come back, p99 (ms): a prompt refusal is one in milliseconds."""
    return runner.error_latency(records).get("RESOURCE_EXHAUSTED", {}).get("p99")


# Where a RESOURCE_EXHAUSTED came from, by its message: the gateway's edge during a pushback, a scheduler's
# queue (its wait bound, or its count), a tenant's quota.
REFUSAL_ORIGINS = (("every scheduler serving", "gateway"), ("scheduler queue", "scheduler"), ("rate limit", "quota"))


def refusal_origin(details: str) -> str:
    return next((name for text, name in REFUSAL_ORIGINS if text in details), "other")


def latencies(ms: list[float]) -> dict[str, float]:
    return {"count": len(ms), "p50_ms": round(percentile(ms, 50), 2), "p99_ms": round(percentile(ms, 99), 2)}


def refusals_by_origin(records: list) -> dict[str, dict[str, float]]:
    """Each origin's RESOURCE_EXHAUSTED count and time to come back (p50, p99 ms): a refusal at the gateway's edge
    costs no hop; one a scheduler gives, a hop to a loop that may be busy."""
    by_origin: dict[str, list[float]] = {}
    for r in records:
        if r.code == "RESOURCE_EXHAUSTED":
            by_origin.setdefault(refusal_origin(r.details), []).append(r.latency_ms)
    return {origin: latencies(ms) for origin, ms in sorted(by_origin.items())}


def probe_refusal_p99(figures: dict) -> float | None:
    """The refusal probe's RESOURCE_EXHAUSTED p99 (ms), when it ran beside the load and was refused."""
    return figures.get("beside", {}).get("refusal_probe", {}).get("RESOURCE_EXHAUSTED", {}).get("p99_ms")


def overload_targets(figures: dict, capacity_rps: float) -> dict[str, bool]:
    """The issue's overload row, for a fault-free run past capacity: nothing lost, refusals at once (to the load
    generator, and to the light client beside it), and the answers at least 90 % of what the mesh serves at
    capacity."""
    refusal, probe = figures.get("refusal_p99_ms"), figures.get("probe_refusal_p99_ms")
    return {"lost is 0": figures["lost"] == 0,
            f"refusal_p99_ms <= {REFUSAL_P99_MS}": refusal is not None and refusal <= REFUSAL_P99_MS,
            f"probe_refusal_p99_ms <= {REFUSAL_P99_MS}": probe is not None and probe <= REFUSAL_P99_MS,
            f"goodput >= {GOODPUT_SHARE} x capacity": figures["goodput_rps"] >= GOODPUT_SHARE * capacity_rps}


def recover_s(runs: list[RunResult], affected: set[str], at: float) -> float | None:
    """From the fault to the first success, on a model it hit, of a request sent after it."""
    done = [r.done_at for run in runs if run.model in affected
            for r in run.records if r.code == "OK" and r.sent_at >= at]
    return round(min(done) - at, 3) if done else None


def failed_by_second(records: list, duration_s: float) -> list[list[int]]:
    """[sent, failed] of the requests sent in each second of the run (the report's timeline, by when sent)."""
    return [[b["offered"], b["offered_failed"]] for b in analysis.timeline(records, duration_s)]


def near_fault(figures: dict) -> range:
    """The seconds the fault hit: from it until its victim serves again, NEAR_FAULT_S at least."""
    at = figures["fault_at_s"]   # a few ms past its second: rounded, so 5 s are 5 seconds, not 6
    return range(round(at), round(at + max(NEAR_FAULT_S, figures.get("victim_back_s") or 0.0)))


def excess_near_fault(figures: dict, reference: dict, seconds: range) -> float:
    """The requests sent in `seconds` (those the fault hit) that failed beyond the share of the same seconds of
    the reference run."""
    sent, failed = (sum(figures["failed_by_second"][s][i] for s in seconds) for i in (0, 1))
    ref_sent, ref_failed = (sum(reference["failed_by_second"][s][i] for s in seconds) for i in (0, 1))
    return max(0.0, failed - sent * ref_failed / max(ref_sent, 1))


def against_reference(figures: dict, reference: dict) -> dict:
    """Failures beyond the reference run's (same schedule, no fault): over the whole runs, and in the seconds the
    fault hit (`near_fault`); and the p99 of the same models there. Past capacity, fault-free runs fail shares
    that differ by more than the 5 % target, in seconds that do not keep their difference, so only the seconds
    the fault hit say what it cost."""
    base_failed = reference["failed"] * figures["sent"] / max(reference["sent"], 1)
    excess, seconds = max(0.0, figures["failed"] - base_failed), near_fault(figures)
    near, sent = excess_near_fault(figures, reference, seconds), max(figures["sent"], 1)
    return {"excess_failed": round(excess), "excess_failed_pct": round(100 * excess / sent, 2),
            "excess_near_fault": round(near), "excess_near_fault_pct": round(100 * near / sent, 2),
            "near_fault_s": len(seconds),
            "reference_failed_pct": reference["failed_pct"],
            "reference_p99_ms": reference["p99_by_models"].get("+".join(figures["p99_models"]))}


def verdicts(fault: Fault, figures: dict) -> dict[str, bool]:
    kind = "redis" if fault.target == "redis" else "term" if fault.signal == signal.SIGTERM else "kill"
    if fault.target in ("clients", "tenant"):
        kind = "term"   # neither should fail a request of the others
    checks = {}
    for what, limit in TARGETS[kind]:
        value = figures.get(what)
        checks[f"{what} {'is' if isinstance(limit, bool) else '<='} {limit}"] = (
            value is limit if isinstance(limit, bool) else value is not None and value <= limit)
    return checks


def rss_plot(samples: list[dict], path: Path, events: dict[str, float]) -> Path:
    import matplotlib.pyplot as plt  # Agg, as plots.py sets it

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in sorted({n for s in samples for n in s["rss_mib"]}):
        points = [(s["t"], s["rss_mib"].get(name)) for s in samples]
        ax.plot([t for t, _ in points], [v for _, v in points], label=name)
    for label, at in events.items():
        ax.axvline(at, color="red", linestyle="--", linewidth=1)
        ax.text(at, ax.get_ylim()[1], label, color="red", fontsize=8, va="top")
    ax.set(xlabel="time (s)", ylabel="RSS (MiB)", title="RSS of every mesh process")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_pngs(bench: Bench, name: str, runs: list[RunResult], extra: dict) -> list[str]:
    merged = RunResult("+".join(MODELS), "default deployments", bench.rate, bench.args.duration,
                       [r for run in runs for r in run.records])
    events = {name: extra["fault_at_s"]} if extra.get("fault_at_s") is not None else {}
    return [str(plots.timeline(merged, bench.args.out / f"{name}.png", events=events)),
            str(rss_plot(extra["rss"], bench.args.out / f"{name}-rss.png", events))]


def rss_summary(samples: list[dict]) -> dict[str, dict[str, float]]:
    out = {}
    for name in sorted({n for s in samples for n in s["rss_mib"]}):
        values = [s["rss_mib"][name] for s in samples if s["rss_mib"].get(name) is not None]
        if values:
            out[name] = {"first": values[0], "max": max(values), "last": values[-1]}
    return out


# -- the runs ------------------------------------------------------------------------------------------------

async def one_run(bench: Bench, fault: Fault | None, beside: Beside | None = None, name: str = "") -> dict:
    name = name or (fault.name if fault else "reference")
    before = restarts(bench.run_dir)
    key = probe_key(bench) if fault is not None and fault.target == "redis" else ""
    bench.notes = {}
    start = await asyncio.to_thread(mesh_metrics, bench.run_dir)
    runs, extra = await loaded_run(bench, fault, beside)
    figures = summarize(bench, runs, extra) | bench.notes
    figures["probe_refusal_p99_ms"] = probe_refusal_p99(figures)
    figures["rss_growth_second_half_mib"] = rss_growth(extra["rss"], bench.args.duration / 2)
    figures["gauges_zero_after_s"], figures["gauges_left"] = await asyncio.to_thread(gauges_back_to_zero,
                                                                                      bench.run_dir)
    figures["ready_again_s"] = round(await asyncio.to_thread(wait_ready, bench.run_dir, bench.args.workers), 2)
    if key:
        figures |= await asyncio.to_thread(key_works, bench, key)
    after = restarts(bench.run_dir)
    figures["restarts"] = {n: after[n] - before.get(n, 0) for n in after if after[n] != before.get(n, 0)}
    if not figures["restarts"]:   # a restarted process counts from 0 again
        figures |= metric_figures(start, await asyncio.to_thread(mesh_metrics, bench.run_dir))
    figures["rss_mib"] = rss_summary(extra["rss"])
    figures["host_steal"] = steal_figures(extra["rss"])
    figures["pngs"] = write_pngs(bench, name, runs, extra)
    if fault is None:
        figures["p99_by_models"] = {"+".join(m.model for m in subset): p99(subset) for subset in ([r] for r in runs)}
        figures["p99_by_models"]["+".join(r.model for r in runs)] = p99(runs)
        if bench.capacity_rps and bench.rate > bench.capacity_rps:
            figures["goodput_of_capacity"] = round(figures["goodput_rps"] / bench.capacity_rps, 3)
            figures["targets"] = overload_targets(figures, bench.capacity_rps)
    else:
        figures |= against_reference(figures, bench.reference)
        figures["targets"] = verdicts(fault, figures)
    print(f"{name}: {json.dumps(dict(zip(TABLE_KEYS, table_cells(figures), strict=True)))}", file=sys.stderr)
    return figures


TABLE_KEYS = ("sent", "failed_pct", "excess_failed", "excess_near_fault", "lost", "recover_s", "victim_back_s",
              "p99_ms", "reference_p99_ms", "refusal_p99_ms", "probe_refusal_p99_ms", "gateway_refusal_p99_ms",
              "goodput_rps", "gauges_zero_after_s", "steal_most_s", "errors")


def table_cells(figures: dict) -> list:
    """A run's figures in TABLE_KEYS' order; steal_most_s, the most the host took between two samples (its pauses)."""
    steal = figures.get("host_steal") or {}
    return [steal.get("most_between_samples_s") if k == "steal_most_s" else figures.get(k) for k in TABLE_KEYS]


def table(summary: dict) -> str:
    head = f"{'fault':<15} {'sent':>5} {'failed%':>7} {'excess':>6} {'near':>5} {'lost':>4} {'recover_s':>9} " \
           f"{'back_s':>6} {'p99_ms':>8} {'ref_p99':>8} {'refuse99':>8} {'probe99':>8} {'gw_ref99':>8} " \
           f"{'goodput':>7} {'gauges0_s':>9} {'steal_s':>7}  errors"
    lines = [head]
    for name, f in summary["runs"].items():
        cells = table_cells(f)
        fmt = ["{:>5}", "{:>7}", "{:>6}", "{:>5}", "{:>4}", "{:>9}", "{:>6}", *["{:>8}"] * 5, "{:>7}", "{:>9}",
               "{:>7}", "  {}"]
        lines.append(f"{name:<15} " + " ".join(spec.format("-" if v is None else _short(v))
                                               for spec, v in zip(fmt, cells, strict=True)))
    return "\n".join(lines)


def _short(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, dict):
        return ",".join(f"{k}:{v}" for k, v in value.items()) or "-"
    return str(value)


def load_of(args: argparse.Namespace) -> float:
    """The offered load as a multiple of capacity: --load, else 0.7 for a soak and 2 for the faults."""
    return args.load if args.load is not None else SOAK_LOAD if args.soak else 2.0


async def soak_run(bench: Bench) -> dict:
    """--soak: the fault-free run for --duration while tenants come and go (`churn`, its figures under
    "beside"), judged by the mesh's RSS growth over the second half (the issue: within SOAK_RSS_GROWTH_MIB)."""
    adapters = await asyncio.to_thread(churn_adapters)
    churning = functools.partial(churn, MeshState.load(bench.run_dir), adapters, bench.samples)
    figures = await one_run(bench, None, beside=churning, name="soak")
    total = round(sum(figures["rss_growth_second_half_mib"].values()), 1)
    figures["targets"] = {f"mesh RSS growth in the second half <= {SOAK_RSS_GROWTH_MIB} MiB ({total})":
                          total <= SOAK_RSS_GROWTH_MIB, "lost is 0": figures["lost"] == 0}
    return figures


def rss_growth(samples: list[dict], half_s: float) -> dict[str, float]:
    """Each process's RSS at the last sample less its RSS at the first sample from `half_s` on (MiB)."""
    later = [s for s in samples if s["t"] >= half_s]
    if len(later) < 2:
        return {}
    first, last = later[0]["rss_mib"], later[-1]["rss_mib"]
    return {name: round(last[name] - first[name], 1) for name in sorted(first.keys() & last.keys())
            if first[name] is not None and last[name] is not None}


def churn_adapters() -> list:
    """Two small sentiment adapters on the base (different seeds): what the churning tenants serve."""
    from academus.shared.training.adapters import train_adapter
    from academus.shared.training.data import load_task

    data = load_task("sentiment")
    texts, labels = [e.text for e in data.train[:64]], [data.labels[e.label] for e in data.train[:64]]
    return [train_adapter(texts, labels, CHURN_BASE, epochs=1, seed=seed, progress=False)[0] for seed in (0, 1)]


async def churn(state: MeshState, adapters: list, samples: list, stop: asyncio.Event) -> dict:
    """Every CHURN_S until `stop`: a new tenant puts an adapter in the store, registers its model on it and sends
    CHURN_REQUESTS requests to it; the oldest of more than CHURN_LIVE tenants is deleted with its adapters."""
    from academus.shared.training.onboarding import delete_tenant, publish_adapter

    state.use_as_mesh()   # the adapter store takes only the mesh's calls
    client, keys = connect(state.redis_url), Keys(state.key_prefix)
    registry, live = TenantRegistry(client, keys), []
    counts = Counter()
    try:
        while not stop.is_set():
            tenant = f"soak-{counts['made']}"
            key = await registry.create_tenant(tenant, rate=LOAD_QUOTA, burst=int(LOAD_QUOTA))
            await publish_adapter(client, keys, tenant, CHURN_MODEL, CHURN_BASE, adapters[counts["made"] % 2])
            counts["made"] += 1
            live.append(tenant)
            async with AsyncClient(state.gateway, api_key=key, timeout=10) as tenant_client:
                for i in range(CHURN_REQUESTS):
                    try:
                        await tenant_client.infer(CHURN_MODEL, [samples[(counts["made"] + i) % len(samples)].text])
                        counts["answered"] += 1
                    except AcademusError as e:
                        counts[f"failed_{e.code}"] += 1
            if len(live) > CHURN_LIVE:
                await delete_tenant(client, keys, live.pop(0))
                counts["deleted"] += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), CHURN_S)
    finally:
        await client.aclose()
    return dict(counts)


async def run_all(bench: Bench, faults: list[Fault]) -> dict:
    gateways = [MeshState.load(bench.run_dir).gateway] * CONNECTIONS
    if bench.args.rate <= 0:
        bench.capacity_rps = await measure_capacity(bench, gateways)
        bench.rate = load_of(bench.args) * bench.capacity_rps
        await asyncio.to_thread(gauges_back_to_zero, bench.run_dir)
    if bench.args.soak:
        return {"runs": {"soak": await soak_run(bench)}}
    summary = {"runs": {}}
    overloaded = bench.capacity_rps is not None and bench.rate > bench.capacity_rps
    bench.reference = await one_run(bench, None, beside=functools.partial(refusal_probe, bench) if overloaded else None)
    summary["runs"]["reference"] = bench.reference
    for fault in faults:
        summary["runs"][fault.name] = await one_run(bench, fault)
    return summary


def run(args: argparse.Namespace) -> dict:
    faults = (list(FAULTS.values()) if args.faults == "all" else [] if args.faults == "none"
              else [FAULTS[name] for name in args.faults.split(",")])
    if not args.soak and not 0 < args.fault_at < args.duration:
        raise SystemExit(f"chaos_bench: --fault-at ({args.fault_at}) must fall within --duration ({args.duration})")
    state = start(args)
    run_dir = Path(state.run_dir)
    try:
        # the load is a tenant's, as real traffic: each request takes its quota token in Redis (the admin
        # has no quota, and its key is cached), so a Redis fault meets the request path
        key = asyncio.run(make_tenant(state, "chaos-load", LOAD_QUOTA))
        bench = Bench(args, run_dir, key, args.rate, texts.from_task("sentiment"))
        summary = asyncio.run(run_all(bench, faults))
    finally:
        down(run_dir)
    summary = {"models": list(MODELS), "workers": args.workers, "gateways": args.gateways, "shards": args.shards,
               "capacity_rps": None if bench.capacity_rps is None else round(bench.capacity_rps, 1),
               "rate_rps": round(bench.rate, 1), "duration_s": args.duration, "fault_at_s": args.fault_at,
               "timeout_s": args.timeout} | summary
    print(table(summary))
    return summary


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.chaos_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", default="all",
                   help=f"comma-separated, of: {', '.join(FAULTS)} (default: all; none: the fault-free run only)")
    p.add_argument("--rate", type=float, default=0.0, help="offered requests/s, Poisson (default: --load x capacity)")
    p.add_argument("--load", type=float, default=None,
                   help="the offered load as a multiple of the measured capacity (default: 2; 0.7 with --soak)")
    p.add_argument("--soak", action="store_true",
                   help="instead of the faults: one run at 70 %% of capacity for --duration while tenants' adapters "
                        "come and go, reporting every process's RSS growth in the second half")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load a run")
    p.add_argument("--fault-at", type=float, default=10.0, help="seconds into a run")
    p.add_argument("--timeout", type=float, default=5.0, help="each request's deadline (s)")
    p.add_argument("--thaw-at", type=float, default=10.0, help="a frozen victim (SIGSTOP) is continued this many "
                   "seconds after the fault")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--gateways", type=int, default=1, help="gateway processes sharing the mesh's port")
    p.add_argument("--shards", type=int, default=1, help="scheduler processes a deployment")
    p.add_argument("--worker-threads", type=int, default=1, help="torch threads a worker")
    p.add_argument("--standby", action="store_true",
                   help="a standby process per worker, scheduler and gateway (`up --standby`)")
    p.add_argument("--no-launcher", dest="launcher", action="store_false",
                   help="services start and restart as plain processes (`academus up --no-launcher`)")
    p.add_argument("--clients", type=int, default=200, help="clients clients-kill kills, each its own connection")
    p.add_argument("--client-processes", type=int, default=8, help="the processes they run in")
    p.add_argument("--client-requests", type=int, default=2, help="requests each client has on the wire")
    p.add_argument("--tenant-quota", type=float, default=0.0,
                   help="the flooding tenant's quota, requests/s (default: 5%% of the load, at least 1)")
    p.add_argument("--capacity-s", type=float, default=8.0, help="seconds of the closed loop measuring capacity")
    p.add_argument("--capacity-callers", type=int, default=8, help="its callers a model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(".academus/results/chaos"))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doomed-client"]:
        return doomed_client(argv[1:])
    if argv[:1] == ["refusal-probe"]:
        return probe_client(argv[1:])
    args = parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return write_summary(args.out, run(args))


if __name__ == "__main__":
    raise SystemExit(main())
