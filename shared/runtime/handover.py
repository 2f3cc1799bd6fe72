"""A stopping scheduler or gateway hands its place to its standby before it drains (`academus up --standby`).

Without it, a SIGTERM'd service drains its in-flight calls (up to `grace_s`), exits, and only then does the
supervisor start its standby: the port is closed and the service missing for the whole drain. With it, the
stopping service deregisters, then asks for its standby through files beside each other, named by its setting
`handover` (the supervisor sets it per process; unset, nothing changes):

- `<path>.ready`: the supervisor offers a standby (made when it starts one, removed when it takes it or stops);
- `<path>.wanted`: the stopping service renamed `ready` to it;
- `<path>.going`: the supervisor, polling, renamed `wanted` to it and told the standby to go. The standby, once
  serving on the same ports (they are bound with SO_REUSEPORT) and registered, removes it.

The stopping service waits until neither of the last two is left (at most `HANDOVER_WAIT_S`) before it closes
its listener and drains, so a client that reconnects finds a server. Each rename is atomic: a service whose
supervisor is stopping finds no offer and stops as before. Deregistering first keeps a registration the new
process makes from being removed by the old one's.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

HANDOVER_WAIT_S = 2.0   # a standby told to go serves in 30-80 ms when built; one still building is not waited for
POLL_S = 0.01


class Handover:
    """The two files of one process's handover; no process state of its own, so each side opens its own."""

    def __init__(self, path: str | Path) -> None:
        self.ready = Path(f"{path}.ready")
        self.wanted = Path(f"{path}.wanted")
        self.going = Path(f"{path}.going")

    # the supervisor's side
    def offer(self) -> None:
        self.ready.parent.mkdir(parents=True, exist_ok=True)
        self.ready.touch()

    def claim(self) -> bool:
        """Whether the service asked for its standby since the last claim (each ask is claimed once)."""
        return _moved(self.wanted, self.going)

    def withdraw(self) -> None:
        """No standby to give (dead, or the supervisor stopping): no file stays, and a stopping service goes on."""
        for path in (self.ready, self.wanted, self.going):
            path.unlink(missing_ok=True)

    # the stopping service's side
    def ask(self) -> bool:
        """Takes the offer if there is one: whether a standby was offered."""
        return _moved(self.ready, self.wanted)

    async def taken(self, timeout_s: float = HANDOVER_WAIT_S) -> bool:
        """Waits until the standby serves, or the supervisor withdrew: False after `timeout_s`."""
        end = time.monotonic() + timeout_s
        while self.wanted.exists() or self.going.exists():
            if time.monotonic() >= end:
                return False
            await asyncio.sleep(POLL_S)
        return True

    # the standby's side, once it serves
    def served(self) -> None:
        self.going.unlink(missing_ok=True)


def _moved(source: Path, target: Path) -> bool:
    """Renames `source` (atomically: one of two racing movers wins); False where it was not there."""
    try:
        source.rename(target)
    except FileNotFoundError:
        return False
    return True
