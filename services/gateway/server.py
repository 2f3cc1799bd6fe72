"""gRPC edge of the gateway: the public Inference service over the Gateway core, and the Manage service
over the Manage core (services/gateway/manage.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc
import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from academus.services.gateway.core import (
    EMBED,
    LABEL,
    SCORE,
    Admitted,
    Answer,
    Authenticator,
    Catalogue,
    FailedKeyLimit,
    Gateway,
    InferCall,
    SchedulerDirectory,
    TenantModels,
    api_key_from,
    for_want_of_room,
    pair_scores,
)
from academus.services.gateway.http import HttpApi, HttpServer
from academus.services.gateway.manage import Manage
from academus.shared.models.plot.domains import Domain
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.work_wire import matrix_from_pb, matrix_to_pb, merge_floats
from academus.shared.runtime import config as cfg
from academus.shared.runtime.certificates import public_credentials
from academus.shared.runtime.errors import ServingError, Unavailable, abort_with, from_rpc_error
from academus.shared.runtime.logs import log_event
from academus.shared.runtime.multiplex import call_with_partials
from academus.shared.runtime.redis_conn import RedisAbsence, connect, wake_on, woken
from academus.shared.runtime.serving import PeerHealth, ServiceSpec, Stubs, run
from academus.shared.runtime.tracing import annotate
from academus.shared.state.catalogue import EMBEDDING, ModelSpec
from academus.shared.state.jobs import FAILED, QUEUED, RUNNING, SUCCEEDED, Job
from academus.shared.state.keys import Keys
from academus.shared.state.registration import Registration
from academus.shared.state.tenants import READY, TenantModel, TenantRegistry, gateway_quotas
from academus.v1 import inference_pb2 as pb
from academus.v1 import inference_pb2_grpc, manage_pb2, manage_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, tensors_pb2

T = TypeVar("T")
HANG_CHECK_EVERY_S = 0.5   # how often the schedulers holding old calls are asked for their health
OUTPUT_NAMES = {pb.OUTPUT_UNSPECIFIED: "", pb.OUTPUT_LABEL: LABEL, pb.OUTPUT_SCORE: SCORE, pb.OUTPUT_EMBEDDING: EMBED}
OUTPUT_ENUMS = {LABEL: pb.OUTPUT_LABEL, SCORE: pb.OUTPUT_SCORE, EMBED: pb.OUTPUT_EMBEDDING}


def from_pb(request: pb.InferRequest) -> InferCall:
    return InferCall(
        model=request.model,
        texts=[i.text for i in request.inputs],
        pairs=[i.text_pair for i in request.inputs],
        output=OUTPUT_NAMES.get(request.output, ""),
        truncate=request.truncate if request.HasField("truncate") else True,
        early_exit=request.early_exit,
    )


def schedule_request(admitted: Admitted, request_id: str, early_exit: bool = False) -> scheduler_pb2.ScheduleRequest:
    tokens = tensors_pb2.TokenBatch(lengths=[len(e.input_ids) for e in admitted.encoded])
    for e in admitted.encoded:
        tokens.input_ids.extend(e.input_ids)
    if any(any(e.token_type_ids) for e in admitted.encoded):
        for e in admitted.encoded:
            tokens.token_type_ids.extend(e.token_type_ids)
    request = scheduler_pb2.ScheduleRequest(request_id=request_id, model=admitted.spec.name,
                                            tenant=admitted.principal.tenant,
                                            output=OUTPUT_ENUMS[admitted.model_output], tokens=tokens,
                                            early_exit=early_exit)
    if (tm := admitted.tenant_model) is not None:  # the base runs it; the worker applies adapter and head
        request.model = tm.base
        request.adapter.CopyFrom(tensors_pb2.AdapterRef(tenant=admitted.principal.tenant, name=tm.adapter,
                                                        version=tm.version, domain=tm.domain))
    return request


def to_pb(admitted: Admitted, result: tensors_pb2.ModelOutput, request_id: str) -> pb.InferResponse:
    """The response for the full model's answer: every text's final prediction. An early answer (exit ramps,
    `result.rows` set) gives those texts' predictions, released at `result.exit_layer`."""
    values = matrix_from_pb(result.values)
    labels, width = served_labels(admitted, result, values.shape[1])
    response = pb.InferResponse(model=admitted.spec.name, request_id=request_id, labels=labels)
    response.metadata.CopyFrom(result.metadata)
    if admitted.paired:
        return pair_response(response, admitted, values)
    early = bool(result.rows)
    for k, i in enumerate(result.rows if early else range(len(admitted.encoded))):
        e = admitted.encoded[i]
        p = response.predictions.add(num_tokens=len(e.input_ids), truncated=e.truncated, input_index=i,
                                     final=not early, exit_layer=result.exit_layer if early else 0)
        if admitted.output == EMBED:
            merge_floats(p, "embedding", values[k])
        else:
            row = values[k, :width].tolist()
            p.probs.extend(row)
            p.label = labels[max(range(width), key=row.__getitem__)]
            p.score = row[-1]
    return response


