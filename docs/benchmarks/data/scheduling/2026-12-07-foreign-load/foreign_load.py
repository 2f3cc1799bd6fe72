"""A saturated worker's yield (ACADEMUS_SATURATED_NICE) on a machine shared with other busy programs.

    python foreign_load.py ROUNDS OUT.jsonl

Each arm: a fresh `academus up` mesh serving `minilm` with the setting at 10 (the default) or 0, two busy loops
beside it (each a program of its own: its own session, so its own autogroup, at nice 0), then 24 concurrent requests
of 8 texts of 256 tokens (the drain test's queue in tests/e2e/test_http_api.py) from the SDK, each with a 300 s
deadline. Records each status's count, the time of the last answer and of the last status. The arms' order
alternates between rounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from academus.client import AcademusError, Client

TEXTS = [" ".join(["a fairly long sentence about nothing in particular"] * 40)] * 8
LIMIT_S = 300.0


def run_arm(nice: str) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="foreign-"))
    env = {**os.environ, "ACADEMUS_MODELS": "minilm", "ACADEMUS_SATURATED_NICE": nice}
    subprocess.run(["academus", "--run-dir", str(run_dir), "up", "--detach"], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    mesh = json.loads((run_dir / "mesh.json").read_text())
    key = (run_dir / "admin.key").read_text().strip()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(2)]
    try:
        with Client(mesh["gateway"], api_key=key, timeout=LIMIT_S) as client, ThreadPoolExecutor(24) as pool:
            client.infer("minilm", ["warm"])
            start = time.monotonic()

            def send() -> tuple[str, float]:
                try:
                    client.infer("minilm", TEXTS, truncate=True)
                    return "OK", time.monotonic() - start
                except AcademusError as e:
                    return e.code, time.monotonic() - start

            done = list(pool.map(lambda _: send(), range(24)))
    finally:
        for hog in hogs:
            hog.kill()
        subprocess.run(["academus", "--run-dir", str(run_dir), "down"], stdout=subprocess.DEVNULL)
    answered = [t for code, t in done if code == "OK"]
    codes = {code: sum(c == code for c, _ in done) for code in sorted({c for c, _ in done})}
    return {"saturated_nice": int(nice), "codes": codes, "last_answer_s": round(max(answered), 2) if answered else None,
            "last_status_s": round(max(t for _, t in done), 2)}


def main(rounds: int, out: Path) -> None:
    with out.open("w") as f:
        for r in range(rounds):
            for nice in (("10", "0") if r % 2 == 0 else ("0", "10")):
                row = {"round": r, **run_arm(nice)}
                print(json.dumps(row), flush=True)
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
