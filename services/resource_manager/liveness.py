"""Worker liveness by stream: the resource manager holds a health stream open to each registered worker, so a
worker process that dies is dropped from the placements and its groups re-planned onto the workers left within a
round trip, not after its heartbeat's TTL (seconds in which every group with a student on it was lost to its
scheduler: eq. 6 spreads a group's students over the devices, so one lost device can take a model's every group).

A broken stream alone proves nothing (a connection can break under a live process), so a worker is declared lost
only when its port then refuses health checks (`probe`). A hung process (stopped, deadlocked) neither breaks its
stream nor refuses: a worker that answered a check and then stays silent through the hang bound (`silent`) is lost
too, so the groups it holds are re-planned in about two seconds rather than its TTL's five. One the resource
manager never reached (a network that keeps it out) is left to the heartbeat's TTL, which the reaper enforces:
dropping it would only make it register again and flap its groups."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from academus.shared.runtime.logs import log_event

# (address, registration) -> whether the stream was open before it ended (it returns only when it ends)
Watch = Callable[[str, str], Awaitable[bool]]
Probe = Callable[[str, str], Awaitable[bool]]      # (address, registration) -> the worker answered
# (address, registration) -> whether the worker answered a check (True), stayed silent through the hang bound
# (False), or neither (None: it refused, or was never reached)
Silent = Callable[[str, str], Awaitable[bool | None]]
OnLost = Callable[[str, str], Awaitable[None]]     # (worker_id, registration)


class LivenessWatch:
    """One watching task per registered worker process (its id and registration token): `follow` starts it at
    each registration, `forget` ends it when the worker leaves, `sync` takes over the registrations already in
    Redis at start, and a stream that ends on a worker that no longer answers calls `on_lost` once."""

    def __init__(self, watch: Watch, probe: Probe, on_lost: OnLost, retry_s: float = 1.0,
                 silent: Silent | None = None, check_every_s: float = 0.5) -> None:
        self.watch, self.probe, self.on_lost, self.retry_s = watch, probe, on_lost, retry_s
        self.silent, self.check_every_s = silent, check_every_s
        self._followed: dict[str, tuple[str, asyncio.Task]] = {}   # worker_id -> (registration, its task)
        self.lost = 0   # workers declared lost since start

    def follow(self, worker_id: str, address: str, registration: str) -> None:
        """Watches the worker's process registered as `registration`; one it already watches goes on unchanged."""
        current = self._followed.get(worker_id)
        if current is not None and current[0] == registration:
            return
        if current is not None:
            current[1].cancel()
        task = asyncio.get_running_loop().create_task(self._follow(worker_id, address, registration))
        self._followed[worker_id] = (registration, task)

    def sync(self, registered: dict[str, tuple[str, str]]) -> None:
        """Follows exactly the registered workers (worker_id -> (address, registration)): at the resource manager's
        start, when the workers that registered with its predecessor are not yet followed."""
        for worker_id in self._followed.keys() - registered.keys():
            self.forget(worker_id)
        for worker_id, (address, registration) in registered.items():
            self.follow(worker_id, address, registration)

    def forget(self, worker_id: str) -> None:
        """Stops watching a worker that left (deregistered, or reaped): its stream's end is no loss."""
        followed = self._followed.pop(worker_id, None)
        if followed is not None:
            followed[1].cancel()

    def followed(self) -> dict[str, str]:
        """worker_id -> the registration watched."""
        return {worker_id: registration for worker_id, (registration, _) in self._followed.items()}

    async def close(self) -> None:
        tasks = [task for _, task in self._followed.values()]
        self._followed.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, worker_id: str, address: str, registration: str) -> None:
        """Whichever notices first, the stream's end on a refusing port or a check left unanswered, declares the
        worker lost; the other watch ends with it."""
        watches = [self._until_refused(worker_id, address, registration)]
        if self.silent is not None:
            watches.append(self._until_hung(self.silent, address, registration))
        tasks = [asyncio.ensure_future(w) for w in watches]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
        how = next(iter(done)).result()
        self.lost += 1
        log_event("worker_lost", logging.WARNING, worker_id=worker_id, address=address, how=how)
        try:
            await self.on_lost(worker_id, registration)
        except Exception as e:  # Redis away: the reaper drops it once its key expires
            log_event("worker_lost_drop_failed", logging.WARNING, worker_id=worker_id, error=repr(e))

    async def _until_refused(self, worker_id: str, address: str, registration: str) -> str:
        while True:
            reached = await self.watch(address, registration)
            if reached and not await self.probe(address, registration):
                return "refused"
            if reached:
                log_event("worker_stream_ended", worker_id=worker_id, address=address)   # it answered: kept
            # alive (a stream ended under a live process), or never reached: watch again after a pause, not in a
            # loop that would spin on a peer refusing at once
            await asyncio.sleep(self.retry_s)

    async def _until_hung(self, silent: Silent, address: str, registration: str) -> str:
        """Checks the worker every check_every_s; silence counts only after it has answered once, so a worker
        the resource manager cannot reach is left to its TTL."""
        answered = False
        while True:
            outcome = await silent(address, registration)
            if outcome is False and answered:
                return "silent"
            answered = answered or outcome is True
            await asyncio.sleep(self.check_every_s)
