"""Where the serving processes' CPU goes under a steady load: py-spy samples of the gateway, the scheduler
and a worker while `academus loadgen` sends Poisson traffic to one deployment (issue 4: what bounds the
students' hops and capacity on CPU).

    python -m academus.loadgen.serving_profile [--model sentiment-students --policy student]
                                               [--rate 150] [--seconds 20] [--streams]
                                               [--out .academus/results/serving_profile]

A model other than a task's student group (`--model null --policy fifo`: the stack alone) is served by one
deployment of --policy on a mesh of its own.

Needs py-spy on the PATH (the dev extras install it; the services do not need it). Each sample is
put in one class by its stack, with full file names (py-spy sees Python frames only; C code is charged
to the frame that called it):
- `model`: a torch module's forward anywhere on the stack (the worker's compute);
- `grpc_and_loop`: the innermost frame is the event loop or a thread with no Python frame below it
  (uvloop's loop, gRPC's completion-queue poller thread: gRPC core's C code), or grpc's Python package;
- `tracing`: the innermost owned frame is OpenTelemetry's or the project's span code (their own time: a
  handler the server span wraps is not tracing);
- `python`: the innermost owned frame is the project's: its request handling and the libraries it calls
  (tokenizer, protobuf, prometheus, numpy). Standard-library frames own nothing: they count for the
  nearest owned frame outside them.
Each service's `hot_spots` are the innermost frames that took the most samples (`event loop and gRPC core`
when the innermost frame is the loop's or gRPC's poller thread). Beside the samples, each process's CPU by
thread name and its context switches (from /proc), a request.
Raw samples land in `<out>/<service>.txt`; the last line printed is the summary JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

from academus.loadgen.bench import loadgen_command, run_bench, stat_cpu_s
from academus.loadgen.student_bench import add_mesh_options, group_size, set_students, start, teacher_name
from academus.shared.cli.mesh import Deployment, MeshOptions, MeshState, down, up

SAMPLE_RATE = 50  # py-spy samples a second
LOOP_FRAME = re.compile(r"^(Runner\.run \(.*/asyncio/runners\.py|Thread\.run \(.*/threading\.py):")


# Who a frame belongs to, by its file; the innermost frame with an owner names the sample's class.
OWNERS = (("/opentelemetry/", "tracing"), ("/shared/tracing.py", "tracing"), ("/grpc/", "grpc_and_loop"),
          ("/services/", "python"), ("/shared/", "python"), ("/loadgen/", "python"))


def classify(frames: list[str]) -> str:
    """The class of one sample, from its frames (outermost first) as py-spy's raw format writes them."""
    if any("/torch/nn/modules/module.py" in f for f in frames):
        return "model"
    if LOOP_FRAME.match(frames[-1]):
        return "grpc_and_loop"
    for frame in reversed(frames):
        for marker, name in OWNERS:
            if marker in frame:
                return name
    return "python"


def shares(lines: Iterable[str]) -> dict[str, float]:
    """Each class's share of the samples in py-spy raw lines (`frame;frame;... count`), and their number."""
    counts: collections.Counter[str] = collections.Counter()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if stack:
            counts[classify(stack.split(";"))] += int(count)
    total = sum(counts.values())
    return {name: round(counts[name] / total, 3) for name in sorted(counts)} | {"samples": total}


def hot_spots(lines: Iterable[str], top: int = 12) -> dict[str, float]:
    """The innermost frames that took the most samples, as `function (file)`, with their shares."""
    counts: collections.Counter[str] = collections.Counter()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        innermost = stack.split(";")[-1]
        if LOOP_FRAME.match(innermost):
            counts["event loop and gRPC core"] += int(count)
            continue
        function, _, where = innermost.partition(" (")
        counts[f"{function} ({Path(where.split(':')[0]).name})"] += int(count)
    total = sum(counts.values()) or 1
    return {name: round(n / total, 3) for name, n in counts.most_common(top)}


