"""The scheduler's batches under 1,024 closed loops on `null`, as batch_debug.patch logs them (each batch's tokens,
its time, its time a token and the smoothed time a token and deviation after it): which batches lift the estimate.

    python batches.py batches.txt.gz"""

from __future__ import annotations

import collections
import gzip
import re
import sys

LINE = re.compile(r"(\S+) jobs=(\d+) tokens=(\d+) ms=(\S+) sample_us=(\S+) token_us=(\S+) dev_us=(\S+) queued=(\d+)")


def quantiles(values: list[float]) -> str:
    ordered = sorted(values)
    at = {p: ordered[int(p / 100 * (len(ordered) - 1))] for p in (10, 50, 90, 99)}
    return " ".join(f"p{p} {v:.1f}" for p, v in at.items()) + f" max {ordered[-1]:.1f}"


def main(path: str) -> None:
    with gzip.open(path, "rt") as f:
        rows = [tuple(float(x) for x in m.groups()) for line in f if (m := LINE.match(line))]
    _, _, tokens, ms, sample, token, dev, queued = zip(*rows, strict=True)
    print(f"{len(rows)} batches")
    for name, values in (("tokens", tokens), ("ms", ms), ("sample_us", sample), ("token_us", token),
                         ("dev_us", dev), ("queued", queued)):
        print(f"{name}: {quantiles(list(values))}")
    print("a full batch as counted (token_us + dev_us) x 1024, ms:",
          quantiles([(t + d) * 1024 / 1e3 for t, d in zip(token, dev, strict=True)]))
    full = [r[3] for r in rows if r[2] == 1024]
    print(f"full batches: {len(full)}, ms {quantiles(full)}")
    lifting = [r for r in rows if r[4] >= 30]
    print(f"samples of 30 us a token or more: {len(lifting)}; by the batch's tokens:",
          collections.Counter(int(r[2]) for r in lifting).most_common(5))
    print("their ms:", quantiles([r[3] for r in lifting]))
    rows_of_one = [r[3] for r in rows if r[2] == 128]
    print(f"one-row batches: {len(rows_of_one)}, ms {quantiles(rows_of_one)}")


if __name__ == "__main__":
    main(sys.argv[1])
