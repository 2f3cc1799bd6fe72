"""Prompt refusals on the real mesh: a scheduler whose queue holds more work than its wait bound refuses
RESOURCE_EXHAUSTED at once, and the gateway honours the pushback hint, instead of letting requests wait out
their deadlines in a queue that only grows (issue 38)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import pytest

from academus.client import AcademusError, AsyncClient
from academus.shared.cli.mesh import MeshState, down
from academus.shared.runtime.metrics import scrape
from tests.e2e.conftest import service, start_mesh

pytestmark = pytest.mark.e2e
MODEL = "spam"
WAIT_BOUND_MS = 100
TEXT = "win a free cruise now, reply with your card number to claim the prize before midnight " * 6


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshState]:
    run_dir = tmp_path_factory.mktemp("admission-run")
    # a queue long in requests, short in time: only the wait bound can refuse here
    state = start_mesh(run_dir, env={"ACADEMUS_MODELS": MODEL, "ACADEMUS_QUEUE_CAPACITY": "100000",
                                     "ACADEMUS_MAX_QUEUE_WAIT_MS": str(WAIT_BOUND_MS)})
    yield state
    down(run_dir)


async def burst(mesh: MeshState, key: str, count: int) -> list:
    async with AsyncClient(mesh.gateway, api_key=key, timeout=120) as client:
        await client.infer(MODEL, [TEXT])   # the scheduler measures a batch's time before it estimates waits

        async def one(i: int):
            try:
                return await client.infer(MODEL, [f"{i} {TEXT}"])
            except AcademusError as e:
                return e

        return await asyncio.gather(*(one(i) for i in range(count)))


def test_a_burst_past_the_wait_bound_is_refused_at_once_and_the_rest_answered(mesh, admin_key):
    answers = asyncio.run(burst(mesh, admin_key, 200))
    codes = Counter(a.code if isinstance(a, AcademusError) else "OK" for a in answers)
    # 200 requests of one text each at once: seconds of work on a CPU worker, against a 100 ms bound; each
    # has two minutes, so no deadline refuses any, and without the bound every one would wait its turn
    assert set(codes) == {"OK", "RESOURCE_EXHAUSTED"}, codes
    refused = [a.details for a in answers if isinstance(a, AcademusError)]
    at_scheduler = [d for d in refused if f"the limit is ACADEMUS_MAX_QUEUE_WAIT_MS={WAIT_BOUND_MS}" in d]
    at_edge = [d for d in refused if d.startswith(f"every scheduler serving model {MODEL!r} has a full queue")]
    assert at_scheduler, refused[:3]
    assert len(at_scheduler) + len(at_edge) == len(refused), refused[:3]
    # the scheduler counts each refusal it made (the ones at the edge never reached it)
    port = service(mesh, "scheduler").metrics_port
    counted = sum(s.value for s in scrape(port) if s.name == "academus_rpc_errors_total"
                  and s.labels.get("code") == "RESOURCE_EXHAUSTED")
    assert counted == len(at_scheduler)
