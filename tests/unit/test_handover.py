"""The handover's files (runtime/handover.py): a stopping service asks once for the standby offered, the
supervisor claims each ask once, and the standby serving (or the supervisor withdrawing) lets the service drain."""

from __future__ import annotations

import asyncio
from pathlib import Path

from academus.shared.runtime.handover import Handover
from academus.shared.runtime.metrics import scrape, start_metrics


def test_without_an_offer_a_stopping_service_goes_on_at_once(tmp_path: Path) -> None:
    handover = Handover(tmp_path / "gateway")
    assert not handover.ask()
    assert not handover.claim()
    assert asyncio.run(handover.taken(0.0))


def test_an_ask_is_claimed_once_and_waited_on_until_the_standby_serves(tmp_path: Path) -> None:
    supervisor, service, standby = (Handover(tmp_path / "handover" / "worker-0") for _ in range(3))
    supervisor.offer()
    assert service.ask()
    assert not service.ask(), "one offer, one ask"
    assert supervisor.claim()
    assert not supervisor.claim(), "claimed once: the next poll does not hand over again"
    assert not asyncio.run(service.taken(0.05)), "the standby is not serving yet"
    standby.served()
    assert asyncio.run(service.taken(0.0))
    assert not any((tmp_path / "handover").iterdir())


def test_a_withdrawn_offer_lets_a_waiting_service_go_on(tmp_path: Path) -> None:
    supervisor, service = Handover(tmp_path / "scheduler"), Handover(tmp_path / "scheduler")
    supervisor.offer()
    assert service.ask()
    supervisor.withdraw()   # its standby died, or the supervisor stops
    assert asyncio.run(service.taken(0.0))
    assert not service.ask()


def test_a_metrics_port_is_held_by_the_stopping_process_and_its_standby_at_once() -> None:
    port = start_metrics(0)
    assert start_metrics(port) == port   # the standby's bind, while the stopping process still serves it
    assert any(s.name == "python_info" for s in scrape(port))
