"""Ten thousand tenants on one node (HMI §7.3-7.4, Table 6): throughput and p95 of tenant models
served from one base as the number of tenants grows, each tenant with its own adapter trained on a
bootstrap subset of the sentiment data (HMI §7.1), requests spread uniformly or Zipf over tenants.

    python -m academus.loadgen.tenants_bench --tenants 1,10,100,1000,10000 --out .academus/results/tenants

For each tenant count: a fresh mesh (`academus up`: real processes, real Redis), N tenants created
with the registry, their adapters put in the adapter store, a wait until the worker's host tier has
loaded them all (reported as host_warm_s), then an open-loop Poisson run per spread. Also, at the
largest count, the ablations (--ablations): prefetch off, per-tenant (non-batched) adapter application,
no host tier (device-cache misses fetched from the store, one GetMany a layer), and no host tier with
one Get a piece. Reports per run: throughput, latency p50/p95/p99, errors, the worker's adapter cache
and host tier hit rates and the host memory per tenant (the worker's RSS growth per tenant and per
cached adapter, host tier bytes, Redis bytes per registered tenant, adapter file bytes). The last line
printed is the summary JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import redis

from academus.loadgen.bench import cpu_ms_per_request, process_memory_kib, service_cpu_s, write_summary
from academus.loadgen.runner import MAX_LATENCY_US, closed_callers, latency_summary
from academus.shared.cli.mesh import Deployment, MeshOptions, MeshState, down, up
from academus.shared.runtime.redis_conn import connect
from academus.shared.state.keys import Keys
from academus.shared.state.tenants import TenantModel, TenantRegistry
from academus.shared.training.onboarding import AdapterStoreClient
from academus.v1 import inference_pb2, inference_pb2_grpc

MODEL = "support"
ABLATIONS = {"prefetch-off": ({"ACADEMUS_ADAPTER_PREFETCH": "false"}, "prefetch off"),
             "per-tenant": ({"ACADEMUS_ADAPTER_BATCHED": "false"}, "per-tenant"),
             "one-get": ({"ACADEMUS_ADAPTER_FETCH_BATCH": "1", "ACADEMUS_ADAPTER_HOST_BYTES": "0"},
                         "no host tier, one Get a piece"),
             "host-off": ({"ACADEMUS_ADAPTER_HOST_BYTES": "0"}, "no host tier")}


def bootstrap_adapters(count: int, subset: int, epochs: int, seed: int, parent_texts: int) -> tuple[list, dict]:
    """`count` distinct adapters: a parent adapter trained on `parent_texts` sentiment training
    examples, then adapter k fine-tuned from it on its own bootstrap sample (with replacement) of
    `subset` examples, batched across tenants (a from-scratch adapter needs far more steps than a
    16-example subset gives). Also the validation accuracy of the parent and of a sample of tenants."""
    from academus.shared.training.adapters import train_adapter, train_many_adapters
    from academus.shared.training.data import load_task

    data = load_task("sentiment")
    texts, labels = [e.text for e in data.train], [data.labels[e.label] for e in data.train]
    rng = random.Random(seed)
    started = time.perf_counter()
    parent, summary = train_adapter(texts[:parent_texts], labels[:parent_texts], epochs=2, seed=seed)
    parent_s = time.perf_counter() - started
    subsets = [[rng.randrange(len(texts)) for _ in range(subset)] for _ in range(count)]
    adapters = train_many_adapters(texts, labels, subsets, epochs=epochs, seed=seed, start=parent)
    seconds = time.perf_counter() - started - parent_s
    return adapters, {"count": count, "subset": subset, "epochs": epochs, "parent_texts": parent_texts,
                      "parent_seconds": round(parent_s, 1), "parent_validation": summary["validation"],
                      "tenants_train_seconds": round(seconds, 1),
                      "tenants_validation_accuracy": sampled_accuracy(adapters, data, rng)}


def sampled_accuracy(adapters: list, data, rng: random.Random, tenants: int = 4, texts: int = 200) -> float:
    """Mean accuracy of a few tenants' adapters on sentiment validation texts."""
    import torch

    from academus.shared.models.adapters import encode_with_adapters
    from academus.shared.models.model import TeacherEncoder, pad_batch
    from academus.shared.models.teacher_files import teacher_dir
    from academus.shared.models.tokenization import TeacherTokenizer

    encoder, sample = TeacherEncoder.load(), data.validation[:texts]
    encoded = TeacherTokenizer(teacher_dir()).encode([e.text for e in sample])
    ids, mask, types = pad_batch([e.input_ids for e in encoded])
    gold = torch.tensor([e.label for e in sample])
    scores = []
    for adapter in rng.sample(adapters, min(tenants, len(adapters))):
        with torch.inference_mode():
            _, probs = encode_with_adapters(encoder, ids, mask, types, [adapter] * len(sample))
        names = [adapter.labels.index(name) for name in data.labels]
        scores.append(float((probs[:, names].argmax(1) == gold).float().mean()))
    return round(sum(scores) / len(scores), 4)


