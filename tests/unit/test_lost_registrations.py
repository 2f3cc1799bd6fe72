"""The scheduler's hung-worker probe reads the resource manager's `lost <worker id> <registration>` events: a
registration announced lost was found dead or silent there, and is not asked again."""

from __future__ import annotations

from academus.services.scheduler.core import WorkerRef
from academus.services.scheduler.server import LostRegistrations, worker_probe


class Health:
    """A peer health check that counts its calls and always answers."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def answers(self, address: str, timeout_s: float, incarnation: str = "") -> bool:
        self.asked.append(incarnation)
        return True


def test_only_lost_events_with_a_registration_are_kept_and_the_oldest_go_first():
    lost = LostRegistrations(kept=2)
    for message in ("lost worker-0 r1", "serving scheduler-0@node-1", "lost worker-1", "lost worker-0 r1",
                    "lost worker-1 r2"):
        lost.hear(message)
    assert "r1" in lost and "r2" in lost and "worker-1" not in lost
    lost.hear("lost worker-0 r3")
    assert "r1" not in lost and "r2" in lost and "r3" in lost


async def test_a_registration_announced_lost_is_silent_without_a_check():
    health, lost = Health(), LostRegistrations()
    probe = worker_probe(health, lost)  # type: ignore[arg-type]
    lost.hear("lost worker-0 r1")
    assert await probe(WorkerRef("worker-0", "a:1", frozenset(), registration="r1")) is False
    assert await probe(WorkerRef("worker-0", "a:1", frozenset(), registration="r2")) is True   # its restart
    assert health.asked == ["r2"]
