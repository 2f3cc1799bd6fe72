"""The Manage API core (gateway) and the trainer's job runner with a real Redis: every upload check
(code and a message naming the problem, nothing queued), authorization and tenant isolation, and the
job life cycle (queued -> running -> succeeded / failed, re-queued when a trainer dies or stops)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from academus.services.gateway.core import Authenticator, Principal
from academus.services.gateway.manage import Manage
from academus.services.trainer.core import AdapterJobs, Encoders, JobRunner, OverlayJobs, Progress
from academus.shared.models.plot.domains import READY as DOMAIN_READY
from academus.shared.models.plot.domains import Domain, DomainRegistry
from academus.shared.runtime.config import GatewayConfig, TrainerConfig
from academus.shared.runtime.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ServingError,
    Unauthenticated,
)
from academus.shared.state.catalogue import CLASSIFICATION, EMBEDDING, ModelSpec
from academus.shared.state.jobs import ADAPTER, FAILED, OVERLAY, QUEUED, RUNNING, SUCCEEDED, Job, JobQueue
from academus.shared.state.keys import Keys
from academus.shared.state.tenants import READY, TRAINING, TenantModel, TenantRegistry

KEYS = Keys("mg")
ADMIN = Principal("admin", "admin")
ACME, GLOBEX = Principal("acme", "tenant"), Principal("globex", "tenant")
LIMIT = 4096


def labelled(n: int = 10, labels: tuple[str, ...] = ("pos", "neg")) -> bytes:
    rows = [{"text": f"example number {i}", "label": labels[i % len(labels)]} for i in range(n)]
    return "\n".join(json.dumps(r) for r in rows).encode()


def corpus(n: int = 5) -> bytes:
    return "\n".join(f"sentence {i} about the domain" for i in range(n)).encode()


@pytest.fixture
def table(tmp_path) -> Path:
    """Stands for a built root table (the gateway only checks that one exists)."""
    (tmp_path / "plot" / "root").mkdir(parents=True)
    return tmp_path / "plot"


@pytest.fixture
async def manage(redis, tmp_path, table) -> Manage:
    registry = TenantRegistry(redis, KEYS)
    for tenant in ("acme", "globex"):
        await registry.create_tenant(tenant)
    config = GatewayConfig(max_upload_bytes=LIMIT, min_corpus_lines=5, max_corpus_lines=50,
                           uploads_dir=str(tmp_path / "uploads"))
    return Manage(config, redis, KEYS, Authenticator(redis, KEYS, cache_s=0.0), table=lambda: table)


async def queued(redis) -> int:
    return await redis.llen(KEYS.jobs())


def uploads(manage: Manage) -> list[Path]:
    return sorted(manage.uploads.glob("*")) if manage.uploads.exists() else []


# --- upload validation --------------------------------------------------------------------------

BAD_MODELS = [
    ({"name": "bad name"}, InvalidArgument, "name='bad name' is invalid"),
    ({"base": "bert-large"}, InvalidArgument, "base='bert-large' is not a base"),
    ({"domain": "nope"}, NotFound, "domain 'nope' not found"),
    ({"data": b""}, InvalidArgument, "data is empty"),
    ({"data": b"x" * (LIMIT + 1)}, InvalidArgument, f"data has {LIMIT + 1} bytes; the limit is {LIMIT} bytes"),
    ({"data": labelled(4) + b'\n{"text": "caf\xe9", "label": "pos"}'}, InvalidArgument,
     "data:5: not valid UTF-8 (invalid continuation byte at byte 13)"),
    ({"data": labelled(3) + b"\n{not json"}, InvalidArgument, "data:4: not valid JSON"),
    ({"data": b'{"text": "no label"}'}, InvalidArgument, "data:1: missing field 'label'"),
    ({"data": b'{"text": "", "label": "a"}'}, InvalidArgument, "data:1: \"text\" must be a non-empty string"),
    ({"data": b'{"text": "x", "label": null}'}, InvalidArgument, "data:1: \"label\" must be"),
    ({"data": labelled(10, ("only",))}, InvalidArgument, "needs at least 2 distinct labels, found ['only']"),
    ({"data": labelled(4)}, InvalidArgument, "data has 4 examples; a tenant model needs at least 8"),
]


@pytest.mark.parametrize(("change", "error", "message"), BAD_MODELS)
async def test_a_bad_tenant_model_request_is_refused_before_anything_is_queued(manage, redis, change, error,
                                                                               message):
    request = {"name": "reviews", "base": "minilm", "domain": "", "data": labelled()} | change
    with pytest.raises(error) as raised:
        await manage.create_tenant_model(ACME, **request)
    assert message in raised.value.message
    assert await queued(redis) == 0 and not await manage.list_tenant_models(ACME) and not uploads(manage)


async def test_a_served_models_name_and_an_unready_domain_are_refused(manage, redis):
    await redis.hset(KEYS.models(), "minilm", "{}")
    with pytest.raises(InvalidArgument, match="a served model has that name"):
        await manage.create_tenant_model(ACME, "minilm", "minilm", "", labelled())
    await manage.create_domain(ADMIN, "legal", corpus(), 10)
    with pytest.raises(FailedPrecondition, match="domain 'legal' is building, not ready"):
        await manage.create_tenant_model(ACME, "contracts", "minilm", "legal", labelled())


async def test_a_served_users_embedding_model_is_a_base_and_no_other_model_is(manage, redis):
    served = [ModelSpec("tiny-mpnet", EMBEDDING, dim=36, architecture="MPNetModel", layers=3),
              ModelSpec("tiny-head", CLASSIFICATION, ["a", "b"], dim=36, architecture="MPNetModel", layers=3),
              ModelSpec("tiny-students", EMBEDDING, dim=36, max_students=3, architecture="MPNetModel", layers=2),
              ModelSpec("sentiment", CLASSIFICATION, ["neg", "pos"])]
    await redis.hset(KEYS.models(), mapping={spec.name: spec.to_json() for spec in served})
    job = await manage.create_tenant_model(ACME, "reviews", "tiny-mpnet", "", labelled())
    assert job.params["base"] == "tiny-mpnet" and await queued(redis) == 1
    [model] = await manage.list_tenant_models(ACME)
    assert (model.base, model.status) == ("tiny-mpnet", TRAINING)
    for other in ("tiny-head", "tiny-students", "sentiment", "gone"):
        with pytest.raises(InvalidArgument) as refused:
            await manage.create_tenant_model(ACME, "memos", other, "", labelled())
        assert refused.value.message == (f"base={other!r} is not a base tenant models can be trained on; served "
                                         "bases: minilm, minilm-plot, tiny-mpnet (a user's embedding model is one once "
                                         "served)")
    await DomainRegistry(redis, KEYS).create(Domain("legal", status=DOMAIN_READY))
    with pytest.raises(InvalidArgument, match="domain='legal' needs a PLOT base"):
        await manage.create_tenant_model(ACME, "memos", "tiny-mpnet", "legal", labelled())
    assert await queued(redis) == 1


async def test_a_domain_needs_a_plot_base_and_a_plot_base_needs_a_table(manage, redis, tmp_path):
    await DomainRegistry(redis, KEYS).create(Domain("legal", status=DOMAIN_READY))
    with pytest.raises(InvalidArgument, match=r"domain='legal' needs a PLOT base \(minilm-plot\)"):
        await manage.create_tenant_model(ACME, "contracts", "minilm", "legal", labelled())
    assert await queued(redis) == 0 and not uploads(manage)
    job = await manage.create_tenant_model(ACME, "contracts", "minilm-plot", "legal", labelled())
    assert (job.params["base"], job.params["domain"]) == ("minilm-plot", "legal") and await queued(redis) == 1
    [model] = await manage.list_tenant_models(ACME)
    assert (model.base, model.domain, model.status) == ("minilm-plot", "legal", TRAINING)
    manage.table = lambda: None   # no PLOT table built on this node
    with pytest.raises(FailedPrecondition, match=r"base='minilm-plot' .* none is built: run `academus plot build`"):
        await manage.create_tenant_model(ACME, "memos", "minilm-plot", "", labelled())
    assert await queued(redis) == 1


async def test_a_domain_tenant_models_use_is_not_deleted_until_they_are(manage, redis, table):
    await DomainRegistry(redis, KEYS).create(Domain("legal", status=DOMAIN_READY))
    (table / "domains" / "legal").mkdir(parents=True)
    await manage.create_tenant_model(ACME, "contracts", "minilm-plot", "legal", labelled())
    await manage.create_tenant_model(GLOBEX, "briefs", "minilm-plot", "legal", labelled())
    await manage.create_tenant_model(GLOBEX, "memos", "minilm-plot", "", labelled())
    with pytest.raises(FailedPrecondition, match=r"domain 'legal' is used by 2 tenant model\(s\) "
                                                 r"\(acme/contracts, globex/briefs\); delete them first"):
        await manage.delete_domain(ADMIN, "legal")
    assert [d.name for d in await manage.list_domains(ADMIN)] == ["legal"] and (table / "domains" / "legal").exists()
    await manage.delete_tenant_model(ACME, "contracts")
    await manage.delete_tenant_model(GLOBEX, "briefs")
    await manage.delete_domain(ADMIN, "legal")
    assert await manage.list_domains(ADMIN) == [] and not (table / "domains" / "legal").exists()


async def test_a_model_created_while_its_domain_is_deleted_is_not_left_on_a_deleted_domain(manage, redis, table):
    """DeleteDomain marks the domain, then reads its users; a creation registers its model, then reads the
    mark. Here DeleteDomain's mark lands between the creation's first check and its register."""
    domains = DomainRegistry(redis, KEYS)
    await domains.create(Domain("legal", status=DOMAIN_READY))
    register = manage.registry.register_model

    async def register_then_deletion_marks(tenant, model):
        await register(tenant, model)
        assert await domains.mark_deleting("legal")

    manage.registry.register_model = register_then_deletion_marks
    with pytest.raises(FailedPrecondition, match="domain 'legal' is being deleted"):
        await manage.create_tenant_model(ACME, "contracts", "minilm-plot", "legal", labelled())
    assert await manage.list_tenant_models(ACME) == [] and await queued(redis) == 0 and not uploads(manage)
    manage.registry.register_model = register
    with pytest.raises(FailedPrecondition, match="being deleted"):   # a creation after the mark
        await manage.create_tenant_model(ACME, "contracts", "minilm-plot", "legal", labelled())
    assert not await domains.mark_deleting("nosuch")

    await domains.mark_deleting("legal", False)    # a refused deletion takes its mark back
    await manage.create_tenant_model(ACME, "contracts", "minilm-plot", "legal", labelled())
    with pytest.raises(FailedPrecondition, match="used by 1 tenant model"):
        await manage.delete_domain(ADMIN, "legal")
    assert not (await domains.get("legal")).deleting
    await manage.create_tenant_model(GLOBEX, "briefs", "minilm-plot", "legal", labelled())
    assert [m.name for m in await manage.list_tenant_models(GLOBEX)] == ["briefs"]


BAD_DOMAINS = [
    ({"name": "../etc"}, InvalidArgument, "name='../etc' is invalid"),
    ({"top_percent": 150.0}, InvalidArgument, "top_percent=150.0 is invalid: it must be in (0, 100]"),
    ({"corpus": b""}, InvalidArgument, "corpus is empty"),
    ({"corpus": b"a\n" * LIMIT}, InvalidArgument, f"corpus has {2 * LIMIT} bytes; the limit is {LIMIT} bytes"),
    ({"corpus": corpus(5) + b"\nbad \xff byte"}, InvalidArgument, "corpus:6: not valid UTF-8 (invalid start byte "
     "at byte 4)"),
    ({"corpus": corpus(3) + b"\n\n  \n"}, InvalidArgument, "corpus has 3 non-blank lines; a domain needs 5 to 50"),
    ({"corpus": corpus(51)}, InvalidArgument, "corpus has 51 non-blank lines; a domain needs 5 to 50"),
]


@pytest.mark.parametrize(("change", "error", "message"), BAD_DOMAINS)
async def test_a_bad_domain_request_is_refused_before_anything_is_queued(manage, redis, change, error, message):
    request = {"name": "legal", "corpus": corpus(), "top_percent": 0.0} | change
    with pytest.raises(error) as raised:
        await manage.create_domain(ADMIN, **request)
    assert message in raised.value.message
    assert await queued(redis) == 0 and not await manage.list_domains(ADMIN) and not uploads(manage)


async def test_a_domain_needs_a_root_table(manage, redis):
    manage.table = lambda: None
    with pytest.raises(FailedPrecondition, match="no PLOT root table is built"):
        await manage.create_domain(ADMIN, "legal", corpus(), 10)
    assert await queued(redis) == 0 and not await manage.list_domains(ADMIN)


# --- authorization and isolation ----------------------------------------------------------------

async def test_credentials_are_checked(manage, redis):
    with pytest.raises(Unauthenticated):
        await manage.authenticate(None)
    with pytest.raises(Unauthenticated):
        await manage.authenticate("acd_acme_forged")
    await redis.hset(KEYS.api_key("the-admin-key"), mapping={"tenant": "admin", "role": "admin"})
    assert await manage.authenticate("the-admin-key") == ADMIN


async def test_domains_are_created_and_deleted_only_with_the_admin_key(manage):
    with pytest.raises(PermissionDenied, match="only the admin key may create a domain"):
        await manage.create_domain(ACME, "legal", corpus(), 10)
    job = await manage.create_domain(ADMIN, "legal", corpus(), 10)
    with pytest.raises(PermissionDenied, match="only the admin key may delete a domain"):
        await manage.delete_domain(ACME, "legal")
    assert [d.name for d in await manage.list_domains(ACME)] == ["legal"]  # tenants choose among them
    with pytest.raises(NotFound):  # the domain job is the admin's
        await manage.get_job(ACME, job.id)


async def test_the_admin_key_has_no_tenant_models(manage):
    for call in (manage.create_tenant_model(ADMIN, "m", "minilm", "", labelled()),
                 manage.list_tenant_models(ADMIN), manage.delete_tenant_model(ADMIN, "m")):
        with pytest.raises(PermissionDenied, match="tenant's API key"):
            await call


async def test_a_tenant_never_sees_or_touches_another_tenants_model_or_job(manage):
    job = await manage.create_tenant_model(ACME, "reviews", "minilm", "", labelled())
    assert [m.name for m in await manage.list_tenant_models(ACME)] == ["reviews"]
    assert await manage.list_tenant_models(GLOBEX) == []
    unknown = await _error(manage.get_job(GLOBEX, "no-such-job"))
    stolen = await _error(manage.get_job(GLOBEX, job.id))
    assert (type(stolen), stolen.message) == (type(unknown), unknown.message.replace("no-such-job", job.id))
    for call in (manage.update_tenant_model(GLOBEX, "reviews", labelled()),
                 manage.delete_tenant_model(GLOBEX, "reviews")):
        error = await _error(call)
        assert isinstance(error, NotFound) and error.message == "model 'reviews' not found"
    # Names are per tenant: globex may have its own "reviews", and acme's is untouched.
    await manage.create_tenant_model(GLOBEX, "reviews", "minilm", "", labelled())
    [own] = await manage.list_tenant_models(ACME)
    assert own.job == job.id and (await manage.get_job(ACME, job.id)).tenant == "acme"


async def _error(call) -> ServingError:
    with pytest.raises(ServingError) as raised:
        await call
    return raised.value


# --- job life cycle -----------------------------------------------------------------------------

class Recorder:
    """A job handler that records what it ran and returns (or raises) what it is told."""

    def __init__(self, outcome: Any = None, gate: asyncio.Event | None = None) -> None:
        self.outcome, self.gate = outcome, gate
        self.ran: list[str] = []
        self.failures: list[str] = []

    async def run(self, job: Job, progress: Progress) -> dict[str, Any]:
        self.ran.append(job.id)
        progress(0.5)
        if self.gate is not None:
            await self.gate.wait()
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome or {"ok": True}

    async def failed(self, job: Job, message: str) -> None:
        self.failures.append(message)


def runner(redis, **handlers) -> JobRunner:
    return JobRunner(JobQueue(redis, KEYS), handlers, trainer_id="t-1", lease_s=30, poll_s=0.01, max_attempts=2)


async def test_a_tenant_model_is_listed_while_it_trains_and_its_upload_waits_for_the_trainer(manage, redis):
    job = await manage.create_tenant_model(ACME, "reviews", "minilm", "", labelled())
    assert (job.kind, job.status, job.tenant, job.target) == (ADAPTER, QUEUED, "acme", "reviews")
    [model] = await manage.list_tenant_models(ACME)
    assert (model.status, model.labels, model.job, model.base) == (TRAINING, ["neg", "pos"], job.id, "minilm")
    assert Path(job.params["upload"]).read_bytes() == labelled() and await queued(redis) == 1
    with pytest.raises(AlreadyExists):
        await manage.create_tenant_model(ACME, "reviews", "minilm", "", labelled())
    with pytest.raises(FailedPrecondition, match=f"being trained \\(job {job.id}\\)"):
        await manage.update_tenant_model(ACME, "reviews", labelled())


async def test_the_runner_takes_jobs_in_order_and_records_success_and_failure(redis):
    queue, handler = JobQueue(redis, KEYS), Recorder({"version": 3})
    first = await queue.submit(Job(ADAPTER, "acme", "a"))
    second = await queue.submit(Job(ADAPTER, "acme", "b"))
    await queue.submit(first)  # a retried submit queues nothing twice
    jobs = runner(redis, adapter=handler)
    assert await jobs.run_next() and await jobs.run_next() and not await jobs.run_next()
    assert handler.ran == [first.id, second.id]
    done = await queue.get(first.id)
    assert (done.status, done.progress, done.result, done.attempts) == (SUCCEEDED, 1.0, {"version": 3}, 1)
    assert await redis.ttl(KEYS.job(first.id)) > 0 and not await redis.llen(KEYS.jobs_running())

    broken = Recorder(ValueError("the corpus is empty"))
    job = await queue.submit(Job(OVERLAY, "admin", "legal"))
    await runner(redis, overlay=broken).run_next()
    failed = await queue.get(job.id)
    assert (failed.status, failed.message) == (FAILED, "the corpus is empty")
    assert broken.failures == ["the corpus is empty"]
    unknown = await queue.submit(Job("distill", "acme", "x"))
    await runner(redis, overlay=broken).run_next()
    assert (await queue.get(unknown.id)).message == "unknown job kind 'distill'"


async def test_a_failing_job_does_not_stop_the_loop(redis):
    queue = JobQueue(redis, KEYS)
    bad, good = Recorder(RuntimeError("boom")), Recorder()
    failing = await queue.submit(Job(OVERLAY, "admin", "x"))
    fine = await queue.submit(Job(ADAPTER, "acme", "y"))
    jobs = runner(redis, overlay=bad, adapter=good)
    loop = asyncio.create_task(jobs.run_forever())
    while jobs.done < 2:
        await asyncio.sleep(0.01)
    loop.cancel()
    statuses = [(await queue.get(j.id)).status for j in (failing, fine)]
    assert statuses == [FAILED, SUCCEEDED]


async def test_a_dead_trainers_job_is_requeued_and_given_up_after_max_attempts(redis):
    queue = JobQueue(redis, KEYS)
    job = await queue.submit(Job(ADAPTER, "acme", "m"))
    for attempt in (1, 2):
        claimed = await queue.claim("dead-trainer", 30)
        assert (claimed.id, claimed.status, claimed.attempts) == (job.id, RUNNING, attempt)
        assert await queue.requeue_orphans() == 0            # its lease is alive
        await redis.delete(KEYS.job_lease(job.id))          # the lease expires: the trainer died
        assert await queue.requeue_orphans() == 1
        assert (await queue.get(job.id)).status == QUEUED and await redis.llen(KEYS.jobs()) == 1
    handler = Recorder()
    await runner(redis, adapter=handler).run_next()          # third claim, max_attempts=2
    gave_up = await queue.get(job.id)
    assert gave_up.status == FAILED and "gave up after 2 attempts" in gave_up.message and not handler.ran


async def test_a_stopping_trainer_hands_its_job_back(redis):
    queue, gate = JobQueue(redis, KEYS), asyncio.Event()
    job = await queue.submit(Job(ADAPTER, "acme", "m"))
    handler = Recorder(gate=gate)
    jobs = runner(redis, adapter=handler)
    task = asyncio.create_task(jobs.run_next())
    while not handler.ran:
        await asyncio.sleep(0.01)
    assert (await queue.get(job.id)).status == RUNNING
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    back = await queue.get(job.id)
    assert back.status == QUEUED and await redis.lrange(KEYS.jobs(), 0, -1) == [job.id]
    assert not await redis.exists(KEYS.job_lease(job.id)) and jobs.stopping.is_set()


async def test_a_new_models_failed_training_marks_it_failed_and_it_may_be_retrained(manage, redis):
    job = await manage.create_tenant_model(ACME, "reviews", "minilm", "", labelled())
    Path(job.params["upload"]).unlink()                     # e.g. the uploads volume is not shared
    adapters = AdapterJobs(redis, KEYS, TrainerConfig(), Encoders())
    await runner(redis, adapter=adapters).run_next()
    failed = await manage.get_job(ACME, job.id)
    assert failed.status == FAILED and "upload" in failed.message and "is gone" in failed.message
    [model] = await manage.list_tenant_models(ACME)
    assert (model.status, model.message) == ("failed", failed.message)
    retry = await manage.update_tenant_model(ACME, "reviews", labelled(12))
    [model] = await manage.list_tenant_models(ACME)
    assert (model.status, model.job) == (TRAINING, retry.id)


async def test_a_served_model_keeps_serving_when_its_update_fails(manage, redis):
    registry = TenantRegistry(redis, KEYS)
    await registry.register_model("acme", TenantModel("reviews", "minilm", "reviews", 4, ["neg", "pos"]))
    job = await manage.update_tenant_model(ACME, "reviews", labelled())
    Path(job.params["upload"]).unlink()
    await runner(redis, adapter=AdapterJobs(redis, KEYS, TrainerConfig(), Encoders())).run_next()
    assert (await manage.get_job(ACME, job.id)).status == FAILED
    model = await registry.model("acme", "reviews")
    assert (model.status, model.version, model.job) == (READY, 4, job.id)


async def test_a_model_deleted_while_queued_is_not_trained(manage, redis):
    job = await manage.create_tenant_model(ACME, "reviews", "minilm", "", labelled())
    await manage.delete_tenant_model(ACME, "reviews")
    await runner(redis, adapter=AdapterJobs(redis, KEYS, TrainerConfig(), Encoders())).run_next()
    done = await manage.get_job(ACME, job.id)
    assert done.status == FAILED and "was deleted" in done.message
    assert await manage.list_tenant_models(ACME) == [] and not uploads(manage)


async def test_a_domain_lives_from_building_to_failed_to_rebuilt_to_deleted(manage, redis, table):
    job = await manage.create_domain(ADMIN, "legal", corpus(), 25)
    [domain] = await manage.list_domains(ADMIN)
    assert (domain.status, domain.top_percent, domain.job, domain.lines) == ("building", 25.0, job.id, 5)
    with pytest.raises(AlreadyExists):
        await manage.create_domain(ADMIN, "legal", corpus(), 25)
    with pytest.raises(FailedPrecondition, match="is being built"):
        await manage.delete_domain(ADMIN, "legal")
    overlays = OverlayJobs(redis, KEYS, TrainerConfig(), Encoders(), table=lambda: None)
    await runner(redis, overlay=overlays).run_next()        # the root table went away meanwhile
    failed = await manage.get_job(ADMIN, job.id)
    assert failed.status == FAILED and "no PLOT root table" in failed.message
    [domain] = await manage.list_domains(ADMIN)
    assert (domain.status, domain.message) == ("failed", failed.message)

    again = await manage.create_domain(ADMIN, "legal", corpus(6), 10)  # a failed domain may be rebuilt
    assert (await DomainRegistry(redis, KEYS).get("legal")).job == again.id
    await JobQueue(redis, KEYS).finish(again.id, SUCCEEDED)
    (table / "domains" / "legal").mkdir(parents=True)
    await manage.delete_domain(ADMIN, "legal")
    assert await manage.list_domains(ADMIN) == [] and not (table / "domains" / "legal").exists()
    with pytest.raises(NotFound):
        await manage.delete_domain(ADMIN, "legal")
