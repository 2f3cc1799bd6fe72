from __future__ import annotations

import pytest

from academus.shared.runtime.config import ConfigError, GatewayConfig, SchedulerConfig, WorkerConfig, load


def test_env_overrides_and_redis_url_fallback():
    env = {"ACADEMUS_MAX_INPUTS": "8", "REDIS_URL": "redis://10.0.0.1:1/0", "ACADEMUS_GRACE_S": "2.5"}
    config = load(GatewayConfig, env)
    assert (config.max_inputs, config.redis_url, config.grace_s) == (8, "redis://10.0.0.1:1/0", 2.5)


@pytest.mark.parametrize(("cls", "env", "message"), [
    (GatewayConfig, {"ACADEMUS_MAX_TOKENS": "1000"}, "ACADEMUS_MAX_TOKENS=1000"),
    (GatewayConfig, {"ACADEMUS_MAX_INPUTS": "0"}, "ACADEMUS_MAX_INPUTS=0"),
    (SchedulerConfig, {"ACADEMUS_QUEUE_CAPACITY": "0"}, "ACADEMUS_QUEUE_CAPACITY=0"),
    (WorkerConfig, {"ACADEMUS_DEVICE": "tpu"}, "ACADEMUS_DEVICE='tpu'"),
    (WorkerConfig, {"ACADEMUS_PROFILE": "maybe"}, "ACADEMUS_PROFILE='maybe' must be true|false|auto"),
    (GatewayConfig, {"ACADEMUS_PORT": "x"}, "ACADEMUS_PORT='x' is not a number"),
    (GatewayConfig, {"ACADEMUS_MAX_REQUEST_BYTES": "1000"}, "ACADEMUS_MAX_REQUEST_BYTES=1000 must be 0, or >= "
                                                            "ACADEMUS_MAX_UPLOAD_BYTES"),
])
def test_bad_values_name_the_variable(cls, env, message):
    with pytest.raises(ConfigError, match=message):
        load(cls, env)


@pytest.mark.parametrize(("setting", "on_cpu", "on_gpu"), [
    (None, False, True), ("auto", False, True), ("true", True, True), ("ON", True, True), ("false", False, False),
    ("0", False, False),
])
def test_the_start_up_profile_runs_by_default_on_a_gpu_only(setting, on_cpu, on_gpu):
    """On a GPU the profile pays (the H200 ran 16 merged samples within 1.5x one sample's batch time: 2026-11-27,
    a3cc8db, docs/benchmarks/students.md); on CPU it would only lengthen the start."""
    config = load(WorkerConfig, {} if setting is None else {"ACADEMUS_PROFILE": setting})
    assert (config.profiles(cuda=False), config.profiles(cuda=True)) == (on_cpu, on_gpu)


def test_the_public_message_limit_is_the_largest_valid_request_plus_its_envelope():
    """Texts of 4-byte characters, each with a pair, at every input; or an upload, whichever is larger."""
    texts = load(GatewayConfig, {"ACADEMUS_MAX_INPUTS": "4", "ACADEMUS_MAX_TEXT_CHARS": "2000",
                                 "ACADEMUS_MAX_UPLOAD_BYTES": "4096"})
    assert texts.request_limit == 4 * 2 * 2000 * 4 + 64 * 1024
    upload = load(GatewayConfig, {"ACADEMUS_MAX_INPUTS": "1", "ACADEMUS_MAX_TEXT_CHARS": "10"})
    assert upload.request_limit == 8 * 1024 * 1024 + 64 * 1024
    assert load(GatewayConfig, {}).request_limit == 64 * 2 * 100_000 * 4 + 64 * 1024   # under the mesh's 64 MiB
    assert load(GatewayConfig, {"ACADEMUS_MAX_REQUEST_BYTES": str(9 << 20)}).request_limit == 9 << 20
