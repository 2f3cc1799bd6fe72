"""One typed config per service; every environment override is read here and nowhere else."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TypeVar

ENV_PREFIX = "ACADEMUS_"


class ConfigError(ValueError):
    """A setting is out of range; the message names the variable and the value."""


def home_dir() -> Path:
    return Path(os.environ.get("ACADEMUS_HOME", Path.cwd() / ".academus"))


def artifacts_dir() -> Path:
    return Path(os.environ.get("ACADEMUS_ARTIFACTS", home_dir() / "artifacts"))


def run_dir() -> Path:
    return Path(os.environ.get("ACADEMUS_RUN_DIR", home_dir() / "run"))


def redis_url_from_env() -> str | None:
    return os.environ.get("ACADEMUS_REDIS_URL") or os.environ.get("REDIS_URL")


@dataclass(frozen=True)
class CommonConfig:
    """Settings every service has. Env: ACADEMUS_<FIELD> upper-cased."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "acd"          # all Redis keys live under it
    host: str = "127.0.0.1"          # bind address
    port: int = 0                    # 0: the OS picks one
    advertise_host: str = ""         # address others dial; defaults to host
    metrics_port: int = 0            # Prometheus endpoint; 0: the OS picks one, -1: off
    grace_s: float = 10.0            # SIGTERM: how long in-flight work may take to finish

    def check(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"ACADEMUS_PORT={self.port} is not a port (0..65535)")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"ACADEMUS_METRICS_PORT={self.metrics_port} is not a port (-1..65535)")
        if self.grace_s < 0:
            raise ConfigError(f"ACADEMUS_GRACE_S={self.grace_s} must be >= 0")

    @property
    def advertised(self) -> str:
        return self.advertise_host or self.host


T = TypeVar("T", bound="CommonConfig")


@dataclass(frozen=True)
class GatewayConfig(CommonConfig):
    max_inputs: int = 64             # texts per request
    max_tokens: int = 256            # the teacher's max_seq_length
    max_text_chars: int = 100_000    # refused before tokenizing, truncation or not
    default_deadline_s: float = 30.0 # applied when the client set none (gRPC has no default)
    auth_cache_s: float = 5.0        # how long a verified key is trusted without asking Redis
    catalogue_refresh_s: float = 1.0

    def check(self) -> None:
        super().check()
        for name in ("max_inputs", "max_tokens", "max_text_chars"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ACADEMUS_{name.upper()}={getattr(self, name)} must be >= 1")
        if self.max_tokens > 512:
            raise ConfigError(f"ACADEMUS_MAX_TOKENS={self.max_tokens} exceeds the model's 512 positions")


@dataclass(frozen=True)
class SchedulerConfig(CommonConfig):
    scheduler_id: str = ""           # defaults to host:port
    policy: str = "fifo"             # fifo | padded (student and concat come with their issues)
    max_batch: int = 32              # padded: texts per batch
    max_delay_ms: float = 10.0       # padded: how long the oldest request may wait for the batch to fill
    queue_capacity: int = 1024       # admission bound: beyond it, RESOURCE_EXHAUSTED at once
    retry_pushback_ms: int = 50
    heartbeat_ttl_s: float = 5.0
    refresh_s: float = 1.0           # placement re-read interval (pub/sub makes it quicker)
    expire_interval_s: float = 0.05  # how often waiting jobs are checked against their deadlines

    def check(self) -> None:
        super().check()
        if self.queue_capacity < 1:
            raise ConfigError(f"ACADEMUS_QUEUE_CAPACITY={self.queue_capacity} must be >= 1")
        if self.policy not in ("fifo", "padded"):
            raise ConfigError(f"ACADEMUS_POLICY={self.policy!r} is not a policy (fifo, padded)")
        if self.max_batch < 1 or self.max_delay_ms < 0:
            raise ConfigError(f"ACADEMUS_MAX_BATCH={self.max_batch} must be >= 1 and "
                              f"ACADEMUS_MAX_DELAY_MS={self.max_delay_ms} >= 0")


@dataclass(frozen=True)
class WorkerConfig(CommonConfig):
    worker_id: str = ""
    device: str = "cpu"              # "cuda", "cuda:1", or "cpu"; GPU paths fall back to CPU
    torch_threads: int = 0           # 0: torch's default
    models: str = ""                 # comma-separated; empty: every model in the artifacts' models.json
    artifacts: str = field(default_factory=lambda: str(artifacts_dir()))
    resource_manager: str = ""       # host:port; empty: looked up in Redis
    heartbeat_ttl_s: float = 5.0

    def check(self) -> None:
        super().check()
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"ACADEMUS_DEVICE={self.device!r} must be 'cpu' or 'cuda[:N]'")
        if self.torch_threads < 0:
            raise ConfigError(f"ACADEMUS_TORCH_THREADS={self.torch_threads} must be >= 0")


@dataclass(frozen=True)
class ResourceManagerConfig(CommonConfig):
    reap_interval_s: float = 1.0     # how often dead workers are dropped from placements
    heartbeat_ttl_s: float = 5.0


def load(cls: type[T], env: dict[str, str] | None = None, **overrides) -> T:
    """Builds `cls` from defaults, then ACADEMUS_* variables, then explicit overrides; checks it."""
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    for f in fields(cls):
        raw = env.get(ENV_PREFIX + f.name.upper())
        if f.name == "redis_url":
            raw = raw or env.get("REDIS_URL")
        if raw is not None:
            values[f.name] = _parse(raw, f.type, f.name)
    values.update(overrides)
    config = cls(**values)
    config.check()
    return config


def _parse(raw: str, kind: object, name: str) -> object:
    try:
        if kind in (int, "int"):
            return int(raw)
        if kind in (float, "float"):
            return float(raw)
    except ValueError as e:
        raise ConfigError(f"ACADEMUS_{name.upper()}={raw!r} is not a number") from e
    return raw