def served_labels(admitted: Admitted, result: tensors_pb2.ModelOutput, dim: int) -> tuple[list[str], int]:
    """The answer's labels, and how many of each row's `dim` values are the text's own."""
    labels = admitted.spec.labels if admitted.tenant_model is not None else list(result.labels)
    # A tenant head's probs are zero-padded to the widest head in the worker's batch: keep its own classes.
    width = min(len(labels), dim) if admitted.tenant_model is not None and admitted.output != EMBED else dim
    return labels, width


def answer_of(admitted: Admitted, result: tensors_pb2.ModelOutput) -> Answer:
    """The model's answer as the core's `Answer`: the model's float32 rows as they came, never a float each. An exit
    event (`result.rows` set) holds the texts a ramp released (`indices`) and its layer, as `to_pb` gives them."""
    values = matrix_from_pb(result.values)
    labels, width = served_labels(admitted, result, values.shape[1])
    timings = {"tokenize_ms": admitted.tokenize_ms, "queue_ms": result.metadata.queue_ms,
               "compute_ms": result.metadata.compute_ms, "policy": result.metadata.policy}
    if result.rows:
        released = list(result.rows)
        return Answer(admitted.spec.name, labels, values[:, :width],
                      [len(admitted.encoded[i].input_ids) for i in released], **timings,
                      exit_layers=[result.exit_layer] * len(released), indices=released)
    tokens = [len(e.input_ids) for e in admitted.encoded]
    if admitted.paired:
        return Answer(admitted.spec.name, labels, values[:0], [tokens[a] + tokens[b] for a, b in admitted.pair_rows],
                      pair_scores(values[: len(admitted.encoded)], admitted.pair_rows), **timings)
    return Answer(admitted.spec.name, labels, values[:, :width], tokens, **timings)


def first_answer(admitted: Admitted, early: list[tensors_pb2.ModelOutput],
                 final: tensors_pb2.ModelOutput | None) -> Answer:
    """`early_exit` for the core's `Answer`: each text's first result, as `first_results` gives it, and the layer that
    released it (0: the full model). Without the final answer, every text was released early."""
    events = [answer_of(admitted, output) for output in early]
    if final is not None:
        answer = answer_of(admitted, final)
        rows = answer.rows.copy() if events else answer.rows
    else:
        answer = dataclasses.replace(events[-1], num_tokens=[len(e.input_ids) for e in admitted.encoded], indices=None)
        rows = np.empty((len(admitted.encoded), answer.rows.shape[1]), np.float32)
    layers = [0] * len(answer.num_tokens)
    for event in events:
        rows[event.indices] = event.rows
        for i in event.indices:
            layers[i] = event.exit_layers[0]
    return dataclasses.replace(answer, rows=rows, exit_layers=layers)


def first_results(admitted: Admitted, early: list[tensors_pb2.ModelOutput], final: tensors_pb2.ModelOutput | None,
                  request_id: str) -> pb.InferResponse:
    """Unary `early_exit`: each text's first result, from the ramp that released it or else the full model."""
    response = to_pb(admitted, final, request_id) if final is not None else pb.InferResponse(
        model=admitted.spec.name, request_id=request_id, labels=list(early[0].labels))
    by_text = {p.input_index: p for p in response.predictions}
    for output in early:
        for p in to_pb(admitted, output, request_id).predictions:
            by_text[p.input_index] = p   # released before the final answer
    del response.predictions[:]
    response.predictions.extend(by_text[i] for i in sorted(by_text))
    return response


