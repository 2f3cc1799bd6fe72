"""gRPC edge of the worker: Run batches on the ModelRunner; register and heartbeat via the resource manager."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch
from prometheus_client import Counter

from academus.services.worker.core import OUTPUT_EMBEDDING, OUTPUT_PROBS, ModelRunner
from academus.shared import config as cfg
from academus.shared.errors import DeadlineExceeded, ServingError, abort_with
from academus.shared.keys import Keys
from academus.shared.logs import log_event
from academus.shared.redis_conn import connect
from academus.shared.serving import ServiceSpec, Stubs, run
from academus.shared.tracing import annotate
from academus.v1 import (
    inference_pb2,
    resource_manager_pb2,
    resource_manager_pb2_grpc,
    tensors_pb2,
    worker_pb2_grpc,
)

BATCHES = Counter("academus_worker_batches_total", "Batches computed", ["model"])
EXPIRED = Counter("academus_worker_expired_total", "Batches dropped because their deadline passed first")


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, runner: ModelRunner, worker_id: str) -> None:
        self.runner = runner
        self.worker_id = worker_id
        # One compute thread: the worker runs one batch at a time; the event loop stays free for RPCs.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")

    async def Run(self, request, context: grpc.aio.ServicerContext):
        entered = time.perf_counter()
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        wants_probs = request.output in (inference_pb2.OUTPUT_LABEL, inference_pb2.OUTPUT_SCORE)
        output = OUTPUT_PROBS if wants_probs else OUTPUT_EMBEDDING
        tokens = request.tokens
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                self.executor, self._run, request.model, output, tokens.input_ids, tokens.lengths,
                tokens.token_type_ids, deadline, request.num_students,
            )
        except ServingError as e:
            await abort_with(context, e)
        annotate(model=request.model, batch_size=len(tokens.lengths), worker=self.worker_id,
                 padding_ratio=1 - result.real_tokens / max(result.padded_tokens, 1))
        rows, dim = result.values.shape
        return tensors_pb2.ModelOutput(
            output=request.output,
            values=tensors_pb2.Matrix(values=result.values.ravel().tolist(), rows=rows, dim=dim),
            labels=result.labels,
            metadata=inference_pb2.InferMetadata(
                batch_size=rows, student_count=result.student_count, worker_id=self.worker_id,
                compute_ms=result.compute_ms, worker_ms=(time.perf_counter() - entered) * 1e3,
                padded_tokens=result.padded_tokens, real_tokens=result.real_tokens,
            ),
        )


    def _run(self, model: str, *args):
        """On the compute thread, so batches stopped after their caller left are counted too."""
        try:
            result = self.runner.run(model, *args)
        except DeadlineExceeded:
            EXPIRED.inc()
            raise
        BATCHES.labels(model).inc()
        return result


class Registration:
    """Registers with the resource manager, keeps the heartbeat key alive, deregisters on stop."""

    def __init__(self, config: cfg.WorkerConfig, runner: ModelRunner, worker_id: str) -> None:
        self.config, self.runner, self.worker_id = config, runner, worker_id
        self.keys = Keys(config.key_prefix)
        self.redis = connect(config.redis_url)
        self.address = ""
        self._stubs = Stubs(resource_manager_pb2_grpc.ResourceManagerStub)

    async def _rm_stub(self) -> resource_manager_pb2_grpc.ResourceManagerStub:
        """The resource manager's stub, its address from config or Redis; one channel per address."""
        target = self.config.resource_manager
        while not target:
            target = await self.redis.get(self.keys.resource_manager()) or ""
            if not target:
                await asyncio.sleep(0.2)
        return self._stubs(target)

    async def register(self, address: str) -> None:
        self.address = address
        stub = await self._rm_stub()
        models = [resource_manager_pb2.ModelSpec(name=s.name, kind=s.kind, labels=s.labels, dim=s.dim,
                                                 max_tokens=s.max_tokens) for s in self.runner.specs.values()]
        await stub.RegisterWorker(resource_manager_pb2.RegisterWorkerRequest(
            worker_id=self.worker_id, address=address, models=models, device=str(self.runner.device), capacity=1,
        ), timeout=10, wait_for_ready=True)
        log_event("registered", worker_id=self.worker_id, address=address, models=list(self.runner.specs))

    async def heartbeat(self) -> None:
        """Refreshes the TTL; re-registers when the key is gone (reaped, or Redis lost its data)."""
        ttl = self.config.heartbeat_ttl_s
        while True:
            await asyncio.sleep(ttl / 3)
            try:
                if not await self.redis.expire(self.keys.worker(self.worker_id), max(1, round(ttl))):
                    await self.register(self.address)
            except Exception as e:  # keep beating through Redis or RM restarts
                log_event("heartbeat_failed", error=repr(e))

    async def deregister(self) -> None:
        try:
            stub = await asyncio.wait_for(self._rm_stub(), 2)
            request = resource_manager_pb2.DeregisterWorkerRequest(worker_id=self.worker_id)
            await stub.DeregisterWorker(request, timeout=3)
        except Exception as e:  # the TTL removes us anyway
            log_event("deregister_failed", error=repr(e))
        await self.redis.aclose()


async def build() -> ServiceSpec:
    config = cfg.load(cfg.WorkerConfig)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    worker_id = config.worker_id or f"worker-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    runner = ModelRunner(Path(config.artifacts), [m for m in config.models.split(",") if m], config.device)
    servicer = WorkerServicer(runner, worker_id)
    registration = Registration(config, runner, worker_id)
    return ServiceSpec(
        name="worker",
        config=config,
        add_servicers=lambda server: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server),
        service_names=["academus.v1.Worker"],
        on_started=registration.register,
        on_stopping=registration.deregister,
        extra_tasks=[registration.heartbeat],
    )


def main() -> None:
    run(build)


if __name__ == "__main__":
    main()
