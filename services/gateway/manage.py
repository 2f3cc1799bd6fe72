"""Gateway core of the Manage API (HMI §4 manage requests): domains and tenant models. No gRPC here.

Every create/update validates its upload completely (size, UTF-8, format, labels) before anything is
written, so a bad upload is an INVALID_ARGUMENT naming the problem and never a failed job. Accepted
work is a Job for the trainer service: the upload is written under the shared artifacts volume
(`uploads/<job id>.*`, see shared/state/uploads.py for why not Redis), then the job is queued.

Authorization: domains are shared by every tenant, so creating and deleting them takes the admin key
(listing them does not: tenants choose a domain for their models). Tenant models and their jobs are
looked up under the caller's own tenant only: another tenant's model or job is NOT_FOUND, exactly as a
name nobody uses, so its existence never leaks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import redis.asyncio as aioredis

from academus.services.gateway.core import Authenticator, Principal
from academus.shared.models.plot.domains import READY as DOMAIN_READY
from academus.shared.models.plot.domains import Domain, DomainRegistry, root_table
from academus.shared.runtime.config import GatewayConfig, uploads_path
from academus.shared.runtime.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from academus.shared.state.catalogue import ADAPTER_BASES, MODEL_NAME, PLOT_BASES, ModelSpec, adapter_base
from academus.shared.state.jobs import ADAPTER, MODEL, OVERLAY, Job, JobQueue
from academus.shared.state.keys import Keys
from academus.shared.state.tenants import (
    FAILED,
    TRAINING,
    Quotas,
    TenantModel,
    TenantRegistry,
    check_name,
    gateway_quotas,
)
from academus.shared.state.uploads import parse_corpus, parse_labelled_jsonl, write_upload

ADMIN = "admin"
DEFAULT_TOP_PERCENT = 10.0


class Manage:
    def __init__(self, config: GatewayConfig, redis: aioredis.Redis, keys: Keys, auth: Authenticator,
                 table: Callable[[], Path | None] | None = None, quotas: Quotas | None = None) -> None:
        self.config, self.redis, self.keys, self.auth = config, redis, keys, auth
        self.registry = TenantRegistry(redis, keys, rate=config.tenant_rate, burst=config.tenant_burst)
        self.jobs, self.domains = JobQueue(redis, keys), DomainRegistry(redis, keys)
        self.quotas = quotas or gateway_quotas(config, redis, keys)   # the Inference API's, when it has them
        self.uploads = uploads_path(config.uploads_dir)
        self.table = table or (lambda: root_table(config.plot_dir))

    async def authenticate(self, api_key: str | None, peer: str = "") -> Principal:
        """The caller, who also spends a request of its quota (Manage calls are cheap, uploads are not)."""
        principal = await self.auth.authenticate(api_key, peer)
        await self.quotas.take(principal.tenant)
        return principal

    # --- domains ---------------------------------------------------------------------------------

    async def create_domain(self, caller: Principal, name: str, corpus: bytes, top_percent: float) -> Job:
        self._admin(caller, "create a domain")
        check_name("name", name)
        top_percent = top_percent or DEFAULT_TOP_PERCENT
        if not 0 < top_percent <= 100:
            raise InvalidArgument(f"top_percent={top_percent} is invalid: it must be in (0, 100] (0: "
                                  f"{DEFAULT_TOP_PERCENT})")
        lines = await self._corpus_lines(corpus)
        if self.table() is None:
            raise FailedPrecondition("no PLOT root table is built, and a domain overlay extends one: build it "
                                     "first (`academus plot build --corpus general`)")
        job = Job(OVERLAY, caller.tenant, name, {"domain": name, "top_percent": top_percent})
        await self.domains.create(Domain(name, top_percent=top_percent, job=job.id, lines=lines))
        try:
            path = await asyncio.to_thread(write_upload, self.uploads, f"{job.id}.txt", corpus)
            return await self.jobs.submit(replace(job, params={**job.params, "upload": str(path)}))
        except BaseException:
            await self.domains.delete(name, None)
            raise

    async def add_model(self, caller: Principal, name: str, source: str, task: str, pooling: str) -> Job:
        """Queues `academus models add` for the trainer, which has the artifacts and torch; what needs the
        directory is checked there, and a refusal fails the job naming the file."""
        self._admin(caller, "add a model")
        self._model_name(name)
        if not source.startswith("/"):
            raise InvalidArgument(f"source={source[:200]!r} must be an absolute path of a directory the trainer "
                                  "can read (a mounted volume)")
        for field, value, allowed in (("task", task, ("", "embed", "classify")),
                                      ("pooling", pooling, ("", "mean", "cls"))):
            if value not in allowed:
                raise InvalidArgument(f"{field}={value[:40]!r} is not one of {', '.join(repr(a) for a in allowed)}")
        return await self.jobs.submit(Job(MODEL, caller.tenant, name, {"action": "add", "name": name,
                                                                        "source": source, "task": task,
                                                                        "pooling": pooling}))

    async def remove_model(self, caller: Principal, name: str) -> Job:
        """Queues `academus models remove`: the trainer refuses it while heads, student groups or tenant models
        depend on the model."""
        self._admin(caller, "remove a model")
        self._model_name(name)
        return await self.jobs.submit(Job(MODEL, caller.tenant, name, {"action": "remove", "name": name}))

    @staticmethod
    def _model_name(name: str) -> None:
        if not MODEL_NAME.match(name):
            raise InvalidArgument(f"name={name[:80]!r} must be 1-63 of a-z 0-9 . _ -, starting with a letter or "
                                  "digit")

    async def list_domains(self, caller: Principal) -> list[Domain]:
        return await self.domains.list()

    async def delete_domain(self, caller: Principal, name: str) -> None:
        self._admin(caller, "delete a domain")
        domain = await self.domains.get(name)
        if domain is None:
            raise NotFound(f"domain {name!r} not found")
        if await self._busy(domain.job):
            raise FailedPrecondition(f"domain {name!r} is being built (job {domain.job}); delete it when the job "
                                     "has finished")
        # Marked before the users are read, and CreateTenantModel reads the mark after it registers its
        # model: of a creation and a deletion at once, one always sees the other.
        if not await self.domains.mark_deleting(name):
            raise NotFound(f"domain {name!r} not found")
        users = sorted(f"{tenant}/{model.name}" for tenant, model in await self.registry.all_models()
                       if model.domain == name)
        if users:  # their adapters were trained on this overlay's states, and their requests look it up
            await self.domains.mark_deleting(name, False)
            raise FailedPrecondition(f"domain {name!r} is used by {len(users)} tenant model(s) "
                                     f"({', '.join(users[:5])}{', ...' if len(users) > 5 else ''}); "
                                     "delete them first")
        await self.domains.delete(name, self.table())

    async def _corpus_lines(self, corpus: bytes) -> int:
        self._check_size("corpus", corpus)
        try:  # up to max_upload_bytes: parsed off the event loop, so Infer calls keep flowing
            lines = len(await asyncio.to_thread(parse_corpus, corpus, "corpus"))
        except ValueError as e:
            raise InvalidArgument(str(e)) from e
        low, high = self.config.min_corpus_lines, self.config.max_corpus_lines
        if not low <= lines <= high:
            raise InvalidArgument(f"corpus has {lines} non-blank lines; a domain needs {low} to {high} "
                                  "(one sentence a line)")
        return lines

    # --- tenant models ---------------------------------------------------------------------------

    async def create_tenant_model(self, caller: Principal, name: str, base: str, domain: str, data: bytes) -> Job:
        tenant = self._tenant(caller)
        check_name("name", name)
        await self._check_base(base)
        if domain:
            await self._ready_domain(domain)
        self._check_plot(base, domain)
        labels = await self._labels(data)
        await self.registry.tenant(tenant)
        if await self.redis.hexists(self.keys.models(), name):
            raise InvalidArgument(f"name={name!r} is invalid: a served model has that name")
        existing = await self.registry.model(tenant, name)
        if existing is not None and existing.status != FAILED:  # a failed creation may be retried
            raise AlreadyExists(f"model {name!r} already exists: update it (UpdateTenantModel) or delete it")
        job = Job(ADAPTER, tenant, name, {"model": name, "base": base, "domain": domain, "create": True})
        model = TenantModel(name=name, base=base, adapter=name, version=1, labels=labels, status=TRAINING,
                            domain=domain, job=job.id)
        return await self._start(job, data, model)

    async def update_tenant_model(self, caller: Principal, name: str, data: bytes) -> Job:
        tenant = self._tenant(caller)
        model = await self._own_model(tenant, name)
        if await self._busy(model.job):
            raise FailedPrecondition(f"model {name!r} is being trained (job {model.job}); update it when the "
                                     "job has finished")
        await self._labels(data)
        job = Job(ADAPTER, tenant, name, {"model": name, "base": model.base, "domain": model.domain,
                                          "create": False})
        # A served model keeps serving its version until the job succeeds; a failed one is retrained.
        status = TRAINING if model.status == FAILED else model.status
        return await self._start(job, data, replace(model, job=job.id, status=status, message=""), model)

    async def list_tenant_models(self, caller: Principal) -> list[TenantModel]:
        return await self.registry.models(self._tenant(caller))

    async def delete_tenant_model(self, caller: Principal, name: str) -> TenantModel:
        """The registration goes at once: nothing serves it after, and a job still training it throws its
        result away. Its adapter versions stay in the store: deleting them would restart the store's
        version numbers, and a re-created model's version 1 could then hit workers' cached old weights."""
        tenant = self._tenant(caller)
        model = await self._own_model(tenant, name)
        await self.registry.delete_model(tenant, name)
        return model

    async def _start(self, job: Job, data: bytes, model: TenantModel, before: TenantModel | None = None) -> Job:
        """Upload, then the model's record (so List shows it), then the job; undone if the queue fails."""
        path = await asyncio.to_thread(write_upload, self.uploads, f"{job.id}.jsonl", data)
        job = replace(job, params={**job.params, "upload": str(path)})
        await self.registry.register_model(job.tenant, model)
        try:
            if before is None and model.domain:  # DeleteDomain may have read the users before the register
                await self._ready_domain(model.domain)
            return await self.jobs.submit(job)
        except BaseException:
            if before is None:
                await self.registry.delete_model(job.tenant, model.name)
            else:
                await self.registry.register_model(job.tenant, before)
            path.unlink(missing_ok=True)
            raise

    async def _labels(self, data: bytes) -> list[str]:
        """The distinct labels of a valid labelled-data upload (the head's classes, sorted)."""
        self._check_size("data", data)
        try:
            texts, labels = await asyncio.to_thread(parse_labelled_jsonl, data, "data")
        except ValueError as e:
            raise InvalidArgument(str(e)) from e
        if len(texts) < self.config.min_examples:
            raise InvalidArgument(f"data has {len(texts)} examples; a tenant model needs at least "
                                  f"{self.config.min_examples} (one in ten is held out for validation)")
        return sorted(set(labels))

    async def _own_model(self, tenant: str, name: str) -> TenantModel:
        model = await self.registry.model(tenant, name)
        if model is None:
            raise NotFound(f"model {name[:80]!r} not found")
        return model

    async def _check_base(self, base: str) -> None:
        """A bundled base, or a served user's embedding model (`academus models add`)."""
        if base in ADAPTER_BASES:
            return
        specs = [ModelSpec.from_json(raw) for raw in (await self.redis.hgetall(self.keys.models())).values()]
        bases = sorted({spec.name for spec in specs if adapter_base(spec)} | ADAPTER_BASES)
        if base not in bases:
            raise InvalidArgument(f"base={base[:80]!r} is not a base tenant models can be trained on; "
                                  f"served bases: {', '.join(bases)} (a user's embedding model is one once served)")

    def _check_plot(self, base: str, domain: str) -> None:
        """A domain is a PLOT overlay: it needs a PLOT base, and a PLOT base needs the root table."""
        if base not in PLOT_BASES:
            if domain:
                raise InvalidArgument(f"domain={domain!r} needs a PLOT base ({', '.join(sorted(PLOT_BASES))}); "
                                      f"base {base!r} computes its lower layers")
        elif self.table() is None:
            raise FailedPrecondition(f"base={base!r} looks its lower layers up in a PLOT table, and none is "
                                     "built: run `academus plot build` first")

    async def _ready_domain(self, name: str) -> None:
        domain = await self.domains.get(name)
        if domain is None:
            raise NotFound(f"domain {name[:80]!r} not found")
        if domain.status != DOMAIN_READY:
            raise FailedPrecondition(f"domain {name!r} is {domain.status}, not ready")
        if domain.deleting:
            raise FailedPrecondition(f"domain {name!r} is being deleted")

    # --- jobs and checks -------------------------------------------------------------------------

    async def get_job(self, caller: Principal, job_id: str) -> Job:
        job = await self.jobs.get(job_id) if job_id else None
        if job is None or job.tenant != caller.tenant:
            raise NotFound(f"job {job_id[:80]!r} not found")
        return job

    async def _busy(self, job_id: str) -> bool:
        job = await self.jobs.get(job_id) if job_id else None
        return job is not None and not job.done

    def _check_size(self, field: str, data: bytes) -> None:
        limit = self.config.max_upload_bytes
        if not data:
            raise InvalidArgument(f"{field} is empty: upload the file's bytes")
        if len(data) > limit:
            raise InvalidArgument(f"{field} has {len(data)} bytes; the limit is {limit} bytes")

    @staticmethod
    def _admin(caller: Principal, action: str) -> None:
        if caller.role != ADMIN:
            raise PermissionDenied(f"only the admin key may {action}: domains are shared by every tenant")

    @staticmethod
    def _tenant(caller: Principal) -> str:
        if caller.role == ADMIN:
            raise PermissionDenied("tenant models belong to a tenant: call with the tenant's API key, not the "
                                   "admin key")
        return caller.tenant
