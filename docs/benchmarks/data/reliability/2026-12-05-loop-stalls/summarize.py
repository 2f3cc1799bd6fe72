"""Summarizes ab.sh's runs, or the copies kept here (summary.json, loop_stalls.jsonl, steal.jsonl.gz): each
arm's refusals and goodput, every service's loop stalls (`loop_stall` events), and the gateway's stalls split by
where the time went: the loop thread's CPU, the collector, and the rest (waiting for a core, or for the
hypervisor: steal in /proc/stat).

    python summarize.py OUTDIR > summary.json"""

import glob
import gzip
import json
import os
import sys
from pathlib import Path

STEAL_JIFFIES = 5   # a stall during which the vCPUs lost 50 ms or more to the hypervisor


def read_lines(path: str) -> list[str]:
    """A file's lines, from its gzipped copy where only that is kept."""
    if Path(path).is_file():
        return Path(path).read_text().splitlines()
    return gzip.decompress(Path(path + ".gz").read_bytes()).decode().splitlines()


def stalls(run: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for log in glob.glob(f"{run}/run/logs/*.log"):
        name = os.path.basename(log)[:-4]
        out[name] = [json.loads(line) for line in Path(log).read_text().splitlines() if '"loop_stall"' in line]
    if not out:   # the kept copy: every service's events in one file
        out = {"gateway": [], "scheduler": []}
        for line in read_lines(f"{run}/loop_stalls.jsonl"):   # each with its process, as logs/ names it
            event = json.loads(line)
            if event["event"] == "loop_stall":
                out.setdefault(event["process"], []).append(event)
    return {k: v for k, v in out.items() if v or k in ("gateway", "scheduler")}


def yields(run: str) -> dict[str, list[bool]]:
    """Each worker's `saturation_yield` events in turn: yielding or not (from 2026-12-05's saturation yield)."""
    out: dict[str, list[bool]] = {}
    logs = glob.glob(f"{run}/run/logs/worker-*.log")
    lines = [(os.path.basename(log)[:-4], line) for log in logs for line in Path(log).read_text().splitlines()]
    if not logs and Path(f"{run}/loop_stalls.jsonl").is_file():
        lines = [(json.loads(line)["process"], line) for line in read_lines(f"{run}/loop_stalls.jsonl")]
    for process, line in lines:
        if '"saturation_yield"' in line:
            out.setdefault(process, []).append(json.loads(line)["yielding"])
    return out


def stolen(run: str, stall: dict, steal: list[dict]) -> int:
    start, end = stall["ts"] - stall["ms"] / 1e3, stall["ts"] + 0.02
    return sum(s["steal"] for s in steal if start <= s["ts"] <= end)


def summarize(run: str) -> dict:
    ref = json.loads(Path(f"{run}/summary.json").read_text())["runs"]["reference"]
    steal = [json.loads(line) for line in read_lines(f"{run}/steal.jsonl")]
    by_service = stalls(run)
    gateway = by_service.get("gateway", [])
    total = sum(s["ms"] for s in gateway)
    cpu = sum(min(s["cpu_ms"], s["ms"]) for s in gateway)
    collector = sum(s["collector_ms"] for s in gateway)
    with_steal = [s for s in gateway if stolen(run, s, steal) >= STEAL_JIFFIES]
    probe = ref["beside"]["refusal_probe"]
    return {
        "goodput_of_capacity": ref.get("goodput_of_capacity"), "lost": ref["lost"],
        "probe_refused": probe["RESOURCE_EXHAUSTED"]["count"], "probe_refusal_p99_ms": ref["probe_refusal_p99_ms"],
        "probe_by_origin": probe.get("refusals_by_origin"),
        "load_edge_refusal_p99_ms": ref["refusals_by_origin"].get("gateway", {}).get("p99_ms"),
        "workers_yielding": yields(run),
        "stalls": {k: {"count": len(v), "sum_ms": round(sum(s["ms"] for s in v)),
                       "max_ms": max((s["ms"] for s in v), default=0)} for k, v in sorted(by_service.items())},
        "gateway": {"sum_ms": round(total), "loop_cpu_ms": round(cpu), "collector_ms": round(collector),
                    "off_cpu_share": round(1 - cpu / total, 2) if total else None,
                    "stalls_with_steal": len(with_steal), "their_ms": round(sum(s["ms"] for s in with_steal)),
                    "longest": sorted(({k: s[k] for k in ("ms", "cpu_ms", "collector_ms", "samples")}
                                       | {"top": s["stacks"][0]["frames"][0] if s["stacks"] else ""}
                                       for s in gateway), key=lambda s: -s["ms"])[:5]},
    }


if __name__ == "__main__":
    runs = sorted(glob.glob(f"{sys.argv[1]}/*/summary.json"))
    json.dump({os.path.basename(os.path.dirname(r)): summarize(os.path.dirname(r)) for r in runs}, sys.stdout,
              indent=1)