def released_once(on_partial: Callable[[tensors_pb2.ModelOutput], None]
                  ) -> Callable[[tensors_pb2.ModelOutput], None]:
    """`on_partial` given each text's first early answer only. A call sent again (its scheduler gone or hung, or a
    worker lost mid-batch) runs its texts anew, and a ramp may release a text a second time: the client was
    promised one early result a text, then the final one."""
    released: set[int] = set()

    def forward(output: tensors_pb2.ModelOutput) -> None:
        fresh = [k for k, row in enumerate(output.rows) if row not in released]
        if len(fresh) < len(output.rows):
            if not fresh:
                return
            output = only_rows(output, fresh)
        released.update(output.rows)
        on_partial(output)

    return forward


def only_rows(output: tensors_pb2.ModelOutput, keep: list[int]) -> tensors_pb2.ModelOutput:
    """An early answer cut to its rows at positions `keep`."""
    cut = tensors_pb2.ModelOutput()
    cut.CopyFrom(output)
    del cut.rows[:]
    cut.rows.extend(output.rows[k] for k in keep)
    cut.values.CopyFrom(matrix_to_pb(matrix_from_pb(output.values)[keep]))
    return cut


def pair_response(response: pb.InferResponse, admitted: Admitted, embeddings: np.ndarray) -> pb.InferResponse:
    """One score a text pair, its cosine similarity; its tokens are both texts'."""
    scores = pair_scores(embeddings[: len(admitted.encoded)], admitted.pair_rows)
    for i, ((a, b), score) in enumerate(zip(admitted.pair_rows, scores, strict=True)):
        first, second = admitted.encoded[a], admitted.encoded[b]
        response.predictions.add(score=score, input_index=i, final=True,
                                 num_tokens=len(first.input_ids) + len(second.input_ids),
                                 truncated=first.truncated or second.truncated)
    return response


async def core_answer(context: grpc.aio.ServicerContext, work: Awaitable[T]) -> T:
    """What the core answers, or the call aborted with the status of its error; Redis unreachable (keys and catalogue)
    is UNAVAILABLE: nothing ran, and a retry may succeed."""
    try:
        return await work
    except ServingError as e:
        await abort_with(context, e)
    except RedisError as e:
        await abort_with(context, Unavailable(f"credential and model store unreachable: {e}"))


def model_info_pb(spec: ModelSpec) -> pb.ModelInfo:
    return pb.ModelInfo(name=spec.name, kind=spec.kind, labels=spec.labels, dim=spec.dim, max_tokens=spec.max_tokens,
                        status=READY, architecture=spec.architecture, layers=spec.layers, pairs=spec.pairs,
                        pooling=spec.pooling, normalized=spec.normalized)


