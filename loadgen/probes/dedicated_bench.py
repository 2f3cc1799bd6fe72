"""HMI's "dedicated model per tenant with swapping" baseline against tenant adapters batched on one
shared base, on one engine in one process, over the same request trace.

    python -m academus.loadgen.probes.dedicated_bench --tenants 10,100 --requests 1024 --resident 4

- `dedicated`: every tenant owns a full fine-tuned copy of the model (the teacher's weights, its own
  head), kept in host memory (fp16, as a GPU server keeps models it cannot hold on the device); at most
  `--resident` full-precision models are loaded at once (LRU), a miss copies the tenant's weights in
  (`load_state_dict`). Requests batch only with the same tenant's: a window of B requests runs as one
  batch a tenant present in it.
- `adapters`: one base model; a window of B requests runs as one batch whatever its tenants, each row
  with its own adapter and head (`encode_with_adapters`, one bmm a projection).

Both take the trace's requests in windows of B in arrival order, closed loop, so the figure is the
maximum throughput of each design; tenants are drawn uniformly or Zipf. The last line printed is the
JSON report."""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections import OrderedDict

import numpy as np
import torch

from academus.loadgen.probes.adapters_bench import perturbed_adapter
from academus.loadgen.tenants_bench import tenant_picker
from academus.shared.models.adapters import encode_with_adapters
from academus.shared.models.model import ClassifierHead, TeacherEncoder, pad_batch
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer


class DedicatedModels:
    """Full per-tenant models in host memory (fp16), `resident` of them loaded (fp32) at a time."""

    def __init__(self, teacher: TeacherEncoder, tenants: int, resident: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        base = {k: v.half() for k, v in teacher.state_dict().items()}
        # Each tenant's "fine-tuned" weights: the teacher's, perturbed, so that no two are the same.
        self.host = [{k: (v + (torch.randn(v.shape, generator=generator) * 1e-3).half()) if v.is_floating_point()
                      else v.clone() for k, v in base.items()} for _ in range(tenants)]
        self.heads = [ClassifierHead(["neg", "pos"]) for _ in range(tenants)]
        self.slots = [copy.deepcopy(teacher) for _ in range(resident)]
        self.loaded: OrderedDict[int, TeacherEncoder] = OrderedDict()
        self.swaps = 0

    def model(self, tenant: int) -> TeacherEncoder:
        if tenant in self.loaded:
            self.loaded.move_to_end(tenant)
            return self.loaded[tenant]
        slot = self.slots.pop() if self.slots else self.loaded.popitem(last=False)[1]
        slot.load_state_dict(self.host[tenant])  # copies (and widens) the tenant's weights in: the swap
        self.swaps += 1
        self.loaded[tenant] = slot
        return slot

    def run(self, rows: list[int], ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> None:
        for tenant in dict.fromkeys(rows):
            picked = [r for r, t in enumerate(rows) if t == tenant]
            pooled = self.model(tenant)(ids[picked], mask[picked], types[picked])
            torch.softmax(self.heads[tenant](pooled), dim=-1)


def serve(run, trace: list[int], encoded: list[list[int]], batch: int) -> float:
    """Requests/s over the trace, windows of `batch` in arrival order."""
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(trace), batch):
            window = list(range(i, min(i + batch, len(trace))))
            ids, mask, types = pad_batch([encoded[j % len(encoded)] for j in window])
            run([trace[j] for j in window], ids, mask, types)
    return len(trace) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.probes.dedicated_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tenants", default="10,100")
    p.add_argument("--spreads", default="uniform,zipf")
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--resident", type=int, default=4, help="full models loaded at once (dedicated)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from academus.shared.training.data import load_task

    teacher = TeacherEncoder.load()
    texts = [e.text for e in load_task("sentiment").test]
    encoded = [e.input_ids for e in TeacherTokenizer(teacher_dir()).encode(texts[:512])]
    rows = []
    for count in (int(c) for c in args.tenants.split(",")):
        dedicated = DedicatedModels(teacher, count, args.resident, args.seed)
        adapters = [perturbed_adapter(["neg", "pos"], k) for k in range(count)]

        def batched(tenants: list[int], ids, mask, types, adapters=adapters) -> None:
            encode_with_adapters(teacher, ids, mask, types, [adapters[t] for t in tenants])

        for spread in args.spreads.split(","):
            pick = tenant_picker(count, spread, np.random.default_rng(args.seed))
            trace = [pick() for _ in range(args.requests)]
            swaps_before = dedicated.swaps
            ded = serve(dedicated.run, trace, encoded, args.batch)
            ada = serve(batched, trace, encoded, args.batch)
            rows.append({"tenants": count, "spread": spread, "dedicated_rps": round(ded, 2),
                         "adapters_rps": round(ada, 2), "adapters_vs_dedicated": round(ada / ded, 2),
                         "dedicated_swaps": dedicated.swaps - swaps_before})
        del dedicated
    print(json.dumps({"requests": args.requests, "batch": args.batch, "resident": args.resident, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
