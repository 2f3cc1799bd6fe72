"""Kills a process with SIGKILL, then times how long until the gateway answers again: check.sh's fault checks.

    python served_again.py PID TARGET CA KEY MODEL LIMIT_S

The client is made and has been answered once before the kill, so the figure is the mesh's, not this program's
start. Tries every 50 ms, each with a 1 s deadline. Prints the seconds from the kill to the first answer; exits 1
when none came within LIMIT_S."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from academus.client import AcademusError, Client


def main(pid: int, target: str, ca: str, key: str, model: str, limit_s: float) -> int:
    with Client(target, api_key=key, root_certificates=Path(ca).read_bytes(), timeout=5) as client:
        client.infer(model, ["before the kill"])
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() - killed < limit_s:
            try:
                client.infer(model, ["a wonderful, moving film"], timeout=1)
            except AcademusError:
                time.sleep(0.05)
                continue
            print(f"{time.monotonic() - killed:.2f}")
            return 0
    return 1


if __name__ == "__main__":
    pid, target, ca, key, model, limit = sys.argv[1:]
    sys.exit(main(int(pid), target, ca, key, model, float(limit)))