def tenant_model_info_pb(model: TenantModel, base: ModelSpec | None) -> pb.ModelInfo:
    """A tenant model with its base's limits (0 while the base is not served); an embedding adapter's vectors are
    pooled as its base's."""
    pooled = base is not None and model.kind == base.kind == EMBEDDING
    return pb.ModelInfo(name=model.name, kind=model.kind, labels=model.labels, dim=base.dim if base else 0,
                        max_tokens=base.max_tokens if base else 0, base=model.base, status=model.status,
                        pooling=base.pooling if pooled else "", normalized=pooled and base.normalized)


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, gateway: Gateway, schedulers: SchedulerDirectory, default_deadline_s: float,
                 stubs: Stubs) -> None:
        self.gateway = gateway
        self.schedulers = schedulers
        self.default_deadline_s = default_deadline_s
        self._stub = stubs

    async def Infer(self, request: pb.InferRequest, context: grpc.aio.ServicerContext):
        entered = time.perf_counter()
        try:
            admitted, deadline = await self._admit(request, context)
            if request.early_exit:
                response = first_results(admitted, *await self._released(admitted, request.request_id, deadline,
                                                                         request.policy), request.request_id)
            else:
                response = await self.answer(admitted, request.request_id, deadline, request.policy)
        except ServingError as e:
            await abort_with(context, e)
        except RedisError as e:  # keys and catalogue unreachable: nothing ran, a retry may succeed
            await abort_with(context, Unavailable(f"credential and model store unreachable: {e}"))
        response.metadata.tokenize_ms = admitted.tokenize_ms
        response.metadata.gateway_ms = (time.perf_counter() - entered) * 1e3
        return response

    async def InferStream(self, request: pb.InferRequest, context: grpc.aio.ServicerContext):
        """Each exit event's texts as they are released (final = false), then every text's full-model prediction
        (final = true). A client that leaves cancels the call: the scheduler drops its job, and the worker
        stops the batch between layers once no caller of it is left."""
        entered = time.perf_counter()
        admitted, deadline = await core_answer(context, self._admit(request, context))
        events = self._exit_events(admitted, request.request_id, deadline, request.policy)
        try:
            async for output in events:
                response = to_pb(admitted, output, request.request_id)
                if not output.rows:   # the final answer
                    response.metadata.tokenize_ms = admitted.tokenize_ms
                    response.metadata.gateway_ms = (time.perf_counter() - entered) * 1e3
                yield response
        except ServingError as e:
            await abort_with(context, e)
        finally:
            await events.aclose()   # the client left (or the stream failed): its work stops downstream

    async def _exit_events(self, admitted: Admitted, request_id: str, deadline: float, policy: str
                           ) -> AsyncIterator[tensors_pb2.ModelOutput]:
        """The early answers as the ramps release them (`rows` set), then the full model's (raises its refusal).
        Closed early, the call is cancelled: the scheduler drops the job, and the worker stops the batch between
        layers once no caller of it is left."""
        # early answers in release order, then None once the final one is in: none can follow it
        answers: asyncio.Queue[tensors_pb2.ModelOutput | None] = asyncio.Queue()
        final = asyncio.ensure_future(self._schedule(admitted, schedule_request(admitted, request_id, True),
                                                     deadline, policy, answers.put_nowait))
        final.add_done_callback(lambda _: answers.put_nowait(None))
        try:
            while (early := await answers.get()) is not None:
                yield early
            yield final.result()
        finally:
            final.cancel()

    async def answer(self, admitted: Admitted, request_id: str, deadline: float, policy: str = "") -> pb.InferResponse:
        """Every text's full-model prediction (no early exits)."""
        result = await self._schedule(admitted, schedule_request(admitted, request_id), deadline, policy)
        return to_pb(admitted, result, request_id)

    async def answer_call(self, api_key: str | None, call: InferCall, request_id: str, timeout_s: float,
                          peer: str, policy: str = "") -> Answer:
        """A call another edge of this gateway took (HTTP/JSON): admitted and answered as `Infer` answers it."""
        deadline = time.monotonic() + timeout_s
        admitted = await self.gateway.admit(api_key, call, policy, peer)
        if call.early_exit:
            return first_answer(admitted, *await self._released(admitted, request_id, deadline, policy))
        result = await self._schedule(admitted, schedule_request(admitted, request_id), deadline, policy)
        return answer_of(admitted, result)

    async def stream_call(self, api_key: str | None, call: InferCall, request_id: str, timeout_s: float,
                          peer: str, policy: str = "") -> AsyncIterator[Answer]:
        """`InferStream` for another edge of this gateway (HTTP/JSON): each exit event's texts (`Answer.indices`),
        then every text's full-model answer. A refusal at admission comes before the first."""
        deadline = time.monotonic() + timeout_s
        admitted = await self.gateway.admit(api_key, call, policy, peer)
        events = self._exit_events(admitted, request_id, deadline, policy)
        try:
            async for output in events:
                yield answer_of(admitted, output)
        finally:
            await events.aclose()

    async def model_owners(self, api_key: str | None, peer: str) -> list[dict[str, str]]:
        """The models the key may name, as ListModels gives them: the served ones ("academus"), then the
        caller's own tenant models ("tenant")."""
        served, own = await self.gateway.list_models(api_key, peer)
        return [*({"name": spec.name, "owner": "academus"} for spec in served),
                *({"name": m.name, "owner": "tenant"} for m in own)]

    async def _admit(self, request: pb.InferRequest, context: grpc.aio.ServicerContext) -> tuple[Admitted, float]:
        """The admitted call (credentials, quota, limits, tokens) and its deadline on this clock."""
        remaining = context.time_remaining()
        deadline = time.monotonic() + (remaining if remaining is not None else self.default_deadline_s)
        admitted = await self.gateway.admit(api_key_from(context.invocation_metadata()), from_pb(request),
                                            request.policy, context.peer())
        annotate(model=admitted.spec.name, tenant=admitted.principal.tenant, texts=len(admitted.encoded))
        return admitted, deadline

    async def _released(self, admitted: Admitted, request_id: str, deadline: float, policy: str
                        ) -> tuple[list[tensors_pb2.ModelOutput], tensors_pb2.ModelOutput | None]:
        """Unary early exits: the early answers once every text has one, or with the full model's answer if it came
        first. The full model's answer is still awaited, in the background: its batch runs on, and it is the
        feedback that keeps the ramps accurate."""
        early: list[tensors_pb2.ModelOutput] = []
        every_text = asyncio.Event()
        answered: set[int] = set()

        def released(output: tensors_pb2.ModelOutput) -> None:
            early.append(output)
            answered.update(output.rows)
            if len(answered) == len(admitted.encoded):
                every_text.set()

        final = asyncio.ensure_future(self._schedule(admitted, schedule_request(admitted, request_id, True),
                                                     deadline, policy, released))
        waiter = asyncio.ensure_future(every_text.wait())
        try:
            await asyncio.wait({final, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            final.cancel()
            raise
        finally:
            waiter.cancel()
        if not final.done():
            final.add_done_callback(_settled)
            return early, None
        return early, final.result()

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext):
        served, own = await core_answer(context, self.gateway.list_models(
            api_key_from(context.invocation_metadata()), context.peer()))
        bases = {spec.name: spec for spec in served}
        return pb.ListModelsResponse(models=[*(model_info_pb(spec) for spec in served),
                                             *(tenant_model_info_pb(m, bases.get(m.base)) for m in own)])

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext):
        tokens = await core_answer(context, self.gateway.tokens(
            api_key_from(context.invocation_metadata()), request.model, list(request.texts),
            not request.without_special_tokens, context.peer()))
        return pb.TokenizeResponse(texts=[pb.TokenizedText(tokens=[
            pb.Token(id=t.id, text=t.text, special=t.special, start=-1 if t.start is None else t.start,
                     stop=-1 if t.stop is None else t.stop) for t in text]) for text in tokens])

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        texts = await core_answer(context, self.gateway.decode(
            api_key_from(context.invocation_metadata()), request.model, [list(t.ids) for t in request.texts],
            not request.keep_special_tokens, context.peer()))
        return pb.DecodeResponse(texts=texts)

    async def _schedule(self, admitted: Admitted, request: scheduler_pb2.ScheduleRequest, deadline: float,
                        policy: str = "", on_partial: Callable[[tensors_pb2.ModelOutput], None] | None = None
                        ) -> tensors_pb2.ModelOutput:
        """Routes to the deployments serving the model (SchedulerDirectory.route). A refusal for want of
        room anywhere gives the request's quota token back: nothing ran, and the caller will retry.
        `on_partial`: takes each text's first early answer (exit ramps) before the answer, a retry's again not."""
        on_partial = None if on_partial is None else released_once(on_partial)

        async def send(address: str) -> tensors_pb2.ModelOutput:
            try:
                return await call_with_partials(self._stub(address).Schedule, request,
                                                max(deadline - time.monotonic(), 0.001), on_partial)
            except grpc.aio.AioRpcError as e:
                raise from_rpc_error(e, f"scheduler {address}") from e

        try:
            return await self.schedulers.route(request.model, policy, deadline, send)
        except ServingError as e:
            if for_want_of_room(e):
                await self._give_back(admitted)
            raise

    async def _give_back(self, admitted: Admitted) -> None:
        try:
            await self.gateway.give_back(admitted)
        except RedisError as e:  # the refusal is still the answer; the tenant loses one token
            log_event("quota_give_back_failed", logging.WARNING, tenant=admitted.principal.tenant, error=repr(e))


