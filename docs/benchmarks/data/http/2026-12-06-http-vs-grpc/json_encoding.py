"""An /embed answer of 32 texts x 384 floats written as JSON: `json.dumps` of Python floats (the edge before orjson)
against `orjson.dumps` of the float32 matrix (after), in process, 200 times each, ROUNDS rounds.
`python json_encoding.py ROUNDS`."""

import json
import sys
import time

import numpy as np
import orjson


def ms_a_call(encode, matrix: np.ndarray, calls: int = 200) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        encode(matrix)
    return (time.perf_counter() - start) / calls * 1e3


def main(rounds: int) -> None:
    matrix = np.random.default_rng(0).standard_normal((32, 384)).astype(np.float32)
    for r in range(rounds):
        before = ms_a_call(lambda m: json.dumps(m.tolist()).encode(), matrix)
        after = ms_a_call(lambda m: orjson.dumps(m, option=orjson.OPT_SERIALIZE_NUMPY), matrix)
        sizes = len(json.dumps(matrix.tolist())), len(orjson.dumps(matrix, option=orjson.OPT_SERIALIZE_NUMPY))
        print(f"round {r}: json {before:.3f} ms, orjson {after:.3f} ms, ratio {after / before:.3f}; bytes {sizes}")


if __name__ == "__main__":
    main(int(sys.argv[1]))
