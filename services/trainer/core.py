"""Trainer core: runs the Manage API's background jobs, one at a time. No gRPC here.

JobRunner claims a job from Redis (shared/state/jobs.py: claim + lease in one step), runs its kind's handler
with the heavy work in a thread, writes progress as it goes, and finishes it succeeded or failed. A
handler that raises fails only its job: the runner goes on with the next. On a stop the running job is
handed back to the queue (and its training thread told to stop at its next step), so a restart loses
nothing; a trainer that dies without a stop has its jobs re-queued when their lease expires.

Handlers: AdapterJobs trains a tenant model's adapter + head (shared/training/adapters.py) and
publishes it (adapter store + registration, shared/training/onboarding.py); OverlayJobs builds a domain's PLOT
overlay (shared/training/plot_build.py) into the root table's directory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import redis.asyncio as aioredis

from academus.shared.models.plot.domains import FAILED as DOMAIN_FAILED
from academus.shared.models.plot.domains import READY as DOMAIN_READY
from academus.shared.models.plot.domains import DomainRegistry, overlay_dir, root_table
from academus.shared.runtime.config import TrainerConfig, artifacts_dir
from academus.shared.runtime.errors import NotFound
from academus.shared.runtime.logs import log_event
from academus.shared.state.jobs import FAILED, SUCCEEDED, Job, JobQueue
from academus.shared.state.keys import Keys
from academus.shared.state.tenants import FAILED as MODEL_FAILED
from academus.shared.state.tenants import TRAINING, TenantRegistry
from academus.shared.state.uploads import parse_corpus, parse_labelled_jsonl
from academus.shared.training.onboarding import publish_adapter, training_summary


class JobStopped(Exception):
    """The trainer is stopping: the job goes back to the queue, not to failed."""


class JobError(Exception):
    """A job that cannot succeed; its message is what the caller reads in GetJob."""


class Progress:
    """Thread-safe progress of one job: the work thread reports fractions, at most one Redis write a
    `min_interval_s` reaches the loop; reporting after a stop was asked raises JobStopped."""

    def __init__(self, queue: JobQueue, job_id: str, loop: asyncio.AbstractEventLoop, stopping: threading.Event,
                 min_interval_s: float = 0.5) -> None:
        self.queue, self.job_id, self.loop, self.stopping = queue, job_id, loop, stopping
        self.min_interval_s = min_interval_s
        self._last = float("-inf")
        self._pending: list[concurrent.futures.Future] = []

    def __call__(self, fraction: float) -> None:
        if self.stopping.is_set():
            raise JobStopped("the trainer is stopping")
        now = time.monotonic()
        if now - self._last >= self.min_interval_s:
            self._last = now
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(asyncio.run_coroutine_threadsafe(self._write(fraction), self.loop))

    async def flush(self) -> None:
        """Waits for the writes in flight, so none lands after the job's final status."""
        for future in self._pending:
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(future)

    async def _write(self, fraction: float) -> None:
        with contextlib.suppress(Exception):  # progress is advisory: a lost write costs nothing
            await self.queue.progress(self.job_id, fraction)


class Handler(Protocol):
    async def run(self, job: Job, progress: Progress) -> dict[str, Any]: ...

    async def failed(self, job: Job, message: str) -> None: ...


TEACHER_BASE = "minilm"   # the bundled bases all sit on the teacher


class Encoders:
    """Each base's encoder and tokenizer (the teacher's for the bundled bases), loaded once per device on first
    use and shared by every job (one job at a time). A user's model is keyed by its weights' digest too, so one
    removed and added again under its name is loaded anew. The teacher stays; of users' models the
    `max_user_bases` used last stay (a 12-layer one holds about 0.4 GB)."""

    def __init__(self, max_user_bases: int = 2) -> None:
        self._loaded: OrderedDict[tuple[str, str], tuple[Any, Any]] = OrderedDict()
        self.max_user_bases = max_user_bases

    async def get(self, device: str) -> Any:
        """The bundled teacher's encoder."""
        return (await self.base(device, TEACHER_BASE))[0]

    async def base(self, device: str, base: str) -> tuple[Any, Any]:
        from academus.shared.training.adapters import encoder_base

        source = await asyncio.to_thread(encoder_base, base)
        identity = await asyncio.to_thread(source.identity) if source.user else ""   # "": the teacher
        key = (device, identity)
        if key not in self._loaded:
            self._loaded[key] = await asyncio.to_thread(lambda: (source.encoder(device), source.tokenizer()))
        self._loaded.move_to_end(key)
        users = [k for k in self._loaded if k[1]]
        for stale in users[:max(0, len(users) - self.max_user_bases)]:
            del self._loaded[stale]
        return self._loaded[key]



def _upload(job: Job) -> bytes:
    path = Path(job.params.get("upload", ""))
    if not path.is_file():
        raise JobError(f"the job's upload {path} is gone (the uploads volume must be shared with the gateway)")
    return path.read_bytes()