def _settled(task: asyncio.Future) -> None:
    """A background call's outcome, read so that its failure is not reported as never retrieved."""
    if not task.cancelled() and task.exception() is not None:
        log_event("background_final_failed", logging.INFO, error=repr(task.exception()))


JOB_STATUS = {QUEUED: manage_pb2.JOB_STATUS_QUEUED, RUNNING: manage_pb2.JOB_STATUS_RUNNING,
              SUCCEEDED: manage_pb2.JOB_STATUS_SUCCEEDED, FAILED: manage_pb2.JOB_STATUS_FAILED}


def job_pb(job: Job) -> manage_pb2.Job:
    return manage_pb2.Job(id=job.id, kind=job.kind, status=JOB_STATUS.get(job.status, 0), progress=job.progress,
                          message=job.message, result_json=json.dumps(job.result) if job.result else "",
                          target=job.target, created=job.created, updated=job.updated)


def domain_pb(d: Domain) -> manage_pb2.Domain:
    return manage_pb2.Domain(name=d.name, status=d.status, top_percent=d.top_percent, job_id=d.job,
                             message=d.message, created=d.created, lines=d.lines)


def tenant_model_pb(m: TenantModel) -> manage_pb2.TenantModel:
    return manage_pb2.TenantModel(name=m.name, base=m.base, domain=m.domain, version=m.version, labels=m.labels,
                                  status=m.status, job_id=m.job, message=m.message, created=m.created)


