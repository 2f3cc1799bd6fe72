from __future__ import annotations

import pytest

from academus.shared.config import ConfigError, GatewayConfig, SchedulerConfig, WorkerConfig, load


def test_env_overrides_and_redis_url_fallback():
    env = {"ACADEMUS_MAX_INPUTS": "8", "REDIS_URL": "redis://10.0.0.1:1/0", "ACADEMUS_GRACE_S": "2.5"}
    config = load(GatewayConfig, env)
    assert (config.max_inputs, config.redis_url, config.grace_s) == (8, "redis://10.0.0.1:1/0", 2.5)


@pytest.mark.parametrize(("cls", "env", "message"), [
    (GatewayConfig, {"ACADEMUS_MAX_TOKENS": "1000"}, "ACADEMUS_MAX_TOKENS=1000"),
    (GatewayConfig, {"ACADEMUS_MAX_INPUTS": "0"}, "ACADEMUS_MAX_INPUTS=0"),
    (SchedulerConfig, {"ACADEMUS_QUEUE_CAPACITY": "0"}, "ACADEMUS_QUEUE_CAPACITY=0"),
    (WorkerConfig, {"ACADEMUS_DEVICE": "tpu"}, "ACADEMUS_DEVICE='tpu'"),
    (GatewayConfig, {"ACADEMUS_PORT": "x"}, "ACADEMUS_PORT='x' is not a number"),
])
def test_bad_values_name_the_variable(cls, env, message):
    with pytest.raises(ConfigError, match=message):
        load(cls, env)
