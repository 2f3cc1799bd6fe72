"""A standby service process: built and waiting to become the next copy of one service.

    python -m academus.shared.cli.standby worker      (started by the supervisor of `academus up --standby`)

A worker's start is its imports (torch and transformers: about 4.7 s of CPU on this project's 2-core machine)
and its build (loading its models and tracing their layers: about 1.9 s more); a scheduler's and a gateway's,
about 0.6 s. A restart pays them again, and a crash under overload is when the node can least spare them. The
supervisor keeps one standby per worker, scheduler and gateway, started with that process's settings. A
standby imports the service and builds it (`build()`, everything but the server), then waits. When the process
dies, the supervisor writes `go` on the standby's stdin; the standby starts its server, registers and serves,
under its own pid. Until then its session's autogroup is held at nice 19, so its start takes only CPU that the
serving processes leave. A `go` that comes before the build is done lifts it at once, as the build is then on
the path to serving. At end of file (the supervisor stopped) it exits without serving.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
import threading
import time

from academus.shared.runtime.logs import log_event, setup_logging
from academus.shared.runtime.slices import hold_autogroup, release_autogroup

GO = "go"
READY = "standby_ready"   # the event its log gets once built
WAITING_NICE = 19
SERVICES = ("worker", "scheduler", "gateway")   # the request path; the others' restarts fail no request
# those whose standby takes a SIGTERM'd process's place before it drains (runtime/handover.py); a worker's would
# compute beside it on cores the load fills: measured, that cost more than its drain (docs/design/supervision.md)
HANDOVER_SERVICES = ("scheduler", "gateway")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m academus.shared.cli.standby", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("service", choices=SERVICES)
    args = p.parse_args(argv)
    setup_logging("standby")
    began, cpu = time.monotonic(), time.process_time()
    went = threading.Event()
    threading.Thread(target=_listen, args=(went,), name="standby-stdin", daemon=True).start()   # before
    # the imports and the build, which a `go` must not wait behind at nice 19
    server = importlib.import_module(f"academus.services.{args.service}.server")

    async def turn() -> None:
        log_event(READY, pid=os.getpid(), serves=args.service, start_s=round(time.monotonic() - began, 3),
                  start_cpu_s=round(time.process_time() - cpu, 3))
        await asyncio.to_thread(went.wait)
        log_event("standby_serves", pid=os.getpid(), waited_s=round(time.monotonic() - began, 3))

    from academus.shared.runtime.serving import run  # here: the supervisor imports this module's names

    run(server.build, gate=turn)
    return 0


def _listen(went: threading.Event) -> None:
    """Holds the autogroup at nice 19 (where it leads its session) until the supervisor says go, then releases
    it to the value the service set, or had. Anything else, or end of file, ends the process at once, built
    or not."""
    hold_autogroup(WAITING_NICE)
    if sys.stdin.readline().strip() != GO:
        os._exit(0)
    release_autogroup()
    went.set()


if __name__ == "__main__":
    raise SystemExit(main())