class ManageServicer(manage_pb2_grpc.ManageServicer):
    """Authenticates each call, hands it to the Manage core and maps its errors to status codes."""

    def __init__(self, core: Manage) -> None:
        self.core = core

    async def CreateDomain(self, request, context):
        job = await self._call(context, lambda p: self.core.create_domain(p, request.name, request.corpus,
                                                                          request.top_percent))
        return job_pb(job)

    async def ListDomains(self, request, context):
        domains = await self._call(context, self.core.list_domains)
        return manage_pb2.ListDomainsResponse(domains=[domain_pb(d) for d in domains])

    async def DeleteDomain(self, request, context):
        await self._call(context, lambda p: self.core.delete_domain(p, request.name))
        return manage_pb2.DeleteDomainResponse(deleted=True)

    async def CreateTenantModel(self, request, context):
        job = await self._call(context, lambda p: self.core.create_tenant_model(
            p, request.name, request.base, request.domain, request.data))
        return job_pb(job)

    async def UpdateTenantModel(self, request, context):
        job = await self._call(context, lambda p: self.core.update_tenant_model(p, request.name, request.data))
        return job_pb(job)

    async def ListTenantModels(self, request, context):
        models = await self._call(context, self.core.list_tenant_models)
        return manage_pb2.ListTenantModelsResponse(models=[tenant_model_pb(m) for m in models])

    async def DeleteTenantModel(self, request, context):
        await self._call(context, lambda p: self.core.delete_tenant_model(p, request.name))
        return manage_pb2.DeleteTenantModelResponse(deleted=True)

    async def AddModel(self, request, context):
        return job_pb(await self._call(context, lambda p: self.core.add_model(p, request.name, request.source,
                                                                              request.task, request.pooling)))

    async def RemoveModel(self, request, context):
        return job_pb(await self._call(context, lambda p: self.core.remove_model(p, request.name)))

    async def GetJob(self, request, context):
        return job_pb(await self._call(context, lambda p: self.core.get_job(p, request.id)))

    async def _call(self, context: grpc.aio.ServicerContext, work):
        try:
            principal = await self.core.authenticate(api_key_from(context.invocation_metadata()), context.peer())
            annotate(tenant=principal.tenant)
            return await work(principal)
        except ServingError as e:
            await abort_with(context, e)
        except RedisError as e:  # nothing was accepted; a retry may succeed
            await abort_with(context, Unavailable(f"the management store is unreachable: {e}"))
        except OSError as e:  # the uploads volume (full, not mounted): nothing was queued
            await abort_with(context, Unavailable(f"the upload could not be stored: {e.strerror or e}"))