def _drop_upload(job: Job) -> None:
    if job.params.get("upload"):
        Path(job.params["upload"]).unlink(missing_ok=True)


class AdapterJobs:
    def __init__(self, redis: aioredis.Redis, keys: Keys, config: TrainerConfig, encoders: Encoders) -> None:
        self.redis, self.keys, self.config, self.encoders = redis, keys, config, encoders
        self.registry = TenantRegistry(redis, keys)

    async def run(self, job: Job, progress: Progress) -> dict[str, Any]:
        from academus.shared.training.adapters import train_adapter

        params = job.params
        texts, labels = parse_labelled_jsonl(_upload(job), "data")
        await self._current(job)
        try:
            encoder, tokenizer = await self.encoders.base(self.config.device, params["base"])
        except ValueError as e:   # the base left the catalogue after the gateway took the job
            raise JobError(str(e)) from e
        progress(0.05)
        adapter, summary = await asyncio.to_thread(
            train_adapter, texts, labels, params["base"], self.config.adapter_rank, self.config.adapter_epochs,
            encoder=encoder, tokenizer=tokenizer, device=self.config.device, progress=False,
            domain=params.get("domain", ""),
            on_step=lambda done, total: progress(0.05 + 0.9 * done / total))
        model = await self._current(job)
        try:   # replaced only while still this job's: a model deleted meanwhile stays deleted
            published = await publish_adapter(self.redis, self.keys, job.tenant, params["model"], params["base"],
                                              adapter, domain=params.get("domain", ""), job=job.id,
                                              created=model.created)
        except NotFound as e:
            raise JobError(f"{e}: this training was discarded") from e
        _drop_upload(job)
        return {**published, **training_summary(summary)}

    async def _current(self, job: Job) -> Any:
        """The model this job trains, unless it was deleted or a newer job took it over meanwhile."""
        model = await self.registry.model(job.tenant, job.params["model"])
        if model is None or model.job != job.id:
            raise JobError(f"model {job.params['model']!r} was deleted or is being trained by a newer job: "
                           "this training was discarded")
        return model

    async def failed(self, job: Job, message: str) -> None:
        """A model never served (a new one) becomes failed; a served one keeps serving its version."""
        _drop_upload(job)
        model = await self.registry.model(job.tenant, job.params.get("model", ""))
        if model is not None and model.job == job.id and model.status == TRAINING:
            await self.registry.replace_job_model(job.tenant, replace(model, status=MODEL_FAILED, message=message),
                                                  job.id)


class OverlayJobs:
    def __init__(self, redis: aioredis.Redis, keys: Keys, config: TrainerConfig, encoders: Encoders,
                 table: Callable[[], Path | None] | None = None) -> None:
        self.config, self.encoders = config, encoders
        self.domains = DomainRegistry(redis, keys)
        self.table = table or (lambda: root_table(config.plot_dir))

    async def run(self, job: Job, progress: Progress) -> dict[str, Any]:
        from academus.shared.models.plot.layers import SplitBert
        from academus.shared.models.plot.table import ROOT, read_manifest
        from academus.shared.training.plot_build import BuildOptions, build

        name = job.params["domain"]
        table = self.table()
        if table is None:
            raise JobError("no PLOT root table is built, and a domain overlay extends one: build it first "
                           "(`academus plot build --corpus general`)")
        texts = parse_corpus(_upload(job), "corpus")
        await self._current(job)
        root = read_manifest(table / ROOT)
        layers = SplitBert((await self.encoders.get("cpu")).body, root.lower_layers)  # PLOT is built on the CPU
        progress(0.05)
        options = BuildOptions(model=root.model, lower_layers=root.lower_layers, domain=name,
                               top_percent=float(job.params["top_percent"]), ngram=root.ngram)
        summary = await asyncio.to_thread(build, texts, table, options, layers, {"source": "manage-api"})
        if not await self.domains.set_status(name, DOMAIN_READY):  # deleted while building: drop its files
            await asyncio.to_thread(_remove, overlay_dir(table, name))
            raise JobError(f"domain {name!r} was deleted while its overlay was built: the overlay was discarded")
        _drop_upload(job)
        return {**summary, "note": "plot services load the overlay when they (re)start"}

    async def _current(self, job: Job) -> None:
        domain = await self.domains.get(job.params["domain"])
        if domain is None or domain.job != job.id:
            raise JobError(f"domain {job.params['domain']!r} was deleted or is rebuilt by a newer job")

    async def failed(self, job: Job, message: str) -> None:
        _drop_upload(job)
        domain = await self.domains.get(job.params.get("domain", ""))
        if domain is not None and domain.job == job.id:
            await self.domains.set_status(domain.name, DOMAIN_FAILED, message)


