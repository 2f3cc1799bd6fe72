"""Each function's share of a py-spy raw file's samples: inclusive (on the stack), then its own (innermost).

    python inclusive.py SERVICE.txt [TOP]"""

from __future__ import annotations

import collections
import sys


def shares(path: str) -> tuple[int, collections.Counter, collections.Counter]:
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    total = 0
    with open(path) as lines:
        samples = [line.rstrip().rsplit(" ", 1) for line in lines if line.strip()]
    for stack, count in samples:
        total += int(count)
        frames = [f.split(" (")[0] + " " + f.split("/")[-1].split(":")[0] for f in stack.split(";")]
        for frame in set(frames):
            inclusive[frame] += int(count)
        own[frames[-1]] += int(count)
    return total, inclusive, own


if __name__ == "__main__":
    total, inclusive, own = shares(sys.argv[1])
    print("samples", total)
    for frame, n in inclusive.most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 40):
        print(f"{n / total:6.3f} {own[frame] / total:6.3f}  {frame}")
