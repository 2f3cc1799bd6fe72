"""`make demo`: what Academus is for, in under three minutes on a fresh machine. It prepares what is
missing (quickly: a head trained on a subset, students from `distill --quick`), starts the local mesh
with its default deployments (the students under `student`, the teacher under `concat`), sends the
teacher and its students the same load, prints latency and throughput side by side with a PNG, and one
request's trace.

The quick preparation is smaller than the full one (`make prepare`, `academus distill --task sentiment`):
its students keep less of the teacher's accuracy, and the demo prints how much."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from academus.client import Client
from academus.loadgen.plots import latency_cdf
from academus.loadgen.runner import GatewaySpread, RunResult, run_closed
from academus.loadgen.texts import from_task
from academus.shared.cli.mesh import ADMIN_KEY_FILE, MeshOptions, MeshState, down, status, up
from academus.shared.runtime.config import home_dir
from academus.shared.runtime.tracing import format_trace, read_traces

TASK = "sentiment"
TEACHER, STUDENTS = TASK, f"{TASK}-students"
QUICK_LIMIT = 500   # examples a split for the quick head
TEXTS = ["An exhilarating, beautifully shot film with a heart of gold.",
         "Two hours of my life I will never get back: dull, shrill and pointless."]
PAIRS = [("How do I reset my password?", "I forgot my password, how can I change it?"),
         ("How do I reset my password?", "What time does the store open?")]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = time.monotonic()
    notes = prepare_quick(args.artifacts)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="academus-demo-"))
    print(f"\nstarting the mesh in {run_dir} ...", flush=True)
    # every request traced (the default is 1 in 100): the demo prints one request's trace
    state = up(MeshOptions(run_dir=run_dir, artifacts=args.artifacts, gateway_port=0, tls=args.tls,
                           env={"OTEL_BSP_SCHEDULE_DELAY": "100", "ACADEMUS_TRACE_RATIO": "1"}))
    try:
        show_mesh(run_dir)
        key = (run_dir / ADMIN_KEY_FILE).read_text().strip()
        with Client(state.gateway, api_key=key, root_certificates=trusted(state)) as client:
            show_results(client)
        runs = asyncio.run(compare(state, key, args))
        show_comparison(runs, notes, args.out or run_dir)
        show_trace(run_dir)
    finally:
        down(run_dir)
    print(f"\nmesh stopped; the demo took {time.monotonic() - started:.0f} s")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.demo", description=__doc__.split("\n")[0])
    p.add_argument("--artifacts", type=Path, default=home_dir() / "demo",
                   help="where the demo's models are (prepared quickly there when missing); the full ones: "
                        "ACADEMUS_ARTIFACTS after `make prepare` and `academus distill`")
    p.add_argument("--callers", type=int, default=16, help="callers in a closed loop, the same for both")
    p.add_argument("--seconds", type=float, default=8.0, help="each run's length")
    p.add_argument("--rounds", type=int, default=2, help="teacher and students, in alternating order")
    p.add_argument("--out", type=Path, default=None, help="folder for the PNG (default: the run folder)")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="the mesh's folder: its logs, Redis and traces, kept after the demo (default: a new "
                        "temporary folder)")
    p.add_argument("--tls", action="store_true", help="the gateway serves TLS from a local CA (`academus up --tls`)")
    return p


def trusted(state: MeshState) -> bytes | None:
    """The mesh's CA when its gateway serves TLS (the clients then connect over TLS); None: plaintext."""
    return Path(state.tls_ca).read_bytes() if state.tls_ca else None


def prepare_quick(artifacts: Path) -> dict[str, object]:
    """Trains what the demo serves where it is missing; returns the quality of what it serves."""
    from academus.shared.training.distill import distill
    from academus.shared.training.distill_data import QUICK
    from academus.shared.training.prepare import head_dir, prepare
    from academus.shared.training.student_artifacts import students_dir

    if not (head_dir(artifacts, TASK) / "manifest.json").is_file():
        print(f"training the {TASK} head on {QUICK_LIMIT} examples a split (quick) ...", flush=True)
        prepare(artifacts, tasks=(TASK,), limit=QUICK_LIMIT)
    if not (students_dir(artifacts, TASK) / "manifest.json").is_file():
        print(f"distilling the {TASK} students (distill --quick, about a minute) ...", flush=True)
        distill(TASK, artifacts, cfg=QUICK, quick=True)
    return student_quality(artifacts)


def student_quality(artifacts: Path) -> dict[str, object]:
    from academus.shared.state.artifacts import load_artifact
    from academus.shared.training.student_artifacts import students_dir

    manifest, _ = load_artifact(students_dir(artifacts, TASK))
    try:
        served = manifest.metrics["test"][manifest.extra["best_k"] - 1]["accuracy"]
        teacher = manifest.metrics["teacher"]["test"]["accuracy"]
    except (KeyError, IndexError):   # a group written without its scores
        served = teacher = float("nan")
    return {"quick": bool(manifest.extra.get("quick")), "students": served, "teacher": teacher}


