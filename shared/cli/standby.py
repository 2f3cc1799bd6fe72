"""A standby service process: its modules imported, it waits to become the next copy of one service.

    python -m academus.shared.cli.standby worker      (started by the supervisor of `academus up --standby`)

A worker's start is mostly imports: torch and transformers take about 4.7 s of CPU on this project's 2-core
machine, before it loads a model. A restart pays them again, and a crash under overload is when the node can
least spare them. The supervisor keeps one standby per worker, started with that worker's settings. When the
worker dies, the supervisor writes `go` on the standby's stdin, and the standby runs the service's `main()`, as
`python -m academus.services.worker` would, under the same pid. Until then its session's autogroup is at nice
19, so its imports take only CPU that the serving processes leave; a `go` that comes during the imports lifts
it at once, as they are then on the path to serving. At end of file (the supervisor stopped) it exits without
serving.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import threading
import time

from academus.shared.runtime.logs import log_event, setup_logging
from academus.shared.runtime.slices import autogroup_nice, set_autogroup_nice

GO = "go"
READY = "standby_ready"   # the event its log gets once imported
WAITING_NICE = 19
SERVICES = ("worker",)   # the others import in about 0.6 s: a standby would save little for its memory


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m academus.shared.cli.standby", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("service", choices=SERVICES)
    args = p.parse_args(argv)
    setup_logging("standby")
    began, cpu = time.monotonic(), time.process_time()
    listener = threading.Thread(target=_listen, name="standby-stdin", daemon=True)
    listener.start()   # before the imports, which a `go` must not wait behind at nice 19
    server = importlib.import_module(f"academus.services.{args.service}.server")
    log_event(READY, pid=os.getpid(), serves=args.service, import_s=round(time.monotonic() - began, 3),
              import_cpu_s=round(time.process_time() - cpu, 3))
    listener.join()
    log_event("standby_serves", pid=os.getpid(), waited_s=round(time.monotonic() - began, 3))
    server.main()
    return 0


def _listen() -> None:
    """Waits at nice 19 (its own session only: else the autogroup is a terminal's too) until the supervisor
    says go, then serves at the session's own nice value. Anything else, or end of file, ends the process at
    once, imported or not."""
    own_group = os.getsid(0) == os.getpid()
    serving_nice = autogroup_nice() if own_group else None
    if own_group:
        set_autogroup_nice(WAITING_NICE)
    if sys.stdin.readline().strip() != GO:
        os._exit(0)
    if serving_nice is not None:
        set_autogroup_nice(serving_nice)


if __name__ == "__main__":
    raise SystemExit(main())
