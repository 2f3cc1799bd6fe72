"""Batched heterogeneous adapters (HMI §6.3, Table 6's "w/o batching" ablation) on one device: the
encoder forward for a batch whose rows belong to A distinct tenants, with every tenant's adapter
applied by one batched matmul a projection (`batched`), by a loop over the tenants (`per-tenant`),
and with no adapters at all (`base`). Also checks, on the device, that both ways agree.

    python -m academus.loadgen.probes.adapters_bench --device cuda --batch 64 --tokens 32 --tenants 1,8,64

`--teacher DIR` loads the teacher from a directory (e.g. a copy carried to a GPU machine). The last
line printed is the JSON report."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from academus.shared.models.adapters import AdapterWeights, encode_with_adapters
from academus.shared.models.model import TeacherEncoder


def perturbed_adapter(labels: list[str], seed: int) -> AdapterWeights:
    """A fresh adapter with a random (not zero) up-projection, so that it changes the output."""
    adapter = AdapterWeights.init(labels, seed=seed)
    generator = torch.Generator().manual_seed(seed + 10_000)
    for tensors in adapter.layers.values():
        tensors["up.weight"] = torch.randn(tensors["up.weight"].shape, generator=generator) * 0.05
    return adapter


def random_adapters(count: int, labels: int, seed: int) -> list[AdapterWeights]:
    """Distinct adapters, each changing the output."""
    return [perturbed_adapter([f"c{i}" for i in range(labels)], seed + k) for k in range(count)]


def timed_ms(run, device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Median wall time of `run`, synchronising the device around each call."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def bench(encoder: TeacherEncoder, device: torch.device, batch: int, tokens: int, tenants: int,
          repeats: int, dtype: torch.dtype) -> dict:
    ids = torch.randint(1000, 20000, (batch, tokens), device=device)
    ids[:, 0], ids[:, -1] = 101, 102
    mask, types = torch.ones_like(ids), torch.zeros_like(ids)
    adapters = [a.to(device, dtype) for a in random_adapters(tenants, 2, seed=tenants)]
    rows = [adapters[r % tenants] for r in range(batch)]

    def run(batched: bool):
        with torch.inference_mode():
            return encode_with_adapters(encoder, ids, mask, types, rows, batched=batched)

    def base():
        with torch.inference_mode():
            return encoder(ids, mask, types)

    batched, looped = run(True), run(False)
    return {"tenants": tenants, "batch": batch, "tokens": tokens,
            "max_abs_diff_batched_vs_per_tenant": float((batched[1] - looped[1]).abs().max()),
            "base_ms": round(timed_ms(base, device, repeats), 3),
            "batched_ms": round(timed_ms(lambda: run(True), device, repeats), 3),
            "per_tenant_ms": round(timed_ms(lambda: run(False), device, repeats), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.probes.adapters_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--teacher", type=Path, default=None, help="teacher directory (default: the bundled one)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--tenants", default="1,8,64")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    encoder = TeacherEncoder.load(args.teacher, device=device).to(dtype)
    rows = [bench(encoder, device, args.batch, args.tokens, int(t), args.repeats, dtype)
            for t in args.tenants.split(",")]
    for row in rows:
        row["per_tenant_vs_batched"] = round(row["per_tenant_ms"] / row["batched_ms"], 3)
        row["batched_vs_base"] = round(row["batched_ms"] / row["base_ms"], 3)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(json.dumps({"device": name, "dtype": args.dtype, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
