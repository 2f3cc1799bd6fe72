"""The trainer service: no RPCs of its own (the gateway's Manage API queues its work in Redis), only
health and the job loop as a background task; a stop hands the running job back to the queue."""

from __future__ import annotations

from academus.services.trainer.core import build_runner
from academus.shared.runtime import config as cfg
from academus.shared.runtime.logs import log_event
from academus.shared.runtime.redis_conn import connect
from academus.shared.runtime.serving import ServiceSpec, run
from academus.shared.state.keys import Keys


async def build() -> ServiceSpec:
    config = cfg.load(cfg.TrainerConfig)
    if config.torch_threads:
        import torch

        torch.set_num_threads(config.torch_threads)
    redis = connect(config.redis_url, config.redis_password)
    runner = build_runner(redis, Keys(config.key_prefix), config)

    async def started(address: str) -> None:
        runner.trainer_id = runner.trainer_id or address  # leases name it: a unique id per process
        log_event("trainer_ready", trainer_id=runner.trainer_id, device=config.device)

    return ServiceSpec(
        name="trainer",
        config=config,
        add_servicers=lambda server: None,
        service_names=[],
        on_started=started,
        on_stopped=redis.aclose,
        extra_tasks=[runner.run_forever],
    )


def main() -> None:
    run(build)


if __name__ == "__main__":
    main()
