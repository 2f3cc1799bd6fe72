"""The resource manager's liveness watch as a core: when a worker's stream ending makes it lost, and when not."""

from __future__ import annotations

import asyncio

from academus.services.resource_manager.liveness import LivenessWatch


class Worker:
    """A worker as the watch sees it: its stream (open until `die`, or never reached), its health check."""

    def __init__(self, reached: bool = True) -> None:
        self.reached, self.alive = reached, True
        self.streams = 0
        self._ended = asyncio.Event()

    async def watch(self, address: str, registration: str) -> bool:
        self.streams += 1
        if self.reached:
            await self._ended.wait()
            self._ended.clear()
        return self.reached

    async def probe(self, address: str, registration: str) -> bool:
        return self.alive

    def end_stream(self, alive: bool) -> None:
        self.alive = alive
        self._ended.set()


def watching(worker: Worker, lost: list) -> LivenessWatch:
    """The watch over `worker`, with its hang checks when it has them."""
    async def on_lost(worker_id: str, registration: str) -> None:
        lost.append((worker_id, registration))

    return LivenessWatch(worker.watch, worker.probe, on_lost, retry_s=0.01, silent=getattr(worker, "silent", None),
                         check_every_s=0.01)


async def settle() -> None:
    await asyncio.sleep(0.05)


async def following(worker: Worker) -> tuple[LivenessWatch, list]:
    """The watch following `worker` as w1 (registration r1), settled, and the losses it declares."""
    lost: list = []
    liveness = watching(worker, lost)
    liveness.follow("w1", "127.0.0.1:1", "r1")
    await settle()
    return liveness, lost


async def test_a_broken_stream_to_a_dead_worker_declares_it_lost_once():
    worker = Worker()
    liveness, lost = await following(worker)
    worker.end_stream(alive=False)
    await settle()
    assert lost == [("w1", "r1")] and liveness.lost == 1
    assert worker.streams == 1   # not watched again
    await liveness.close()


async def test_a_broken_stream_under_a_live_worker_is_watched_again():
    worker = Worker()
    liveness, lost = await following(worker)
    worker.end_stream(alive=True)
    await settle()
    assert lost == [] and worker.streams == 2
    await liveness.close()


async def test_a_worker_never_reached_is_left_to_its_heartbeat():
    """Dropping a worker the resource manager cannot reach would only make it register again, and flap."""
    worker = Worker(reached=False)
    worker.alive = False
    liveness, lost = await following(worker)
    assert lost == [] and worker.streams > 1
    await liveness.close()


async def test_sync_follows_the_registrations_and_a_restart_replaces_its_watch():
    first, second, lost = Worker(), Worker(), []
    calls = {"r1": first, "r2": second, "r3": Worker()}

    async def watch(address: str, registration: str) -> bool:
        return await calls[registration].watch(address, registration)

    async def probe(address: str, registration: str) -> bool:
        return await calls[registration].probe(address, registration)

    async def on_lost(worker_id: str, registration: str) -> None:
        lost.append((worker_id, registration))

    liveness = LivenessWatch(watch, probe, on_lost, retry_s=0.01)
    liveness.sync({"w1": ("a:1", "r1"), "w2": ("a:2", "r3")})
    liveness.follow("w1", "a:1", "r1")   # the same process: one watch goes on
    await settle()
    assert liveness.followed() == {"w1": "r1", "w2": "r3"} and first.streams == 1
    liveness.sync({"w1": ("a:1", "r2")})   # w1 restarted, w2 gone
    await settle()
    assert liveness.followed() == {"w1": "r2"} and second.streams == 1
    first.end_stream(alive=False)   # the old process's watch was cancelled: nothing declares w1 lost
    await settle()
    assert lost == []
    await liveness.close()


class Hanging(Worker):
    """A worker whose health checks are answered (True) until `hang`, then unanswered (False), or refused (None):
    its stream stays open throughout, as a stopped process's does."""

    def __init__(self, answers: bool | None = True) -> None:
        super().__init__()
        self.answers: bool | None = answers
        self.checks = 0

    async def silent(self, address: str, registration: str) -> bool | None:
        self.checks += 1
        return self.answers


async def test_a_worker_that_answered_and_then_goes_silent_is_lost_with_its_stream_open():
    worker = Hanging()
    liveness, lost = await following(worker)
    assert lost == [] and worker.checks > 1   # answering: checked on, kept
    worker.answers = False
    await settle()
    assert lost == [("w1", "r1")] and liveness.lost == 1
    checks = worker.checks
    await settle()
    assert worker.checks == checks and worker.streams == 1   # both watches ended with the loss
    await liveness.close()


async def test_silence_from_a_worker_that_never_answered_is_left_to_its_heartbeat():
    """Never reached: the resource manager's network, not the worker, may be what is silent."""
    worker = Hanging(answers=False)
    liveness, lost = await following(worker)
    assert lost == [] and worker.checks > 1
    await liveness.close()


async def test_a_refused_check_is_not_silence():
    """A refusal is the stream's watch to judge (two refusals, a dead port), not the hang check's."""
    worker = Hanging()
    liveness, lost = await following(worker)
    worker.answers = None
    await settle()
    assert lost == []
    worker.end_stream(alive=False)
    await settle()
    assert lost == [("w1", "r1")]
    await liveness.close()


async def test_forgetting_a_worker_ends_its_hang_checks():
    worker = Hanging()
    liveness, lost = await following(worker)
    liveness.forget("w1")
    await settle()
    checks = worker.checks
    worker.answers = False
    await settle()
    assert worker.checks == checks and lost == []
    await liveness.close()