class GatewayRegistration(Registration):
    """The gateway in Redis, for `academus status` in a deployed mesh: the address its health is checked on (its
    own port where it has one, since gateways share the mesh's), its HTTP API's, whether both serve TLS and the
    name to check their certificate by."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, config: cfg.GatewayConfig, http: HttpServer | None) -> None:
        super().__init__(redis, keys.gateway, keys.gateways(), config.heartbeat_ttl_s)
        self.config, self.http = config, http

    async def fields(self) -> dict[str, str]:
        http = f"{self.config.advertised}:{self.http.port}" if self.http is not None and self.http.port else ""
        tls = {"tls": "1", "server_name": self.config.tls_server_name} if self.config.tls_cert else {"tls": "0"}
        return {"http": http, **tls}

    async def serving(self, address: str) -> None:
        """on_started: the HTTP port opens, then the gateway registers (Redis away: its heartbeat does it later)."""
        if self.http is not None:
            await self.http.start()
        await self.start(f"{self.config.advertised}:{self.config.own_port}" if self.config.own_port else address)


async def build() -> ServiceSpec:
    config = cfg.load(cfg.GatewayConfig)
    redis = connect(config.redis_url, config.redis_password)
    keys = Keys(config.key_prefix)
    catalogue = Catalogue(redis, keys)
    health = PeerHealth()
    schedulers = SchedulerDirectory(redis, keys, config.honour_pushback,
                                    answers=functools.partial(health.answers, timeout_s=config.scheduler_hang_s)
                                    if config.scheduler_hang_s else None, hang_s=config.scheduler_hang_s)
    registry = TenantRegistry(redis, keys, rate=config.tenant_rate, burst=config.tenant_burst)
    absence = RedisAbsence()   # one for the keys and the quotas: a failure either meets spares the other the wait
    gateway = Gateway(config, TeacherTokenizer(teacher_dir(), config.max_tokens, ascii_path=config.ascii_tokenizer),
                      Authenticator(redis, keys, config.auth_cache_s,
                                    failures=FailedKeyLimit(config.auth_failure_limit, config.auth_failure_window_s),
                                    absence=absence),
                      catalogue,
                      TenantModels(registry, config.auth_cache_s),
                      gateway_quotas(config, redis, keys, config.auth_cache_s, absence),
                      schedulers)

    changed = asyncio.Event()   # set by an event on the channel: a worker registered, a node's scheduler
                                # started or stopped serving a model, groups were re-planned

    async def refresher() -> None:
        while True:
            try:
                await catalogue.refresh()
                await schedulers.refresh()
            except Exception as e:
                log_event("refresh_failed", logging.WARNING, error=repr(e))
            if await woken(changed, config.catalogue_refresh_s):
                gateway.auth.forget()   # an event (or Redis back): it may be a key's revocation (state/api_keys.py)

    async def hang_checks() -> None:
        """Schedulers that hold calls long are asked for their health; a hung one's calls go elsewhere."""
        while True:
            await asyncio.sleep(HANG_CHECK_EVERY_S)
            try:
                hung = await schedulers.give_up_hung()
            except Exception as e:  # a check that failed oddly: the next round asks again
                log_event("hang_check_failed", logging.WARNING, error=repr(e))
                continue
            for address, given_up in hung.items():
                if given_up:
                    log_event("scheduler_calls_given_up", logging.WARNING, address=address, calls=given_up)

    manage = ManageServicer(Manage(config, redis, keys, gateway.auth, quotas=gateway.quotas))   # one set of leases

    inference = InferenceServicer(gateway, schedulers, config.default_deadline_s,
                                  Stubs.for_hops(scheduler_pb2_grpc.SchedulerStub, config))
    http = HttpServer(HttpApi(config, inference.answer_call, inference.model_owners,
                              lambda: bool(schedulers.deployments), gateway.auth.authenticate, gateway.describe,
                              functools.partial(gateway.tokens, field="inputs"),
                              functools.partial(gateway.decode, field="ids[{i}]"), inference.stream_call),
                      config) if config.http_port >= 0 else None

    def add_servicers(server: grpc.aio.Server) -> None:
        inference_pb2_grpc.add_InferenceServicer_to_server(inference, server)
        manage_pb2_grpc.add_ManageServicer_to_server(manage, server)

    registration = GatewayRegistration(redis, keys, config, http)

    async def stopping() -> None:
        if http is not None:
            http.api.stopping = True   # /health says 503 from now on; its port takes requests until gRPC drained
        await registration.deregister()   # after: it may wait on Redis, and the balancers should know at once

    async def stopped() -> None:
        if http is not None:   # the requests in flight finish before the Redis client they need closes
            await http.stop()
        await redis.aclose()

    return ServiceSpec(
        name="gateway",
        config=config,
        add_servicers=add_servicers,
        service_names=["academus.v1.Inference", "academus.v1.Manage"],
        on_started=registration.serving,
        on_stopping=stopping,
        on_stopped=stopped,
        extra_tasks=[refresher, functools.partial(wake_on, redis, keys.events(), changed), registration.heartbeat,
                     *([hang_checks] if config.scheduler_hang_s else [])],
        own_port=config.own_port,
        public_credentials=functools.partial(public_credentials, config),
        max_receive_bytes=config.request_limit,
    )


def main() -> None:
    run(build)


if __name__ == "__main__":
    main()
