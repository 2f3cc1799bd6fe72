"""Shares of a py-spy raw profile (http_profile.py's gateway.txt): the samples whose innermost frame is in each
library, then the innermost functions and the functions on the stack (inclusive) that hold the most.

    python shares.py gateway.txt [N]"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path


def library(frame: str) -> str:
    path = frame.rpartition("(")[2]
    for marker, name in (("aiohttp/", "aiohttp"), ("asyncio/", "asyncio"), ("uvloop", "uvloop"), ("numpy/", "numpy"),
                         ("uuid.py", "uuid"), ("prometheus_client/", "prometheus_client")):
        if marker in path:
            return name
    return "academus" if any(p in path for p in ("services/", "shared/", "academus")) else "other"


def main() -> None:
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    total, by_library = 0, collections.Counter()
    innermost, inclusive = collections.Counter(), collections.Counter()
    for line in Path(sys.argv[1]).read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        n = int(count)
        frames = [re.sub(r":\d+\)", ")", f) for f in stack.split(";")]
        total += n
        by_library[library(frames[-1])] += n
        innermost[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    print(f"{total} samples")
    for title, counts in (("innermost frame's library", by_library), ("innermost function", innermost),
                          ("on the stack", inclusive)):
        print(f"\n{title}:")
        for name, n in counts.most_common(top):
            print(f"  {100 * n / total:5.1f} %  {name}")


if __name__ == "__main__":
    main()
