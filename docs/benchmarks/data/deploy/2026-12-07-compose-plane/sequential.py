"""Sequential single-text requests to `null` through a compose mesh's public port (TLS): p50 and p99 in ms, one
JSON line. Usage: python sequential.py TARGET CA KEY N ARM ROUND"""

import json
import sys
import time
from pathlib import Path

from academus.client import AcademusError, Client

target, ca, key, n, arm, round_ = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]
with Client(target, api_key=key, root_certificates=Path(ca).read_bytes()) as client:
    ready_by = time.monotonic() + 120   # the recreated worker loads its models after the gateway is healthy
    while True:
        try:
            client.infer("null", ["warm"])
            break
        except AcademusError:
            if time.monotonic() > ready_by:
                raise
            time.sleep(0.5)
    for _ in range(200):
        client.infer("null", ["warm"])
    took = []
    for _ in range(n):
        start = time.perf_counter()
        client.infer("null", ["a fine film"])
        took.append((time.perf_counter() - start) * 1e3)
took.sort()
print(json.dumps({"arm": arm, "round": int(round_), "requests": n, "p50_ms": round(took[n // 2], 3),
                  "p99_ms": round(took[int(n * 0.99)], 3)}))
