"""The `mixed` arm (the SDK's channel) of ab.sh's runs: new over old per round, and each arm's range.

    python summarize.py RUNS_DIR
"""
import json
import pathlib
import statistics
import sys


def span(runs: list[dict], size: str, key: str) -> str:
    values = [run[size][key] for run in runs]
    return f"{min(values):.2f}-{max(values):.2f}"


runs = pathlib.Path(sys.argv[1])
for large in ("streams", "replies"):
    print(f"\n{large}: size | small p50 ms, old / new | small worst ms, old / new | large ms, old / new | "
          "large new/old")
    rounds = sorted({int(p.stem.rsplit("-", 1)[1]) for p in runs.glob(f"new-{large}-*.json")})
    old, new = ([json.loads((runs / f"{arm}-{large}-{r}.json").read_text())["arms"]["mixed"] for r in rounds]
                for arm in ("old", "new"))
    for size in new[0]:
        ratios = [n[size]["large_ms"] / o[size]["large_ms"] for n, o in zip(new, old, strict=True)]
        print(f"{size} | {span(old, size, 'small_p50_ms')} / {span(new, size, 'small_p50_ms')} | "
              f"{span(old, size, 'small_max_ms')} / {span(new, size, 'small_max_ms')} | "
              f"{span(old, size, 'large_ms')} / {span(new, size, 'large_ms')} | "
              f"{', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f})")
