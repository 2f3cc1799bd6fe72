"""What the HTTP edge spends turning the full model's answer into `/embed`'s rows, before JSON: through the gRPC
edge's InferResponse (a protobuf float a value, then back to a matrix: the edge before it read the core's Answer) and
through the core's `Answer` (the model's float32 matrix as it came). `python answer_shape.py ROUNDS`: TEXTS x DIM
answers, 2,000 an arm a round, the order alternating; the median µs an answer."""

import statistics
import sys
import time

import numpy as np

from academus.services.gateway.core import EMBED, Admitted, Principal
from academus.services.gateway.http import embeddings
from academus.services.gateway.server import answer_of, to_pb
from academus.shared.models.tokenization import Encoded
from academus.shared.state.catalogue import EMBEDDING, ModelSpec
from academus.v1 import tensors_pb2

TEXTS, DIM, CALLS = 32, 384, 2000


def old(admitted: Admitted, result: tensors_pb2.ModelOutput) -> np.ndarray:
    response = to_pb(admitted, result, "r")
    return np.array([p.embedding for p in response.predictions], dtype=np.float32)


def new(admitted: Admitted, result: tensors_pb2.ModelOutput) -> np.ndarray:
    return embeddings(answer_of(admitted, result), normalize=False)


def main() -> None:
    rounds = int(sys.argv[1])
    admitted = Admitted(Principal("t", "user"), ModelSpec("minilm", EMBEDDING, dim=DIM), EMBED,
                        [Encoded([101, 2000 + i, 102], [0, 0, 0]) for i in range(TEXTS)], 0.0)
    matrix = np.random.default_rng(0).standard_normal((TEXTS, DIM)).astype("<f4")
    result = tensors_pb2.ModelOutput(values=tensors_pb2.Matrix(rows=TEXTS, dim=DIM, data=matrix.tobytes()))
    assert np.array_equal(old(admitted, result), new(admitted, result))
    arms = {"through InferResponse": old, "through Answer": new}
    for r in range(rounds):
        figures = {}
        for name in (list(arms) if r % 2 == 0 else list(reversed(arms))):
            took = []
            for _ in range(CALLS):
                start = time.perf_counter()
                arms[name](admitted, result)
                took.append(time.perf_counter() - start)
            figures[name] = statistics.median(took) * 1e6
        print(f"round {r}: " + ", ".join(f"{k} {v:.1f} µs" for k, v in figures.items())
              + f"; ratio {figures['through Answer'] / figures['through InferResponse']:.3f}")


if __name__ == "__main__":
    main()
