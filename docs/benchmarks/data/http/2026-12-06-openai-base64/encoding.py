"""What an OpenAI embeddings answer costs the gateway to write, as floats against base64 (what OpenAI's Python client
asks for unless told otherwise), and its size: `openai_answer` then `json_response`, for answers of 1, 32 and 64
embeddings of 384 and 768 floats, the two formats alternating, ROUNDS rounds of 2,000 answers each.

    python encoding.py ROUNDS
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from academus.services.gateway.core import Answer
from academus.services.gateway.http import json_response, openai_answer


def per_answer_us(answer: Answer, body: dict, n: int = 2000) -> tuple[float, int]:
    start = time.perf_counter()
    for _ in range(n):
        response = json_response(openai_answer(answer, body))
    return (time.perf_counter() - start) / n * 1e6, len(response.body)


def main() -> None:
    rounds = int(sys.argv[1])
    rng = np.random.default_rng(0)
    results = []
    for texts, dim in ((1, 384), (32, 384), (64, 768)):
        answer = Answer("m", [], rng.standard_normal((texts, dim)).astype(np.float32), [12] * texts)
        for r in range(rounds):
            formats = ("float", "base64") if r % 2 == 0 else ("base64", "float")
            got = {f: per_answer_us(answer, {"model": "m", "encoding_format": f}) for f in formats}
            results.append({"texts": texts, "dim": dim, "round": r,
                            **{f"{f}_us": round(us, 1) for f, (us, _) in got.items()},
                            **{f"{f}_bytes": size for f, (_, size) in got.items()}})
            print(json.dumps(results[-1]), flush=True)


if __name__ == "__main__":
    main()
