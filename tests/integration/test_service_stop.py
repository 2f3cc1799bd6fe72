"""A stopping service ends its background tasks even when a library swallowed a task's cancellation."""

from __future__ import annotations

import asyncio

from academus.shared.runtime.config import CommonConfig, load
from academus.shared.runtime.serving import RunningService, ServiceSpec


async def test_a_task_that_swallowed_its_cancellation_is_cancelled_again_and_ends():
    """The scheduler's load reporter did this: its loop caught what its Redis call turned the cancellation into,
    and the stop waited out the whole grace period (20 s in the test mesh). It is cancelled again and ends, well
    within a grace period long enough that a stop waiting it out would leave the task running here."""
    swallowed: list[int] = []
    looping = asyncio.Event()

    async def reporter() -> None:
        while True:
            looping.set()
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(1)   # as `contextlib.suppress(Exception)` around a call that converted it

    config = load(CommonConfig, {"ACADEMUS_PORT": "0", "ACADEMUS_METRICS_PORT": "-1", "ACADEMUS_GRACE_S": "600",
                                 "ACADEMUS_LOCAL_PLANE": "false"})
    service = RunningService(ServiceSpec("stopping", config, lambda server: None, [], extra_tasks=[reporter]))
    await service.start()
    await looping.wait()
    stop = asyncio.create_task(service.stop())
    done, _ = await asyncio.wait({stop}, timeout=60)
    assert done, "the stop waited on the task that swallowed its cancellation"
    assert swallowed == [1] and all(t.done() for t in service._tasks)
