"""What the gateway spends a response on filling its embeddings: `Prediction.embedding` filled from a Python
list (`extend(row.tolist())`) against the field's wire form merged in (`work_wire.merge_floats`), for the
texts and widths given; then each response serialized as the gateway's edge sends it.

    python -m academus.loadgen.probes.embedding_fill [--texts 1 32] [--dims 384 768] [--repeat 2000]

Prints one JSON object: µs a response, per (texts, dim), median of five timings of --repeat responses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from academus.shared.models.work_wire import merge_floats
from academus.v1 import inference_pb2 as pb


def from_list(values: np.ndarray) -> pb.InferResponse:
    response = pb.InferResponse(model="m")
    for i, row in enumerate(values):
        response.predictions.add(num_tokens=16, input_index=i, final=True).embedding.extend(row.tolist())
    return response


def packed(values: np.ndarray) -> pb.InferResponse:
    response = pb.InferResponse(model="m")
    for i, row in enumerate(values):
        merge_floats(response.predictions.add(num_tokens=16, input_index=i, final=True), "embedding", row)
    return response


def timed_us(build: Callable[[np.ndarray], pb.InferResponse], values: np.ndarray, repeat: int) -> float:
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            build(values).SerializeToString()
        runs.append((time.perf_counter() - start) / repeat * 1e6)
    return round(statistics.median(runs), 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, nargs="+", default=[1, 32])
    p.add_argument("--dims", type=int, nargs="+", default=[384, 768])
    p.add_argument("--repeat", type=int, default=2000)
    args = p.parse_args(argv)
    rows = []
    for texts in args.texts:
        for dim in args.dims:
            values = np.random.default_rng(dim).normal(size=(texts, dim)).astype(np.float32)
            assert from_list(values) == packed(values)
            repeat = max(args.repeat // texts, 20)
            old, new = timed_us(from_list, values, repeat), timed_us(packed, values, repeat)
            rows.append({"texts": texts, "dim": dim, "list_us": old, "packed_us": new, "ratio": round(new / old, 3)})
    print(json.dumps({"us_a_response": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
