"""One typed config per service; every environment override is read here and nowhere else."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TypeVar

from academus.shared.runtime.slices import MAX_SLICE_US, MIN_SLICE_US

ENV_PREFIX = "ACADEMUS_"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")   # the spellings a boolean setting takes


class ConfigError(ValueError):
    """A setting is out of range; the message names the variable and the value."""


def home_dir() -> Path:
    return Path(os.environ.get("ACADEMUS_HOME", Path.cwd() / ".academus"))


def artifacts_dir() -> Path:
    return Path(os.environ.get("ACADEMUS_ARTIFACTS", home_dir() / "artifacts"))


def run_dir() -> Path:
    return Path(os.environ.get("ACADEMUS_RUN_DIR", home_dir() / "run"))


def split_names(joined: str) -> tuple[str, ...]:
    """Comma-joined model names (a setting such as ACADEMUS_MODELS, or a registration in Redis); empty: none."""
    return tuple(m for m in joined.split(",") if m)


def redis_url_from_env() -> str | None:
    return os.environ.get("ACADEMUS_REDIS_URL") or os.environ.get("REDIS_URL")


def policy_override() -> str:
    """ACADEMUS_POLICY when set: `academus up` then runs one deployment of it for every model."""
    return os.environ.get("ACADEMUS_POLICY", "")


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
    gc_freeze: bool = True           # start-up's objects leave the cyclic GC once serving (off: the ablation)
    hop_streams: bool = True         # calls to the next hop ride one multiplexed stream a peer (off: a call each)
    frame_batches: bool = True       # frames waiting for a stream together ride one message (off: one each)
    local_plane: bool = True         # hops to a peer on this node ride a Unix socket (runtime/local_plane.py); off:
                                     # gRPC streams for every hop (the ablation); needs hop_streams
    trace_ratio: float = 0.01        # share of requests traced, drawn where a request enters without a trace
                                     # context: traced at every hop or none (runtime/tracing.py); OTEL_TRACES_SAMPLER
                                     # leaves it to the SDK
    socket_dir: str = ""             # the local plane's sockets; empty: academus-<uid> in the temporary folder
    hop_slice_us: int = 0            # the serving threads' EEVDF slice, 100..100000 (runtime/slices.py); 0: kernel's
    node: str = ""                   # the machine it runs on: a worker's groups stay within its node, and a scheduler
                                     # given one dispatches to its node's workers only; empty: one unnamed node

    def check(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"ACADEMUS_PORT={self.port} is not a port (0..65535)")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"ACADEMUS_METRICS_PORT={self.metrics_port} is not a port (-1..65535)")
        if self.grace_s < 0:
            raise ConfigError(f"ACADEMUS_GRACE_S={self.grace_s} must be >= 0")
        if not 0 <= self.trace_ratio <= 1:
            raise ConfigError(f"ACADEMUS_TRACE_RATIO={self.trace_ratio} must be in 0..1")
        if self.hop_slice_us and not MIN_SLICE_US <= self.hop_slice_us <= MAX_SLICE_US:
            raise ConfigError(f"ACADEMUS_HOP_SLICE_US={self.hop_slice_us} must be 0 (the kernel's default) or in "
                              f"{MIN_SLICE_US}..{MAX_SLICE_US}")

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
    honour_pushback: bool = True     # a scheduler that refused for a full queue is sent nothing until its hint passes
    tenant_rate: float = 100.0       # a new tenant's quota: requests per second (token bucket refill)
    tenant_burst: int = 200          # ... and bucket size: requests allowed at once after a quiet spell
    max_upload_bytes: int = 8 * 1024 * 1024  # Manage API: one corpus or labelled-data upload
    min_examples: int = 8            # Manage API: labelled examples a tenant model needs (one is held out)
    min_corpus_lines: int = 20       # Manage API: a domain corpus this small gives no useful overlay (HMI §4)
    max_corpus_lines: int = 1_000_000
    uploads_dir: str = ""            # where accepted uploads wait for the trainer; empty: <artifacts>/uploads
    plot_dir: str = ""               # the root PLOT table domains extend; empty: the one the mesh serves
    own_port: int = 0                # a port only this process binds besides the shared one (`up --gateways G`:
                                     # health checks and a load generator reach each gateway); 0: none

    def check(self) -> None:
        super().check()
        if not 1 <= self.max_upload_bytes <= 60 * 1024 * 1024:
            raise ConfigError(f"ACADEMUS_MAX_UPLOAD_BYTES={self.max_upload_bytes} must be in 1..62914560 "
                              "(an upload stays under the 64 MiB message limit)")
        if self.min_examples < 3 or not 1 <= self.min_corpus_lines <= self.max_corpus_lines:
            raise ConfigError(f"ACADEMUS_MIN_EXAMPLES={self.min_examples} must be >= 3 (two to train, one to "
                              f"validate) and 1 <= ACADEMUS_MIN_CORPUS_LINES={self.min_corpus_lines} <= "
                              f"ACADEMUS_MAX_CORPUS_LINES={self.max_corpus_lines}")
        if self.tenant_rate <= 0 or self.tenant_burst < 1:
            raise ConfigError(f"ACADEMUS_TENANT_RATE={self.tenant_rate} must be > 0 and "
                              f"ACADEMUS_TENANT_BURST={self.tenant_burst} >= 1")
        for name in ("max_inputs", "max_tokens", "max_text_chars"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ACADEMUS_{name.upper()}={getattr(self, name)} must be >= 1")
        if self.max_tokens > 512:
            raise ConfigError(f"ACADEMUS_MAX_TOKENS={self.max_tokens} exceeds the model's 512 positions")
        if not 0 <= self.own_port <= 65535:
            raise ConfigError(f"ACADEMUS_OWN_PORT={self.own_port} is not a port (0..65535)")


# concat-slotted / -fcfs / -sjf / -edf: `concat` with ACADEMUS_CONCAT_SLOTTED / _SELECTION fixed by the name, so
# that the variants can run as deployments side by side (the gateway routes by policy name).
POLICY_NAMES = ("fifo", "padded", "student", "concat", "concat-slotted", "concat-fcfs", "concat-sjf", "concat-edf",
                "bucketed")
CONCAT_SELECTIONS = ("das", "fcfs", "sjf", "edf")
COMPUTE_SCHEDS = ("idle", "batch", "normal")


@dataclass(frozen=True)
class SchedulerConfig(CommonConfig):
    scheduler_id: str = ""           # defaults to host:port
    policy: str = "fifo"             # one of POLICY_NAMES: this deployment's dispatch policy
    models: str = ""                 # comma-separated models this deployment serves; empty: every placed model
    max_batch: int = 32              # padded: texts per batch
    max_delay_ms: float = 10.0       # padded: how long the oldest request may wait for the batch to fill
    max_merge: int = 0               # student: samples per buffer element; 0: the profiled value, else 4
    overload_merge: int = 0          # student: the bound while the buffer is full (an element a group); 0: twice
                                     # max_merge; max_merge itself: the paper's buffer exactly (the ablation)
    bin_width: int = 8               # student: tokens per length bin (App. B.4.2)
    max_length: int = 128            # student: the binned length range; longer samples share the last bin
    concat_row_length: int = 128     # concat: L, tokens a row (TCB §4)
    concat_rows: int = 8             # concat: rows a batch (B)
    concat_eta: float = 0.5          # concat: DAS η (utility-dominant share); q = 1 − η (TCB §5.2)
    concat_selection: str = "das"    # concat: das | fcfs | sjf | edf (the row-fill baselines of TCB §6.2.2)
    concat_slotted: bool = False     # concat: slotted ConcatBatching (Alg. 2) instead of pure
    concat_oversize: str = "alone"   # concat: a text over L runs alone in its own row, or is refused (reject)
    batch_overhead_ms: float = 2.0   # concat/bucketed latency model: fixed cost of one batch
    token_us: float = 20.0           # concat/bucketed latency model: cost per computed token at start (learned)
    load_report_s: float = 0.1       # how often the load signals the resource manager adapts on are written
    queue_capacity: int = 1024       # admission bound: beyond it, RESOURCE_EXHAUSTED at once
    retry_pushback_ms: int = 50
    heartbeat_ttl_s: float = 5.0
    refresh_s: float = 1.0           # placement re-read interval (pub/sub makes it quicker)
    expire_interval_s: float = 0.05  # how often waiting jobs are checked against their deadlines
    plot_prefetch: bool = True       # PLOT models: look waiting requests up in a plot service (HMI §6.1)
    drop_doomed: bool = True         # a job that waited is not started when its batch cannot finish in time
    send_ahead: bool = False         # student: a busy group is sent its next element while it runs one
    shards: int = 1                  # scheduler processes splitting this deployment's groups (a core each)
    shard: int = 0                   # this one's index among them: it takes the shard-th run of each model's groups

    def check(self) -> None:
        super().check()
        if self.queue_capacity < 1:
            raise ConfigError(f"ACADEMUS_QUEUE_CAPACITY={self.queue_capacity} must be >= 1")
        if self.policy not in POLICY_NAMES:
            raise ConfigError(f"ACADEMUS_POLICY={self.policy!r} is not a policy ({', '.join(POLICY_NAMES)})")
        if self.max_merge < 0 or self.overload_merge < 0 or self.bin_width < 1 or self.max_length < self.bin_width:
            raise ConfigError(f"ACADEMUS_MAX_MERGE={self.max_merge} and ACADEMUS_OVERLOAD_MERGE={self.overload_merge} "
                              f"must be >= 0, ACADEMUS_BIN_WIDTH="
                              f"{self.bin_width} >= 1 and ACADEMUS_MAX_LENGTH={self.max_length} >= the bin width")
        if self.max_batch < 1 or self.max_delay_ms < 0:
            raise ConfigError(f"ACADEMUS_MAX_BATCH={self.max_batch} must be >= 1 and "
                              f"ACADEMUS_MAX_DELAY_MS={self.max_delay_ms} >= 0")
        if not 0 <= self.shard < self.shards:
            raise ConfigError(f"ACADEMUS_SHARD={self.shard} must be >= 0 and < ACADEMUS_SHARDS={self.shards}")
        self._check_concat()

    def _check_concat(self) -> None:
        if not 1 <= self.concat_row_length <= 512 or not 1 <= self.concat_rows <= 1024:
            raise ConfigError(f"ACADEMUS_CONCAT_ROW_LENGTH={self.concat_row_length} must be in 1..512 (the model's "
                              f"positions) and ACADEMUS_CONCAT_ROWS={self.concat_rows} in 1..1024")
        if not 0 < self.concat_eta < 1:
            raise ConfigError(f"ACADEMUS_CONCAT_ETA={self.concat_eta} must be in (0, 1) (q = 1 - eta)")
        if self.concat_selection not in CONCAT_SELECTIONS or self.concat_oversize not in ("alone", "reject"):
            raise ConfigError(f"ACADEMUS_CONCAT_SELECTION={self.concat_selection!r} must be one of "
                              f"{', '.join(CONCAT_SELECTIONS)} and ACADEMUS_CONCAT_OVERSIZE="
                              f"{self.concat_oversize!r} alone|reject")
        if self.batch_overhead_ms < 0 or self.token_us <= 0:
            raise ConfigError(f"ACADEMUS_BATCH_OVERHEAD_MS={self.batch_overhead_ms} must be >= 0 and "
                              f"ACADEMUS_TOKEN_US={self.token_us} > 0")


@dataclass(frozen=True)
class WorkerConfig(CommonConfig):
    worker_id: str = ""
    device: str = "cpu"              # "cuda", "cuda:1", or "cpu"; GPU paths fall back to CPU
    torch_threads: int = 0           # 0: torch's default
    instances: int = 0               # student instances run at once on this device; 0: profiled (1 without)
    profile: str = "auto"            # grid-search instances and max_merge at start (App. B.4.1): true|false|auto,
                                     # auto on a CUDA device (where merges cost little latency) and not on CPU
    models: str = ""                 # comma-separated; empty: every model in the artifacts' models.json
    artifacts: str = field(default_factory=lambda: str(artifacts_dir()))
    resource_manager: str = ""       # host:port; empty: looked up in Redis
    heartbeat_ttl_s: float = 5.0
    packed_attention: str = "sdpa"   # packed batches: sdpa (own layers, real tokens only) | hf (HF layers, 4-D mask)
    traced_layers: bool = True       # transformer layers as TorchScript graphs (off: eager forwards, the ablation)
    compute_sched: str = "normal"    # Linux policy of the compute threads: normal, idle (any serving thread
                                     # preempts them at once), or batch
    adapter_store: str = ""          # host:port; empty: looked up in Redis
    adapter_cache_bytes: int = 256 << 20   # tenant adapters kept on the device (LRU, HMI §6.2)
    adapter_prefetch: bool = True    # later layers stream in while the batch computes (off: the ablation)
    adapter_batched: bool = True     # one bmm for all tenants of a batch (off: per tenant, the ablation)
    adapter_fetch_batch: int = 32    # misses' pieces of one layer fetched in one GetMany (1: one Get a piece)
    adapter_host_bytes: int = 2 << 30  # whole adapters kept in host memory (HMI §6.2); 0: misses go to the store
    adapter_warm_s: float = 10.0     # how often served tenant models are loaded into host memory; 0: on first use

    def check(self) -> None:
        super().check()
        if not 1 <= self.adapter_fetch_batch <= 256:
            raise ConfigError(f"ACADEMUS_ADAPTER_FETCH_BATCH={self.adapter_fetch_batch} must be in 1..256 (and within "
                              "the adapter store's ACADEMUS_MAX_GET_MANY)")
        if self.adapter_host_bytes < 0 or self.adapter_warm_s < 0:
            raise ConfigError(f"ACADEMUS_ADAPTER_HOST_BYTES={self.adapter_host_bytes} and ACADEMUS_ADAPTER_WARM_S="
                              f"{self.adapter_warm_s} must be >= 0")
        if self.packed_attention not in ("sdpa", "hf"):
            raise ConfigError(f"ACADEMUS_PACKED_ATTENTION={self.packed_attention!r} must be sdpa|hf")
        if self.compute_sched not in COMPUTE_SCHEDS:
            raise ConfigError(f"ACADEMUS_COMPUTE_SCHED={self.compute_sched!r} must be {'|'.join(COMPUTE_SCHEDS)}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"ACADEMUS_DEVICE={self.device!r} must be 'cpu' or 'cuda[:N]'")
        if self.torch_threads < 0 or self.instances < 0:
            raise ConfigError(f"ACADEMUS_TORCH_THREADS={self.torch_threads} and ACADEMUS_INSTANCES="
                              f"{self.instances} must be >= 0")
        if self.profile.lower() not in (*TRUE, *FALSE, "auto"):
            raise ConfigError(f"ACADEMUS_PROFILE={self.profile!r} must be true|false|auto")

    def profiles(self, cuda: bool) -> bool:
        """Whether the worker runs the start-up profile on its device (auto: on a GPU only)."""
        mode = self.profile.lower()
        return mode in TRUE or (mode == "auto" and cuda)


@dataclass(frozen=True)
class ResourceManagerConfig(CommonConfig):
    reap_interval_s: float = 1.0     # how often dead workers are dropped from placements
    heartbeat_ttl_s: float = 5.0
    adapt_interval_s: float = 0.2    # how often the schedulers' load signals are read
    adapt_window_s: float = 120.0    # quiet time before one student is added back (App. B.4.1: 2 minutes)
    adapt_cooldown_s: float = 0.2    # after a change, at least this long before the next (and the groups re-formed)
    student_ceiling: str = "max"     # max: up to every trained student; best: up to the best-pruned k
    mps: str = "auto"                # auto: start the MPS control daemon when GPUs exist; off: never

    def check(self) -> None:
        super().check()
        if self.student_ceiling not in ("max", "best") or self.mps not in ("auto", "off"):
            raise ConfigError(f"ACADEMUS_STUDENT_CEILING={self.student_ceiling!r} must be max|best and "
                              f"ACADEMUS_MPS={self.mps!r} auto|off")
        if self.adapt_interval_s <= 0 or self.adapt_window_s < 0 or self.adapt_cooldown_s < 0:
            raise ConfigError("ACADEMUS_ADAPT_INTERVAL_S must be > 0, ACADEMUS_ADAPT_WINDOW_S and "
                              "ACADEMUS_ADAPT_COOLDOWN_S >= 0")


@dataclass(frozen=True)
class PlotConfig(CommonConfig):
    plot_dir: str = ""               # root/ + domains/<name>/; empty: <artifacts>/plot/<model>-k<lower_layers>
    model: str = "minilm"            # the table must have been built for this model ...
    lower_layers: int = 3            # ... and this K, or the service refuses to start
    domains: str = "*"               # comma-separated overlays to load; "*": every one built; "": none
    verify: int = 1                  # 1: check every file's sha256 at start (reads the whole table); 0: shapes only
    max_tokens: int = 32768          # tokens per Lookup (all sequences); the reply is 2·hidden bytes a token
    plot_id: str = ""                # its id in Redis (acd:plot:<id>); defaults to host:port
    heartbeat_ttl_s: float = 5.0

    def check(self) -> None:
        super().check()
        if self.lower_layers < 1:
            raise ConfigError(f"ACADEMUS_LOWER_LAYERS={self.lower_layers} must be >= 1")
        if self.verify not in (0, 1):
            raise ConfigError(f"ACADEMUS_VERIFY={self.verify} must be 0 or 1")
        if not 1 <= self.max_tokens <= 65536:
            raise ConfigError(f"ACADEMUS_MAX_TOKENS={self.max_tokens} must be in 1..65536 (replies stay under "
                              f"the 64 MiB message limit)")
        if self.heartbeat_ttl_s < 1:
            raise ConfigError(f"ACADEMUS_HEARTBEAT_TTL_S={self.heartbeat_ttl_s} must be >= 1 (Redis TTLs are seconds)")

    @property
    def table_dir(self) -> Path:
        default = artifacts_dir() / "plot" / f"{self.model}-k{self.lower_layers}"
        return Path(self.plot_dir) if self.plot_dir else default

    @property
    def domain_list(self) -> list[str] | None:
        """None: every overlay found on disk."""
        if self.domains.strip() == "*":
            return None
        return [d.strip() for d in self.domains.split(",") if d.strip()]


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
    if kind in (bool, "bool"):
        if raw.lower() not in (*TRUE, *FALSE):
            raise ConfigError(f"ACADEMUS_{name.upper()}={raw!r} is not a boolean (true/false)")
        return raw.lower() in TRUE
    try:
        if kind in (int, "int"):
            return int(raw)
        if kind in (float, "float"):
            return float(raw)
    except ValueError as e:
        raise ConfigError(f"ACADEMUS_{name.upper()}={raw!r} is not a number") from e
    return raw


@dataclass(frozen=True)
class AdapterStoreConfig(CommonConfig):
    adapter_dir: str = ""            # weights root (<tenant>/<name>/v<N>.safetensors); empty: <artifacts>/adapters
    max_adapter_bytes: int = 8 * 1024 * 1024  # one adapter's safetensors file
    cache_bytes: int = 64 * 1024 * 1024       # LRU of read files, so layer-by-layer gets skip the disk
    heartbeat_ttl_s: float = 5.0     # TTL of the address at acd:adapter_store
    max_get_many: int = 64           # pieces one GetMany may ask for

    def check(self) -> None:
        super().check()
        if not 1 <= self.max_get_many <= 256:
            raise ConfigError(f"ACADEMUS_MAX_GET_MANY={self.max_get_many} must be in 1..256 (pieces a GetMany)")
        if not 1 <= self.max_adapter_bytes <= 60 * 1024 * 1024:
            raise ConfigError(f"ACADEMUS_MAX_ADAPTER_BYTES={self.max_adapter_bytes} must be in 1..62914560 "
                              f"(a Put stays under the 64 MiB message limit)")
        if self.cache_bytes < 0:
            raise ConfigError(f"ACADEMUS_CACHE_BYTES={self.cache_bytes} must be >= 0 (0: no cache)")
        if self.heartbeat_ttl_s < 1:
            raise ConfigError(f"ACADEMUS_HEARTBEAT_TTL_S={self.heartbeat_ttl_s} must be >= 1 (Redis TTLs are seconds)")

    @property
    def store_dir(self) -> Path:
        return Path(self.adapter_dir) if self.adapter_dir else artifacts_dir() / "adapters"


@dataclass(frozen=True)
class TrainerConfig(CommonConfig):
    trainer_id: str = ""             # its name in job leases; defaults to host:port
    device: str = "cpu"              # "cuda", "cuda:1", or "cpu"
    torch_threads: int = 0           # 0: torch's default
    poll_s: float = 0.5              # how often an idle trainer looks for a queued job
    lease_s: float = 30.0            # a running job's lease; renewed every third of it
    max_attempts: int = 3            # claims of one job (trainer crashes) before it is failed
    done_ttl_s: float = 7 * 86400.0  # how long a finished job's record stays readable
    adapter_rank: int = 16           # tenant adapters' bottleneck width
    adapter_epochs: int = 8
    plot_dir: str = ""               # the root PLOT table overlays extend; empty: the one the mesh serves
    uploads_dir: str = ""            # where the gateway leaves uploads; empty: <artifacts>/uploads

    def check(self) -> None:
        super().check()
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"ACADEMUS_DEVICE={self.device!r} must be 'cpu' or 'cuda[:N]'")
        if self.poll_s <= 0 or self.lease_s < 3 or self.max_attempts < 1:
            raise ConfigError(f"ACADEMUS_POLL_S={self.poll_s} must be > 0, ACADEMUS_LEASE_S={self.lease_s} >= 3 "
                              f"and ACADEMUS_MAX_ATTEMPTS={self.max_attempts} >= 1")
        if self.adapter_rank < 1 or self.adapter_epochs < 1 or self.torch_threads < 0:
            raise ConfigError(f"ACADEMUS_ADAPTER_RANK={self.adapter_rank} and ACADEMUS_ADAPTER_EPOCHS="
                              f"{self.adapter_epochs} must be >= 1, ACADEMUS_TORCH_THREADS >= 0")


def uploads_path(uploads_dir: str) -> Path:
    """Where the gateway leaves Manage API uploads for the trainer (both mount the artifacts volume)."""
    return Path(uploads_dir) if uploads_dir else artifacts_dir() / "uploads"