async def register(state: MeshState, adapters: list) -> dict[str, str]:
    """Tenant t<k> with model `support` on adapter k; returns tenant -> API key."""
    state.use_as_mesh()   # the adapter store takes only the mesh's calls
    client = connect(state.redis_url)
    keys = Keys(state.key_prefix)
    registry, store = TenantRegistry(client, keys, rate=1e6, burst=1_000_000), AdapterStoreClient(client, keys)
    out = {}
    try:
        for k, adapter in enumerate(adapters):
            tenant = f"t{k}"
            out[tenant] = await registry.create_tenant(tenant)
            version = await store.put(tenant, MODEL, adapter.to_bytes(), {"base": "minilm"})
            await registry.register_model(tenant, TenantModel(MODEL, "minilm", MODEL, version, list(adapter.labels)))
    finally:
        await client.aclose()
    return out


def trained_set(args: argparse.Namespace, count: int) -> tuple[list, dict]:
    """The bootstrap adapters, trained, or read back from `--adapters-file` when an earlier run saved
    them with the same recipe (training 10 000 takes most of half an hour on 2 cores)."""
    import torch

    from academus.shared.models.adapters import AdapterWeights

    recipe = {"count": count, "subset": args.subset, "epochs": args.epochs, "seed": args.seed,
              "parent_texts": args.parent_texts}
    path = args.adapters_file
    if path and path.exists():
        saved = torch.load(path, weights_only=True)
        if saved["recipe"] == recipe:
            return [AdapterWeights.from_bytes(b) for b in saved["adapters"]], json.loads(saved["training"])
    adapters, training = bootstrap_adapters(count, args.subset, args.epochs, args.seed, args.parent_texts)
    if path:
        torch.save({"recipe": recipe, "adapters": [a.to_bytes() for a in adapters],
                    "training": json.dumps(training)}, path)
    return adapters, training


def tenant_picker(count: int, spread: str, rng: np.random.Generator, zipf_s: float = 1.1):
    """Uniform, or Zipf(s) over tenant ranks (a few hot tenants, a long tail)."""
    if spread == "uniform":
        return lambda: int(rng.integers(count))
    weights = 1.0 / np.arange(1, count + 1) ** zipf_s
    cdf = np.cumsum(weights / weights.sum())
    return lambda: int(min(np.searchsorted(cdf, rng.random()), count - 1))


