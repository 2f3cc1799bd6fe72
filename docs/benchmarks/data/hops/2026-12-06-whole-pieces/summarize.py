"""The `mixed` arm (the SDK's channel) of ab.sh's runs: new over old per round, and each arm's range.

    python summarize.py RUNS_DIR
"""
import json
import pathlib
import statistics
import sys

runs = pathlib.Path(sys.argv[1])
for large in ("streams", "replies"):
    print(f"\n{large}: size | small p50 ms, old / new | small worst ms, old / new | large ms, old / new | large new/old")
    rounds = sorted({int(p.stem.rsplit("-", 1)[1]) for p in runs.glob(f"new-{large}-*.json")})
    arms = {arm: [json.loads((runs / f"{arm}-{large}-{r}.json").read_text())["arms"]["mixed"] for r in rounds]
            for arm in ("old", "new")}
    for size in arms["new"][0]:
        def span(arm: str, key: str) -> str:
            values = [run[size][key] for run in arms[arm]]
            return f"{min(values):.2f}-{max(values):.2f}"
        ratios = [n[size]["large_ms"] / o[size]["large_ms"] for n, o in zip(arms["new"], arms["old"])]
        print(f"{size} | {span('old', 'small_p50_ms')} / {span('new', 'small_p50_ms')} | "
              f"{span('old', 'small_max_ms')} / {span('new', 'small_max_ms')} | "
              f"{span('old', 'large_ms')} / {span('new', 'large_ms')} | "
              f"{', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f})")