def show_mesh(run_dir: Path) -> None:
    report = status(run_dir)
    for s in report["services"]:
        print(f"  {s['name']:<16} {s['address']:<22} {s['health']}")
    for d in report["deployments"]:
        print(f"  deployment: policy {d['policy']:<8} models {d['models'] or 'every model'}")


def show_results(client: Client) -> None:
    print("\nresults:")
    result = client.infer(TEACHER, TEXTS)
    students = client.infer(STUDENTS, TEXTS)
    for text, t, s in zip(TEXTS, result.predictions, students.predictions, strict=True):
        print(f"  {text[:60]!r:<64} teacher {t.label} {t.probs[t.label]:.2f}   students {s.label} "
              f"{s.probs[s.label]:.2f} ({len(s.probs)} labels)")
    texts, pairs = zip(*PAIRS, strict=True)
    scored = client.infer("minilm", texts, pairs=pairs)   # one score a pair: the cosine of their embeddings
    for (text, pair), p in zip(PAIRS, scored.predictions, strict=True):
        print(f"  pair {text[:30]!r} ~ {pair[:30]!r}: score {p.score:.3f}")


async def compare(state: MeshState, key: str, args: argparse.Namespace) -> list[RunResult]:
    """The same closed loop of callers on the teacher and on its students, the order alternating."""
    samples = from_task(TASK)
    runs: list[RunResult] = []
    print(f"\n{args.callers} callers in a closed loop, {args.seconds:.0f} s a run, {args.rounds} rounds:", flush=True)
    async with GatewaySpread([state.gateway], key, timeout=10.0, streams=True,
                             root_certificates=trusted(state)) as spread:
        await run_closed(spread, TEACHER, 2, samples, 10.0, 1.0)   # warm both up (first batches, caches)
        await run_closed(spread, STUDENTS, 2, samples, 10.0, 1.0)
        for r in range(args.rounds):
            for model in (TEACHER, STUDENTS) if r % 2 == 0 else (STUDENTS, TEACHER):
                run = await run_closed(spread, model, args.callers, samples, 10.0, args.seconds)
                report = run.report()
                print(f"  {model:<20} {report['throughput_rps']:>7.1f} req/s  p50 "
                      f"{report['latency_ms'].get('p50', float('nan')):.1f} ms", flush=True)
                runs.append(run)
    return runs


def merged(runs: list[RunResult], model: str) -> RunResult:
    """The rounds of one model as one run, named by the policy that served it."""
    mine = [r for r in runs if r.model == model]
    records = [rec for r in mine for rec in r.records]
    policy = next((rec.meta.policy for rec in records if rec.meta is not None), "")
    return RunResult(model, policy, None, sum(r.duration_s for r in mine), records=records)


def show_comparison(runs: list[RunResult], notes: dict[str, object], out: Path) -> None:
    teacher, students = (merged(runs, m).report() for m in (TEACHER, STUDENTS))
    print(f"\n{'':<22}{'req/s':>8}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'errors':>8}{'test accuracy':>15}")
    for name, r, acc in (("teacher (concat)", teacher, notes["teacher"]),
                         ("students (student)", students, notes["students"])):
        lat = r["latency_ms"]
        print(f"{name:<22}{r['throughput_rps']:>8.1f}{lat.get('p50', 0):>9.1f}{lat.get('p95', 0):>9.1f}"
              f"{lat.get('p99', 0):>9.1f}{sum(r['errors'].values()):>8}{acc:>15.3f}")
    if teacher["throughput_rps"] and teacher["latency_ms"]:
        print(f"students / teacher: throughput {students['throughput_rps'] / teacher['throughput_rps']:.2f}x, "
              f"p50 {students['latency_ms']['p50'] / teacher['latency_ms']['p50']:.2f}x, "
              f"p99 {students['latency_ms']['p99'] / teacher['latency_ms']['p99']:.2f}x")
    if notes["quick"]:
        print("(quick students, from `distill --quick`: the full run keeps ~98 % of the teacher's accuracy; "
              "see docs/benchmarks/distillation.md)")
    out.mkdir(parents=True, exist_ok=True)
    png = latency_cdf([merged(runs, TEACHER), merged(runs, STUDENTS)], out / "demo-latency.png")
    (out / "demo.json").write_text(json.dumps({"teacher": teacher, "students": students, "quality": notes},
                                              indent=2, default=str))
    print(f"latency CDF: {png}")


def show_trace(run_dir: Path) -> None:
    time.sleep(0.5)   # the span processor's export delay
    traces = read_traces([run_dir / "traces.jsonl"])
    if not traces:
        print("\nno trace was written")
        return
    # the latest of the fullest: a trace's last spans may not be exported yet
    fullest = max(traces.values(), key=lambda spans: (len(spans), max(s["end_ns"] for s in spans)))
    print("\none request's trace (gateway -> scheduler -> worker):")
    print(format_trace(fullest))


if __name__ == "__main__":
    sys.exit(main())