class TenantCalls:
    """Infer calls to tenants picked by `spread` over one channel, recorded in one histogram: what the
    open and the closed loop share."""

    def __init__(self, stub, keys: dict[str, str], spread: str, seed: int, timeout_s: float) -> None:
        from hdrh.histogram import HdrHistogram

        self.stub, self.keys, self.timeout_s = stub, keys, timeout_s
        self.tenants = list(keys)
        self.pick = tenant_picker(len(self.tenants), spread, np.random.default_rng(seed))
        self.histogram, self.errors, self.used = HdrHistogram(1, MAX_LATENCY_US, 3), {}, set()

    async def send(self, text: str) -> None:
        tenant = self.tenants[self.pick()]
        self.used.add(tenant)
        sent = time.perf_counter()
        try:
            await self.stub.Infer(inference_pb2.InferRequest(model=MODEL, inputs=[inference_pb2.TextInput(text=text)]),
                                  timeout=self.timeout_s, metadata=(("x-api-key", self.keys[tenant]),))
            self.histogram.record_value(max(1, round((time.perf_counter() - sent) * 1e6)))
        except grpc.aio.AioRpcError as e:
            self.errors[e.code().name] = self.errors.get(e.code().name, 0) + 1

    def result(self, elapsed_s: float, **run: object) -> dict:
        done = self.histogram.get_total_count()
        return {**run, "completed": done, "errors": self.errors, "tenants_used": len(self.used),
                "throughput_rps": round(done / elapsed_s, 2),
                "latency_ms": latency_summary(self.histogram) if done else {}}


async def open_loop(gateway: str, keys: dict[str, str], texts: list[str], rate: float, duration_s: float,
                    spread: str, seed: int, timeout_s: float) -> dict:
    """Poisson arrivals at `rate`, each to a tenant picked by `spread`; sent on schedule (open loop)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, int(rate * duration_s * 1.5)))
    arrivals = arrivals[arrivals < duration_s]
    async with grpc.aio.insecure_channel(gateway) as channel:
        calls = TenantCalls(inference_pb2_grpc.InferenceStub(channel), keys, spread, seed, timeout_s)
        start, sent = time.perf_counter(), []
        for i, at in enumerate(arrivals):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            sent.append(asyncio.create_task(calls.send(texts[i % len(texts)])))
        await asyncio.gather(*sent)
        elapsed = time.perf_counter() - start
    return calls.result(elapsed, spread=spread, offered_rps=rate, sent=len(arrivals))


async def closed_loop(gateway: str, keys: dict[str, str], texts: list[str], concurrency: int, duration_s: float,
                      spread: str, seed: int, timeout_s: float) -> dict:
    """Capacity, as perf_analyzer's concurrency mode measures it: `concurrency` callers, each sending its
    next request (to a tenant picked by `spread`) when its last is answered, for `duration_s`. The
    queue stays bounded, so no request expires and the rate is what the node sustains."""
    async with grpc.aio.insecure_channel(gateway) as channel:
        calls = TenantCalls(inference_pb2_grpc.InferenceStub(channel), keys, spread, seed, timeout_s)
        elapsed = await closed_callers(concurrency, duration_s, lambda i: calls.send(texts[i % len(texts)]))
    return calls.result(elapsed, spread=spread, concurrency=concurrency, offered_rps=None)


def worker_facts(state: MeshState) -> dict:
    client, keys = redis.Redis.from_url(state.redis_url, decode_responses=True), Keys(state.key_prefix)
    raw = client.hget(keys.worker("worker-0"), "adapter_cache")
    pid = next(s.pid for s in state.services if s.name.startswith("worker"))
    return {"cache": json.loads(raw) if raw else {}, "rss_bytes": (process_memory_kib(pid) or 0) * 1024,
            "redis_used_bytes": int(client.info("memory")["used_memory"])}


def wait_warm(state: MeshState, count: int, timeout_s: float) -> float | None:
    """Seconds until the worker's host tier holds every registered adapter (its warmer loads them,
    HMI §6.2's adapters in host memory); None without a host tier or past the timeout."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        cache = worker_facts(state)["cache"]
        if "host_adapters" not in cache and cache:
            return None
        if cache.get("host_adapters", 0) >= count:
            return round(time.perf_counter() - started, 1)
        time.sleep(0.5)
    return None


def with_cpu(state: MeshState, run) -> dict:
    """Runs one load coroutine; adds where the CPU went: ms a completed request, per mesh process."""
    before = service_cpu_s(state)
    out = asyncio.run(run)
    after = service_cpu_s(state)
    out["cpu_ms_per_request"] = cpu_ms_per_request(before, after, out["completed"])
    return out


