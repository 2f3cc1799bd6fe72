"""`make demo`: start the local mesh, send a small real workload through the SDK, print the
results, latencies and one trace, and stop the mesh."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from academus.client import Client
from academus.loadgen.stats import summary
from academus.shared.cli.mesh import ADMIN_KEY_FILE, MeshOptions, down, status, up
from academus.shared.runtime.tracing import format_trace, read_traces

WORKLOAD = {
    "spam": ["Congratulations! You have been selected for a FREE vacation. Reply now to claim!!!",
             "Can you send me the notes from yesterday's design review before lunch?"],
    "sentiment": ["An exhilarating, beautifully shot film with a heart of gold.",
                  "Two hours of my life I will never get back: dull, shrill and pointless."],
    "minilm": ["Academus serves encoder models at the lowest latency the hardware allows."],
}


def main() -> int:
    run_dir = Path(tempfile.mkdtemp(prefix="academus-demo-"))
    print(f"starting the mesh in {run_dir} ...", flush=True)
    t0 = time.monotonic()
    # every request traced (the default is 1 in 100): the demo prints one request's trace
    state = up(MeshOptions(run_dir=run_dir, gateway_port=0, env={"OTEL_BSP_SCHEDULE_DELAY": "100",
                                                                 "ACADEMUS_TRACE_RATIO": "1"}))
    print(f"mesh up in {time.monotonic() - t0:.1f} s")
    for s in status(run_dir)["services"]:
        print(f"  {s['name']:<16} {s['address']:<22} {s['health']}")
    key = (run_dir / ADMIN_KEY_FILE).read_text().strip()
    try:
        with Client(state.gateway, api_key=key) as client:
            show_results(client)
            show_latency(client)
        time.sleep(0.5)
        traces = read_traces([run_dir / "traces.jsonl"])
        latest = max(traces.values(), key=lambda spans: max(s["end_ns"] for s in spans))
        print("\none request's trace (gateway -> scheduler -> worker):")
        print(format_trace(latest))
    finally:
        down(run_dir)
        print("\nmesh stopped")
    return 0


PAIRS = [("How do I reset my password?", "I forgot my password, how can I change it?"),
         ("How do I reset my password?", "What time does the store open?")]


def show_results(client: Client) -> None:
    print("\nresults:")
    for model, texts in WORKLOAD.items():
        result = client.infer(model, texts)
        for text, p in zip(texts, result.predictions, strict=True):
            shown = ({"label": p.label, "probs": {k: round(v, 3) for k, v in p.probs.items()}} if p.label
                     else {"embedding[:4]": [round(x, 4) for x in p.embedding[:4]], "dim": len(p.embedding)})
            print(f"  {model:<9} {text[:60]!r:<64} {json.dumps(shown)}")
    texts, pairs = zip(*PAIRS, strict=True)
    scored = client.infer("minilm", texts, pairs=pairs)   # one score a pair: the cosine of their embeddings
    for (text, pair), p in zip(PAIRS, scored.predictions, strict=True):
        print(f"  {'pair':<9} {text[:30]!r} ~ {pair[:30]!r}: score {p.score:.3f}")


def show_latency(client: Client, n: int = 100) -> None:
    e2e, compute = [], []
    text = WORKLOAD["sentiment"][0]
    for _ in range(n):
        start = time.perf_counter()
        result = client.infer("sentiment", [text])
        e2e.append((time.perf_counter() - start) * 1e3)
        compute.append(result.metadata.compute_ms)
    print(f"\nlatency over {n} sequential single-text requests (ms):")
    print(f"  end to end  {json.dumps(summary(e2e))}")
    print(f"  model only  {json.dumps(summary(compute))}")


if __name__ == "__main__":
    sys.exit(main())