def start_mesh(args: argparse.Namespace, run_dir: Path) -> MeshState:
    """The task's student bench mesh for its models; else one deployment of --policy serving --model."""
    task = teacher_name(args)
    if args.model in (task, f"{task}-students", f"{task}-2l"):
        state = start(args, run_dir, 120.0)
        set_students(state, f"{task}-students", group_size(state, args))
        return state
    return up(MeshOptions(run_dir=run_dir, artifacts=args.artifacts, gateway_port=0, workers=args.workers,
                          worker_threads=args.worker_threads, deployments=[Deployment(args.policy, args.model)],
                          env={"ACADEMUS_MODELS": args.model}))


def record(pid: int, seconds: float, path: Path) -> subprocess.Popen:
    """py-spy on a running process without pausing it; only threads running or runnable are sampled."""
    return subprocess.Popen(["py-spy", "record", "--nonblocking", "--rate", str(SAMPLE_RATE),
                             "--duration", str(int(seconds)), "--format", "raw", "--full-filenames",
                             "--output", str(path), "--pid", str(pid)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run(args: argparse.Namespace) -> dict:
    if shutil.which("py-spy") is None:
        raise SystemExit("py-spy is not on the PATH: `pip install -e '.[server,dev]'` (or `pip install py-spy`)")
    run_dir = args.out / "run"
    state = start_mesh(args, run_dir)
    try:
        pids = {s.name: s.pid for s in state.services}
        client = subprocess.Popen(loadgen_command(run_dir, args.out / "loadgen", "run", "--model", args.model,
                                                  "--policy", args.policy, "--schedule", f"poisson:{args.rate}",
                                                  "--duration", str(args.seconds + 2 * args.warmup),
                                                  "--texts", f"task:{args.task}",
                                                  *(["--streams"] if args.streams else [])),
                                  stdout=subprocess.PIPE, text=True)
        time.sleep(args.warmup)
        before = {name: threads_reading(pids[name]) for name in args.services}
        spies = [record(pids[name], args.seconds, args.out / f"{name}.txt") for name in args.services]
        for spy in spies:
            spy.wait()
        after = {name: threads_reading(pids[name]) for name in args.services}
        report = json.loads(client.communicate()[0].strip().splitlines()[-1])["runs"][0]
    finally:
        down(run_dir)
    requests = args.rate * args.seconds
    samples = {name: (args.out / f"{name}.txt").read_text().splitlines() for name in args.services}
    return {"model": args.model, "policy": args.policy, "rate": args.rate, "seconds": args.seconds,
            "latency_ms": report["latency_ms"], "errors": report["errors"],
            "services": {name: {"sampled": shares(samples[name]), "hot_spots": hot_spots(samples[name])}
                         | per_request(before[name], after[name], requests) for name in args.services}}


def threads_reading(pid: int) -> dict[str, float]:
    """CPU seconds by thread name (threads of one name summed), and context switches, of a process so far."""
    out: collections.Counter[str] = collections.Counter()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat, status = (task / "stat").read_text(), (task / "status").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out["cpu:" + stat[stat.index("(") + 1:stat.rindex(")")]] += stat_cpu_s(stat)
        for line in status.splitlines():
            key, _, value = line.partition(":")
            if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
                out[key] += int(value)
    return dict(out)


def per_request(before: dict[str, float], after: dict[str, float], requests: float) -> dict:
    """CPU ms by thread name and context switches, each a request (py-spy counts a runnable thread that
    waits for a core as sampled: the CPU says how much of the sampled time computed)."""
    delta = {key: (after[key] - before.get(key, 0)) / requests for key in after}
    return {"cpu_ms_per_request": {k[4:]: round(v * 1e3, 3) for k, v in sorted(delta.items()) if k.startswith("cpu:")},
            "switches_per_request": {k.split("_")[0]: round(v, 1) for k, v in delta.items() if "ctxt" in k}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.serving_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_mesh_options(p)
    p.add_argument("--model", default="sentiment-students")
    p.add_argument("--policy", default="student")
    p.add_argument("--rate", type=float, default=150.0, help="Poisson requests/s")
    p.add_argument("--seconds", type=float, default=20.0, help="how long each process is sampled")
    p.add_argument("--warmup", type=float, default=4.0, help="seconds of load before sampling starts")
    p.add_argument("--services", default="gateway,scheduler,worker-0", type=lambda s: s.split(","))
    p.add_argument("--out", type=Path, default=Path(".academus/results/serving_profile"))
    return run_bench(p, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
