"""The SDK traces its calls only where the process has a tracer provider, over real gRPC on loopback. Without one,
no interceptor runs and no trace context is sent; once one is set (for the blocking client, even after it was
made), every call's CLIENT span is the parent the server is sent, unary or a multiplexed stream's frame.

Each client runs in a process of its own: OpenTelemetry lets a process set its tracer provider once."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import grpc
import pytest

from academus.shared.runtime.multiplex import serve_multiplexed
from academus.v1 import inference_pb2 as pb
from academus.v1 import inference_pb2_grpc

# The client's side: the blocking client made first, then (with "set") a provider with an in-memory exporter, then
# one call of each kind. It prints the trace ids of the CLIENT spans it exported.
CLIENT = """
import asyncio, json, sys
from academus.client import AsyncClient, Client

target, provider = sys.argv[1], sys.argv[2]
blocking = Client(target)
exporter = None
if provider == "set":
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(tracer_provider)
blocking.infer("spam", ["a"], request_id="blocking")
blocking.close()

async def both():
    for streams in (False, True):
        async with AsyncClient(target, streams=streams) as client:
            await client.infer("spam", ["a"], request_id="streams" if streams else "unary")
            await asyncio.sleep(0.05)   # a unary CLIENT span ends on the call's status, a task later

asyncio.run(both())
spans = exporter.get_finished_spans() if exporter else []
print(json.dumps(sorted(f"{s.context.trace_id:032x}" for s in spans if s.kind.name == "CLIENT")))
"""


class Recorder(inference_pb2_grpc.InferenceServicer):
    """Each call's trace context, by request id."""

    def __init__(self) -> None:
        self.contexts: dict[str, str | None] = {}

    async def Infer(self, request, context):
        self.contexts[request.request_id] = dict(context.invocation_metadata()).get("traceparent")
        return pb.InferResponse(model=request.model)


@pytest.fixture
async def recorder():
    servicer = Recorder()
    server = grpc.aio.server()
    serve_multiplexed(server, lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(servicer, s))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(None)


async def client_run(target: str, provider: str) -> list[str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, target, provider,
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return json.loads(out.decode().splitlines()[-1])


async def test_without_a_tracer_provider_no_call_sends_a_trace_context(recorder):
    servicer, target = recorder
    assert await client_run(target, "none") == []
    assert servicer.contexts == {"blocking": None, "unary": None, "streams": None}


async def test_with_a_tracer_provider_every_call_is_its_client_spans_child(recorder):
    servicer, target = recorder
    traces = await client_run(target, "set")
    assert set(servicer.contexts) == {"blocking", "unary", "streams"}
    sent = sorted(context.split("-")[1] for context in servicer.contexts.values())   # version-trace-span-flags
    assert sent == traces and len(set(traces)) == 3
