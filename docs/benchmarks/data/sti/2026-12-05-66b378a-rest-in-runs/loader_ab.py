"""The STI loader before and after a change, each arm in fresh processes, the order alternating:

1. a shard's load as the planner profiles it (read, check, decode, put into the layer; a whole layer at a time
   while a layer computes on the other thread), REPEATS layers a version, through the sweep's `--io` source;
2. `sti_bench` (which profiles at its start and plans on that profile), with the arguments given after `--`.

    python loader_ab.py OLD_PATH SHARDS_DIR ROUNDS REPEATS OUT_DIR -- [sti_bench args...]

OLD_PATH holds an `academus` package of the commit before (its `shared`, `services`, `loadgen` and
`shared/client` linked from a git worktree, `v1` from this checkout's protos): put first on PYTHONPATH, it wins
over the editable install. The accuracy cache of the first sweep (or $SEED_CACHE) is copied to the later ones.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


def profile_loads(shards: str, repeats: int, io: str) -> dict:
    import torch

    from academus.shared.models.shard_io import io_source
    from academus.shared.models.shard_store import ShardStore
    from academus.shared.models.shards import FULL
    from academus.shared.models.sti_pipeline import ElasticModel
    from academus.shared.training.shards import _load_profile

    try:   # as sti_bench's process does, from the commit that has it (a75caec set it inside the load profile)
        from academus.shared.runtime.heap import keep_freed_pages
    except ImportError:
        pass
    else:
        keep_freed_pages()
    torch.set_num_threads(1)   # sti_bench's default on 2 cores: the loader takes the other
    store = ShardStore(Path(shards))
    model = ElasticModel(store, "", heads={})
    weights = [store.decode(0, s, FULL, store.read_stored(0, s, FULL)) for s in range(store.geometry.heads)]
    busy = model.assemble(0, list(range(store.geometry.heads)), weights)
    load_ms, decode_ms = _load_profile(store, model, io_source(io), repeats, busy, 1996)
    return {"load_ms": load_ms, "decode_ms": decode_ms}


def env_of(arm: str, old_path: str) -> dict[str, str]:
    env = dict(os.environ)
    if arm == "old":
        env["PYTHONPATH"] = old_path
    return env


def main() -> None:
    if sys.argv[1] == "--profile":
        print(json.dumps(profile_loads(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
        return
    split = sys.argv.index("--")
    old_path, shards, rounds, repeats, out = sys.argv[1:split]
    bench_args = sys.argv[split + 1:]
    io = bench_args[bench_args.index("--io") + 1] if "--io" in bench_args else "file"
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs, cache = [], (Path(os.environ["SEED_CACHE"]) if os.environ.get("SEED_CACHE") else None)
    for r in range(int(rounds)):
        for arm in (("old", "new") if r % 2 == 0 else ("new", "old")):
            env = env_of(arm, old_path)
            line = subprocess.run([sys.executable, __file__, "--profile", shards, repeats, io], check=True, env=env,
                                  capture_output=True, text=True).stdout.strip().splitlines()[-1]
            row = {"round": r, "arm": arm, **json.loads(line)}
            if bench_args:
                run = out_dir / f"{r}-{arm}"
                run.mkdir(exist_ok=True)
                if cache is not None:
                    shutil.copy(cache, run / "accuracy_cache.json")
                with open(run / "log.txt", "w") as log:
                    subprocess.run([sys.executable, "-m", "academus.loadgen.sti_bench", *bench_args, "--out",
                                    str(run)], check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
                cache = run / "accuracy_cache.json"
                row["sweep"] = str(run)
            runs.append(row)
            print(r, arm, {k: round(v, 3) for k, v in row["load_ms"].items()}, flush=True)
    (out_dir / "loader_ab.json").write_text(json.dumps({"repeats": int(repeats), "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
