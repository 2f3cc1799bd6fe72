"""One line a sweep of `loader_ab.py`'s output, then each target's cells: `python summarize.py OUT_DIR`.

Per sweep: the profile's rest (the fixed part at the task's length bucket, the part a layer, the tail), the whole
model's ms, the figures `sti_bench` prints; per target: the STI arm's shape, the rest its plan reserved, how far its
runs' p50 lay past the plan's finish (compute, stall and rest as planned), its accuracy, its p95 over T plain and
paced, its stall share, and the share of paced runs cut short."""

from __future__ import annotations

import json
import sys
from pathlib import Path

STI, PACED = "sti-4096k", "sti-4096k-paced"


def setup_ms(profile: dict, width: int, bucket: str) -> float:
    """The loads' set-up a layer the plan reserved: one figure (66b378a), one a width (ef0090d), one a width and
    bucket (after it), or none (before)."""
    setup = profile.get("layer_setup_ms", 0.0)
    if not isinstance(setup, dict):
        return float(setup)
    by = setup.get(str(width), 0.0)
    return float(by[bucket]) if isinstance(by, dict) else float(by)


def main() -> None:
    out = Path(sys.argv[1])
    sweeps = sorted(p for p in out.iterdir() if (p / "cold.json").is_file())
    for sweep in sweeps:
        d = json.loads((sweep / "cold.json").read_text())
        profile, result = d["profile"], d["results"][0]
        bucket = str(result["length"])
        f = d["figures"]
        setups = "/".join(f"{setup_ms(profile, w, bucket):.3f}" for w in (3, 6, 9, 12))
        rest = (f"rest {profile['overhead_ms'][bucket]:.3f} + {setups} a layer (widths 3/6/9/12), "
                f"tail {profile.get('finish_ms', {}).get(bucket, float('nan')):.3f}")
        print(f"{sweep.name} | {rest} | whole model {result['full_model_ms']} ms "
              f"| over l&e {f['sti_over_load&exec_pp']} stdpl32 {f['sti_over_stdpl-32_pp']} "
              f"stdpl2 {f['sti_over_stdpl-2_pp']} stdpl6 {f['sti_over_stdpl-6_pp']} "
              f"| vs whole {f['sti_minus_whole_model_pp_at_T>=0.75']} | preload {f['preload_over_none_pp']} "
              f"importance {f['importance_over_random_pp']} | p95/T max {f['sti_p95_over_target_max']} paced max "
              f"{f['paced_p95_over_target_max']} | stall max {f['sti_stall_share_max']} | cut short "
              f"{f['paced_cut_short_mean']}")
    print()
    print("sweep | T | sti shape | rest planned ms | p50 - planned finish, ms | acc | p95/T | paced p95/T | stall | "
          "cut short")
    for sweep in sweeps:
        d = json.loads((sweep / "cold.json").read_text())
        profile, result = d["profile"], d["results"][0]
        bucket = str(result["length"])
        rows = {(r["target_x"], r["arm"]): r for r in result["rows"]}
        for t in d["targets"]:
            s, p = rows[(t, STI)], rows[(t, PACED)]
            planned = profile["overhead_ms"][bucket] + s["depth"] * setup_ms(profile, s["width"], bucket)
            finish = s["planned_compute_ms"] + s["planned_stall_ms"] + planned
            print(f"{sweep.name} | {t} | {s['depth']}x{s['width']}@{s['mean_bits']} | {planned:.2f} | "
                  f"{s['p50_ms'] - finish:+.2f} | {s['accuracy']} | {s['p95_over_target']} | "
                  f"{p['p95_over_target']} | {s['stall_share']} | {p['cut_short']}")


if __name__ == "__main__":
    main()