class ModelJobs:
    """`academus models add|remove` for the Manage API: the trainer has the artifacts the workers read."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, artifacts: Path) -> None:
        self.registry, self.artifacts = TenantRegistry(redis, keys), artifacts

    async def run(self, job: Job, progress: Progress) -> dict[str, Any]:
        from academus.shared.models.user_models import ModelRefused, add_model, remove_model

        params = job.params
        try:
            if params["action"] == "add":
                return await asyncio.to_thread(add_model, self.artifacts, params["name"], Path(params["source"]),
                                               params.get("task", ""), params.get("pooling", ""))
            tenants = await self.registry.tenants_on(params["name"])
            await asyncio.to_thread(remove_model, self.artifacts, params["name"], tenants)
            return {"removed": params["name"]}
        except ModelRefused as e:
            raise JobError(str(e)) from e

    async def failed(self, job: Job, message: str) -> None:
        """A refused add wrote nothing and a refused remove removed nothing: no state to put back."""


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


class JobRunner:
    def __init__(self, queue: JobQueue, handlers: dict[str, Handler], trainer_id: str = "", lease_s: float = 30.0,
                 poll_s: float = 0.5, max_attempts: int = 3) -> None:
        self.queue, self.handlers, self.trainer_id = queue, handlers, trainer_id
        self.lease_s, self.poll_s, self.max_attempts = lease_s, poll_s, max_attempts
        self.stopping = threading.Event()
        self.current: Job | None = None
        self.done = 0

    async def run_forever(self) -> None:
        """Claims and runs jobs until cancelled; Redis being away only pauses it."""
        reaped_at = float("-inf")
        while True:
            try:
                if time.monotonic() - reaped_at >= self.lease_s:
                    reaped_at = time.monotonic()
                    if moved := await self.queue.requeue_orphans():
                        log_event("jobs_requeued", count=moved)
                if not await self.run_next():
                    await asyncio.sleep(self.poll_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log_event("job_loop_failed", logging.WARNING, error=repr(e))
                await asyncio.sleep(self.poll_s)

    async def run_next(self) -> bool:
        """Runs one queued job to its end; False when none was waiting."""
        job = await self.queue.claim(self.trainer_id, self.lease_s)
        if job is None:
            return False
        await self.run(job)
        return True

    async def run(self, job: Job) -> None:
        handler = self.handlers.get(job.kind)
        if handler is None or job.attempts > self.max_attempts:
            why = (f"unknown job kind {job.kind!r}" if handler is None else
                   f"gave up after {self.max_attempts} attempts: the trainer stopped during each")
            await self._fail(job, handler, why)
            return
        self.current = job
        renewer = asyncio.create_task(self._renew(job.id))
        log_event("job_started", id=job.id, kind=job.kind, tenant=job.tenant, target=job.target)
        progress = Progress(self.queue, job.id, asyncio.get_running_loop(), self.stopping)
        try:
            result = await handler.run(job, progress)
        except (asyncio.CancelledError, JobStopped):
            self.stopping.set()   # the work thread stops at its next step
            await progress.flush()
            await self.queue.release(job.id)
            log_event("job_released", id=job.id)
            raise asyncio.CancelledError() from None
        except Exception as e:
            await progress.flush()
            await self._fail(job, handler, str(e) or repr(e))
        else:
            await progress.flush()
            await self.queue.finish(job.id, SUCCEEDED, "done", result)
            log_event("job_succeeded", id=job.id, kind=job.kind)
        finally:
            renewer.cancel()
            self.current = None
            self.done += 1

    async def _fail(self, job: Job, handler: Handler | None, message: str) -> None:
        log_event("job_failed", logging.ERROR, id=job.id, kind=job.kind, error=message)
        if handler is not None:
            try:
                await handler.failed(job, message)
            except Exception as e:  # the job's own status must still be written
                log_event("job_cleanup_failed", logging.WARNING, id=job.id, error=repr(e))
        await self.queue.finish(job.id, FAILED, message)

    async def _renew(self, job_id: str) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await self.queue.renew(job_id, self.trainer_id, self.lease_s)
            except Exception as e:  # the next beat tries again; only a long outage loses the lease
                log_event("lease_renew_failed", logging.WARNING, id=job_id, error=repr(e))


def build_runner(redis: aioredis.Redis, keys: Keys, config: TrainerConfig, trainer_id: str = "") -> JobRunner:
    from academus.shared.state.jobs import ADAPTER, MODEL, OVERLAY

    encoders = Encoders(config.user_bases)
    handlers: dict[str, Handler] = {ADAPTER: AdapterJobs(redis, keys, config, encoders),
                                    OVERLAY: OverlayJobs(redis, keys, config, encoders),
                                    MODEL: ModelJobs(redis, keys, artifacts_dir())}
    return JobRunner(JobQueue(redis, keys, config.done_ttl_s), handlers, trainer_id or config.trainer_id,
                     config.lease_s, config.poll_s, config.max_attempts)