def measure(count: int, adapters: list, args: argparse.Namespace, env: dict[str, str], label: str) -> dict:
    """One fresh mesh with `count` tenants: a run per spread, with memory and cache figures."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"tenants-{count}-"))
    state = up(MeshOptions(run_dir=run_dir, gateway_port=0, workers=1, worker_threads=args.worker_threads,
                           deployments=[Deployment("padded")], key_prefix="bench",
                           env={"ACADEMUS_MODELS": "minilm", "ACADEMUS_MAX_BATCH": str(args.max_batch),
                                "ACADEMUS_MAX_DELAY_MS": str(args.max_delay_ms),
                                "ACADEMUS_ADAPTER_DIR": str(run_dir / "adapters"), **env}))
    try:
        before = worker_facts(state)
        keys = asyncio.run(register(state, adapters[:count]))
        registered = worker_facts(state)
        warm_s = wait_warm(state, count, args.warm_timeout)
        texts = sample_texts(args.texts)
        asyncio.run(open_loop(state.gateway, keys, texts, args.rates[0], min(5.0, args.duration), "uniform", 99,
                              args.timeout))  # warm-up: first-call allocations, not the steady state
        runs = []
        for spread in args.spreads:
            for rate in args.rates:
                runs.append(with_cpu(state, open_loop(state.gateway, keys, texts, rate, args.duration, spread,
                                                      args.seed, args.timeout)))
                time.sleep(args.drain)  # work left queued by a saturating run must not spill into the next
            if args.concurrency:
                runs.append(with_cpu(state, closed_loop(state.gateway, keys, texts, args.concurrency,
                                                        args.duration, spread, args.seed, args.timeout)))
        time.sleep(2.5)  # one worker heartbeat publishes the cache figures
        after = worker_facts(state)
    finally:
        down(run_dir)
    cache = after["cache"]
    files = sum(f.stat().st_size for f in (run_dir / "adapters").rglob("*.safetensors"))
    return {"label": label, "tenants": count, "runs": runs, "cache": cache, "host_warm_s": warm_s,
            "memory": {"worker_rss_growth_per_tenant_bytes": round((after["rss_bytes"] - before["rss_bytes"]) / count),
                       "host_tier_bytes_per_tenant": round(cache.get("host_bytes", 0) / count),
                       "worker_rss_growth_per_cached_adapter_bytes":
                       round((after["rss_bytes"] - before["rss_bytes"]) / max(cache.get("adapters", 0), 1)),
                       "worker_cache_bytes_per_adapter": round(cache.get("bytes", 0)
                                                               / max(cache.get("adapters", 1), 1)),
                       "redis_bytes_per_tenant": round((registered["redis_used_bytes"] - before["redis_used_bytes"])
                                                       / count),
                       "adapter_file_bytes_per_tenant": round(files / count)}}


def sample_texts(limit: int) -> list[str]:
    from academus.shared.training.data import load_task

    return [e.text for e in load_task("sentiment").test[:limit]]


def summarise(results: list[dict]) -> dict:
    """Throughput and p95 of every run against the 1-tenant run of the same spread (the targets'
    ratios: ≥ 0.9x throughput at 10 000 tenants)."""
    base = {(r["spread"], r["offered_rps"]): r for r in results[0]["runs"]} if results else {}
    rows = []
    for result in results:
        for run in result["runs"]:
            ref = base.get((run["spread"], run["offered_rps"]))
            rows.append({"label": result["label"], "tenants": result["tenants"], "spread": run["spread"],
                         "offered_rps": run["offered_rps"], "concurrency": run.get("concurrency"),
                         "throughput_rps": run["throughput_rps"], "p95_ms": run["latency_ms"].get("p95"),
                         "throughput_vs_1": _ratio(run["throughput_rps"], ref["throughput_rps"]) if ref else None,
                         "p95_vs_1": _ratio(run["latency_ms"].get("p95"), ref["latency_ms"].get("p95"))
                         if ref else None,
                         "hit_rate": result["cache"].get("hit_rate"), "errors": run["errors"]})
    return {"rows": rows}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def plot(results: list[dict], out: Path) -> None:
    """Capacity (closed loop, else the highest offered rate) and p95 at the lowest rate, against tenants (log x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({run["offered_rps"] for r in results for run in r["runs"] if run["offered_rps"] is not None})
    closed = any(run["offered_rps"] is None for r in results for run in r["runs"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    # capacity: the closed-loop run where there is one, else the highest offered rate
    for ax, rate, field, name in ((axes[0], None if closed else rates[-1], "throughput_rps", "throughput (requests/s)"),
                                  (axes[1], rates[0], "p95", "p95 latency (ms)")):
        for label in dict.fromkeys(r["label"] for r in results):
            for spread in sorted({run["spread"] for r in results for run in r["runs"]}):
                points = [(r["tenants"], run[field] if field in run else run["latency_ms"].get(field))
                          for r in results if r["label"] == label for run in r["runs"]
                          if run["spread"] == spread and run["offered_rps"] == rate]
                style = {"marker": "o"} if label == "batched+prefetch" else {"marker": "x", "linestyle": ""}
                ax.plot(*zip(*points, strict=True), label=f"{label} ({spread})", **style)
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("tenant models")
        ax.set_ylabel(name)
        ax.set_title("closed loop (capacity)" if rate is None else f"offered {rate:g} req/s")
        ax.legend(fontsize=7)
    fig.suptitle("tenant models on one shared base, one CPU worker")
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_tenants.png", dpi=120)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.tenants_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tenants", default="1,10,100,1000,10000")
    p.add_argument("--spreads", default="uniform,zipf", type=lambda s: s.split(","))
    p.add_argument("--rates", default="25,60", type=lambda s: [float(r) for r in s.split(",")],
                   help="offered requests/s (Poisson): one below capacity (latency), one above (throughput)")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=64,
                   help="callers of the closed-loop capacity run per spread (0: none)")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--drain", type=float, default=15.0, help="seconds of quiet between runs")
    p.add_argument("--subset", type=int, default=16, help="bootstrap examples per tenant adapter")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--parent-texts", type=int, default=2000, help="examples the parent adapter trains on")
    p.add_argument("--texts", type=int, default=500)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-delay-ms", type=float, default=10.0)
    p.add_argument("--worker-threads", type=int, default=0)
    p.add_argument("--no-ablations", action="store_true", help="skip the ablations at the top count")
    p.add_argument("--ablations", default=",".join(ABLATIONS), type=lambda s: [a for a in s.split(",") if a],
                   help=f"which, at the top count: {', '.join(ABLATIONS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-timeout", type=float, default=300.0,
                   help="seconds to wait for the worker's host tier to load every adapter before the runs")
    p.add_argument("--adapters-file", type=Path, default=None, help="save the trained set here / reuse it")
    p.add_argument("--train-only", action="store_true", help="train (and save) the adapters, then stop")
    p.add_argument("--out", type=Path, default=Path(".academus/results/tenants"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    counts = sorted(int(c) for c in args.tenants.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    adapters, training = trained_set(args, counts[-1])
    print(json.dumps({"training": training}), file=sys.stderr)
    if args.train_only:
        return 0
    setups = [(c, {}, "batched+prefetch") for c in counts]
    setups += [(counts[-1], *ABLATIONS[name]) for name in ([] if args.no_ablations else args.ablations)]
    results = []
    for count, setting, label in setups:
        results.append(measure(count, adapters, args, setting, label))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)  # progress: a long sweep's results so far
    plot(results, args.out)
    return write_summary(args.out, {"training": training, "results": results, "summary": summarise(results),
                                    "args": {k: str(v) for k, v in vars(args).items()}})


if __name__ == "__main__":
    raise SystemExit(main())
