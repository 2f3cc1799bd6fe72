"""One served path, client SDK -> gateway -> scheduler -> worker, over real gRPC with the real model."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from academus.client import AcademusError, AsyncClient, Client
from academus.shared.models.plot.table import plot_tables
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.runtime.config import artifacts_dir
from academus.shared.runtime.metrics import scrape
from academus.shared.runtime.multiplex import MAX_FRAME_BYTES, WHOLE_PIECES
from academus.shared.runtime.tracing import read_traces
from academus.v1.inference_pb2 import InferRequest, TextInput
from tests.e2e.conftest import academus, metric, service

pytestmark = pytest.mark.e2e

TEXTS = ["Congratulations! You have won a free cruise, click here to claim your prize now!!!",
         "Hi Tom, the meeting moved to 3pm tomorrow, see you in room 204.",
         "A moving, beautifully acted film that stays with you.",
         "A tedious, lifeless mess with a script that makes no sense."]


def cli(mesh, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return academus(mesh.run_dir, *args, timeout=timeout)


def test_status_json_lists_every_service_healthy(mesh):
    out = cli(mesh, "status", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["redis"]["health"] == "SERVING"
    plot = ["plot"] if plot_tables(artifacts_dir()) else []   # started only when a PLOT table is built
    names = [s["name"] for s in report["services"]]
    assert sorted(n for n in names if not n.startswith("scheduler")) == sorted(
        ["adapter_store", "gateway", "resource_manager", "trainer", "worker-0", *plot])
    assert len([n for n in names if n.startswith("scheduler")]) == len(report["deployments"])
    assert all(s["health"] == "SERVING" and s["address"] for s in report["services"])


def test_cpu_workers_are_told_the_resource_managers_address(mesh):
    """Without GPUs the services start at once, so a worker is not left to find the resource manager in Redis
    (an earlier mesh on a shared Redis may have left its address there)."""
    manager = service(mesh, "resource_manager")
    workers = [s for s in mesh.services if s.service == "worker"]
    assert workers and all(w.env.get("ACADEMUS_RESOURCE_MANAGER") == manager.address for w in workers)


def test_cli_infer_prints_one_json_object_per_text(mesh):
    out = cli(mesh, "infer", "--model", "spam", TEXTS[0], TEXTS[1])
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["label"] for r in rows] == ["spam", "ham"]
    assert all(abs(sum(r["probs"].values()) - 1) < 1e-4 for r in rows)


def test_cli_embedding_output(mesh):
    out = cli(mesh, "infer", "--model", "minilm", "--output", "embedding", "hello world")
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["embedding"]) == 384


def test_cli_score_output_is_the_positive_class_probability(mesh):
    labelled = json.loads(cli(mesh, "infer", "--model", "spam", TEXTS[0]).stdout)
    out = cli(mesh, "infer", "--model", "spam", "--output", "score", TEXTS[0])
    assert out.returncode == 0, out.stderr
    scored = json.loads(out.stdout)
    assert set(scored) == {"text", "score"}
    assert scored["score"] == pytest.approx(labelled["probs"]["spam"], abs=1e-5)


def test_an_embedding_model_scores_text_pairs_by_the_cosine_of_their_embeddings(mesh, admin_key):
    """Pair scoring through the mesh: each score is the cosine of the two texts' embeddings as the model
    gives them alone, and a paraphrase scores above an unrelated sentence."""
    texts = ["A man is playing a guitar.", "A man is playing a guitar."]
    pairs = ["Someone strums an acoustic guitar.", "The stock market fell sharply today."]
    with Client(mesh.gateway, api_key=admin_key) as client:
        scored = client.infer("minilm", texts, pairs=pairs)
        embedded = client.infer("minilm", [texts[0], *pairs])
    a, b, c = (np.asarray(p.embedding) for p in embedded.predictions)
    cosine = [float(a @ x / np.linalg.norm(a) / np.linalg.norm(x)) for x in (b, c)]
    assert [p.score for p in scored.predictions] == pytest.approx(cosine, abs=1e-4)
    assert scored.predictions[0].score > 0.5 > scored.predictions[1].score
    out = cli(mesh, "infer", "--model", "minilm", texts[0], "--pair", pairs[0])
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["score"] == pytest.approx(cosine[0], abs=1e-4)


def test_the_null_model_answers_zeros_through_every_hop_and_refuses_as_a_model_does(mesh, admin_key):
    """`null` computes nothing: the stack alone (stack_bench). Its answers still come from a worker through a
    scheduler, and bad input gets the statuses a real model's gets."""
    def refusal(client: Client, model: str, texts: list[str], **kwargs) -> tuple[str, str]:
        with pytest.raises(AcademusError) as refused:
            client.infer(model, texts, **kwargs)
        return refused.value.code, refused.value.details

    bad = [([""], {}), (["hi"] * 65, {}), (["word " * 300], {"truncate": False})]
    with Client(mesh.gateway, api_key=admin_key) as client:
        result = client.infer("null", ["one", "two words"])
        paired = client.infer("null", ["a"], pairs=["b"])
        labelled = refusal(client, "null", ["hi"], output="label")
        null_refusals = [refusal(client, "null", texts, **kwargs) for texts, kwargs in bad]
        real_refusals = [refusal(client, "minilm", texts, **kwargs) for texts, kwargs in bad]
    assert [len(p.embedding) for p in result.predictions] == [384, 384]
    assert not any(any(p.embedding) for p in result.predictions) and result.predictions[1].num_tokens == 4
    assert result.metadata.worker_id and result.metadata.scheduler_id and result.metadata.batch_size >= 1
    assert paired.predictions[0].score == 0.0   # zero vectors: no direction, no similarity (and no NaN)
    assert labelled[0] == "INVALID_ARGUMENT" and "embedding model" in labelled[1]
    assert null_refusals == real_refusals and {code for code, _ in null_refusals} == {"INVALID_ARGUMENT"}


def test_the_largest_request_is_answered_with_each_texts_first_tokens(mesh, admin_key):
    """64 texts of 100,000 characters (6.4 MB): each is tokenized from its start, off the gateway's event loop, and
    answered cut at 256 tokens; a small request sent meanwhile is answered too."""
    texts = [f"text {i} " + "a fine film, " * 7691 for i in range(64)]
    assert {len(t) for t in texts} <= set(range(99_990, 100_001))
    with Client(mesh.gateway, api_key=admin_key) as client, ThreadPoolExecutor(2) as pool:
        large = pool.submit(client.infer, "null", texts)
        small = pool.submit(client.infer, "null", ["a fine film"])
        answered, alone = large.result(timeout=60), small.result(timeout=60)
    assert [(p.num_tokens, p.truncated) for p in answered.predictions] == [(256, True)] * 64
    assert (alone.predictions[0].num_tokens, alone.predictions[0].truncated) == (5, False)


def test_the_hops_of_one_node_ride_its_local_plane(mesh, admin_key):
    """The gateway's calls to the scheduler and the scheduler's to the worker move to their Unix sockets
    (shared/runtime/local_plane.py) once a first call has learnt them; nothing is refused on the way."""
    with Client(mesh.gateway, api_key=admin_key) as client:
        for _ in range(20):
            client.infer("null", ["warm"])
            time.sleep(0.05)
    for name in ("scheduler", "worker-0"):
        port = service(mesh, name).metrics_port
        assert metric(port, "academus_local_plane_connections") >= 1, name
        assert sum(s.value for s in scrape(port) if s.name == "academus_local_plane_refused_total") == 0, name


def test_a_text_pair_to_a_classifier_is_invalid_and_names_the_field(mesh, admin_key):
    with Client(mesh.gateway, api_key=admin_key) as client, pytest.raises(AcademusError) as refused:
        client.infer("spam", ["win money", "hi"], pairs=["now", "there"])
    assert refused.value.code == "INVALID_ARGUMENT"
    assert "inputs[0].text_pair: model 'spam' classifies single texts" in refused.value.details
    out = cli(mesh, "infer", "--model", "minilm", "a", "b", "--pair", "c")
    assert out.returncode == 2 and "--pair: 1 given for 2 texts" in out.stderr


async def test_tokenize_and_decode_give_the_models_own_tokens_both_ways(mesh, admin_key):
    """The gRPC API's Tokenize and Decode, sync and over the SDK's stream, and `academus tokenize`: the ids the model's
    tokenizer gives (the teacher's, for spam), with each token's text and offsets, untruncated; decoded back."""
    from tokenizers import Tokenizer

    library = Tokenizer.from_file(str(teacher_dir() / "tokenizer.json"))
    library.no_truncation()
    library.no_padding()
    long_text = "word " * 300   # past the model's 256 tokens: Infer refuses it untruncated, Tokenize counts it
    with Client(mesh.gateway, api_key=admin_key) as client:
        tokens = client.tokenize("spam", [TEXTS[0], long_text])
        bare = client.tokenize("spam", ["Hi there"], add_special_tokens=False)[0]
        decoded = client.decode("spam", [[t.id for t in tokens[0]], [7632]])
        framed = client.decode("spam", [[101, 7632, 102]], skip_special_tokens=False)
    assert [[t.id for t in text] for text in tokens] == [library.encode(TEXTS[0]).ids, library.encode(long_text).ids]
    assert len(tokens[1]) == 302 and (tokens[0][0].text, tokens[0][0].special, tokens[0][0].start) == ("[CLS]", True,
                                                                                                     None)
    assert all(t.text == TEXTS[0][t.start:t.stop] for t in tokens[0] if not t.special)
    assert [(t.text, t.start, t.stop) for t in bare] == [("Hi", 0, 2), ("there", 3, 8)]
    assert decoded == [library.decode(library.encode(TEXTS[0]).ids), "hi"] and framed == ["[CLS] hi [SEP]"]
    async with AsyncClient(mesh.gateway, api_key=admin_key, streams=True) as streamed:
        assert await streamed.tokenize("spam", [TEXTS[0]]) == tokens[:1]
        assert await streamed.decode("spam", [[7632]]) == ["hi"]
    out = cli(mesh, "tokenize", "--model", "spam", "Hi there", "--no-special-tokens")
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout)
    assert (line["text"], line["count"], [t["text"] for t in line["tokens"]]) == ("Hi there", 2, ["Hi", "there"])


@pytest.mark.parametrize(("key", "call", "code", "detail"), [
    (None, ("tokenize", ["hi"]), "UNAUTHENTICATED", "missing API key"),
    ("admin", ("tokenize", []), "INVALID_ARGUMENT", "texts is empty"),
    ("admin", ("tokenize", ["hi"] * 65), "INVALID_ARGUMENT", "texts has 65 entries; the limit is 64"),
    ("admin", ("decode", [[101, 30522]]), "INVALID_ARGUMENT", "texts[0].ids[1] is 30522: model 'spam'"),
    ("admin", ("decode", [[1]] * 65), "INVALID_ARGUMENT", "texts has 65 entries; the limit is 64"),
    ("admin", ("decode", []), "INVALID_ARGUMENT", "texts is empty"),
    ("admin", ("decode", [[1] * 4097] * 32), "INVALID_ARGUMENT", "texts hold 131104 ids; a request holds at most"),
    ("admin", ("tokenize", ["a." * 2000] * 40), "INVALID_ARGUMENT", "texts: the first 34 texts hold 136068 tokens"),
])
def test_tokenize_and_decode_refuse_bad_input_naming_the_field(mesh, admin_key, key, call, code, detail):
    method, arg = call
    with Client(mesh.gateway, api_key=admin_key if key == "admin" else key) as client, \
            pytest.raises(AcademusError) as info:
        getattr(client, method)("spam", arg)
    assert info.value.code == code and detail in info.value.details, info.value.details


def test_cli_refuses_a_timeout_that_is_not_positive(mesh):
    out = cli(mesh, "infer", "--model", "spam", "--timeout", "0", "hi")
    assert out.returncode == 2 and "--timeout: must be more than 0 seconds, got 0" in out.stderr


def test_sentiment_head_separates_fresh_and_rotten(mesh, admin_key):
    with Client(mesh.gateway, api_key=admin_key) as client:
        result = client.infer("sentiment", TEXTS[2:])
    assert [p.label for p in result.predictions] == ["fresh", "rotten"]
    assert result.metadata.policy == "fifo" and result.metadata.batch_size == 2
    assert result.metadata.compute_ms > 0 and result.metadata.student_count == 1


def test_served_embeddings_match_sentence_transformers(mesh, admin_key):
    from sentence_transformers import SentenceTransformer

    texts = [*TEXTS, "short", "word " * 400]  # the last one is truncated at 256 tokens, as ST does
    with Client(mesh.gateway, api_key=admin_key) as client:
        served = client.infer("minilm", texts, "embedding").predictions
    reference = SentenceTransformer(str(teacher_dir()), device="cpu").encode(texts, normalize_embeddings=True)
    for got, want in zip(served, reference, strict=True):
        cosine = sum(a * b for a, b in zip(got.embedding, want, strict=True))
        assert cosine >= 0.9999
    assert served[-1].truncated and served[-1].num_tokens == 256


async def test_async_client_concurrent_requests(mesh, admin_key):
    import asyncio

    async with AsyncClient(mesh.gateway, api_key=admin_key) as client:
        results = await asyncio.gather(*(client.infer("spam", [t]) for t in TEXTS))
    assert [len(r.predictions) for r in results] == [1, 1, 1, 1]


async def test_a_streams_client_gets_the_same_answers_and_refusals_as_unary_calls(mesh, admin_key):
    """AsyncClient(streams=True): every call a frame of one multiplexed stream to the gateway; the mesh's own
    hops ride such streams too (ACADEMUS_HOP_STREAMS, on by default)."""
    gateway, scheduler, worker = (service(mesh, n) for n in ("gateway", "scheduler", "worker-0"))

    def in_pieces() -> list[float]:
        return [metric(gateway.metrics_port, "academus_multiplexed_replies_in_pieces_total",
                       method="/academus.v1.Inference/Infer"),
                metric(scheduler.metrics_port, "academus_multiplexed_replies_in_pieces_total",
                       method="/academus.v1.Scheduler/Schedule")]

    def framed() -> list[float]:
        return [metric(gateway.metrics_port, "academus_multiplexed_calls_total", method="/academus.v1.Inference/Infer"),
                metric(scheduler.metrics_port, "academus_multiplexed_calls_total",
                       method="/academus.v1.Scheduler/Schedule"),
                metric(worker.metrics_port, "academus_multiplexed_calls_total", method="/academus.v1.Worker/Run")]

    before, pieces_before = framed(), in_pieces()
    async with AsyncClient(mesh.gateway, api_key=admin_key) as unary, \
            AsyncClient(mesh.gateway, api_key=admin_key, streams=True) as streams:
        expected = await asyncio.gather(*(unary.infer("spam", [t]) for t in TEXTS))
        served = await asyncio.gather(*(streams.infer("spam", [t]) for t in TEXTS))
        with pytest.raises(AcademusError) as too_many:
            await streams.infer("spam", ["hi"] * 65)
        long_texts = [f"{t} " * 60 for t in TEXTS] * 9   # past MAX_FRAME_BYTES: a unary call of its own
        assert len(InferRequest(inputs=[TextInput(text=t) for t in long_texts]).SerializeToString()) > MAX_FRAME_BYTES
        # 27 long mails on the teacher: past the client's default 10 s when other work shares the two cores
        long_unary = await unary.infer("spam", long_texts, timeout=60)
        long_streams = await streams.infer("spam", long_texts, timeout=60)
        many = [f"{t} {i}" for i, t in enumerate(TEXTS * 16)][:64]   # 64 embeddings: past one frame, under four
        embedded_unary, embedded_streams = await unary.infer("minilm", many), await streams.infer("minilm", many)
    assert [p.label for p in long_streams.predictions] == [p.label for p in long_unary.predictions]
    assert [r.predictions[0].label for r in served] == [r.predictions[0].label for r in expected]
    assert MAX_FRAME_BYTES < 4 * sum(len(p.embedding) for p in embedded_streams.predictions) \
        < WHOLE_PIECES * MAX_FRAME_BYTES   # float32 each
    assert len(embedded_streams.predictions) == 64 and all(
        np.allclose(a.embedding, b.embedding, atol=1e-5)
        for a, b in zip(embedded_streams.predictions, embedded_unary.predictions, strict=True))
    gateway_pieces, scheduler_pieces = (a - b for a, b in zip(in_pieces(), pieces_before, strict=True))
    assert gateway_pieces == scheduler_pieces == 0   # a reply of a few pieces goes whole (pieces: test_multiplex)
    assert too_many.value.code == "INVALID_ARGUMENT" and "the limit is 64" in too_many.value.details
    async with AsyncClient(mesh.gateway, api_key="wrong", streams=True) as stranger:
        with pytest.raises(AcademusError) as refused:
            await stranger.infer("spam", ["hi"])
    assert refused.value.code == "UNAUTHENTICATED" and "invalid API key" in refused.value.details
    gateway_frames, scheduler_frames, worker_frames = (a - b for a, b in zip(framed(), before, strict=True))
    assert gateway_frames == len(TEXTS) + 3   # the streams client's small calls: the refused two, the 64 texts
    assert scheduler_frames >= 2 * len(TEXTS) and worker_frames >= 1  # both clients' requests; batches merge
    # frames waiting for the stream together ride one message, once the gateway's headers say it reads them
    batched = metric(gateway.metrics_port, "academus_multiplexed_batched_frames_total", direction="calls")
    async with AsyncClient(mesh.gateway, api_key=admin_key, streams=True) as batching:
        await batching.infer("spam", [TEXTS[0]])
        again = await asyncio.gather(*(batching.infer("spam", [t]) for t in TEXTS))
    assert [r.predictions[0].label for r in again] == [r.predictions[0].label for r in expected]
    assert metric(gateway.metrics_port, "academus_multiplexed_batched_frames_total",
                  direction="calls") - batched == len(TEXTS)


@pytest.mark.parametrize(("key", "texts", "kwargs", "code", "detail"), [
    (None, ["hi"], {}, "UNAUTHENTICATED", "missing API key"),
    ("wrong", ["hi"], {}, "UNAUTHENTICATED", "invalid API key"),
    ("admin", [""], {}, "INVALID_ARGUMENT", "inputs[0].text is empty"),
    ("admin", ["hi"] * 65, {}, "INVALID_ARGUMENT", "the limit is 64"),
    ("admin", ["word " * 300], {"truncate": False}, "INVALID_ARGUMENT", "the limit is 256 tokens"),
    ("admin", ["hi", "word " * 20_000], {"truncate": False}, "INVALID_ARGUMENT",
     "inputs[1].text has at least 821 tokens; the limit is 256 tokens"),
    ("admin", ["hi"], {"model": "nope"}, "NOT_FOUND", "model 'nope' not found"),
    ("admin", ["hi"], {"model": "minilm", "output": "label"}, "INVALID_ARGUMENT", "embedding model"),
])
def test_bad_input_gets_a_clear_status(mesh, admin_key, key, texts, kwargs, code, detail):
    kwargs = {"model": "spam", **kwargs}
    model = kwargs.pop("model")
    with Client(mesh.gateway, api_key=admin_key if key == "admin" else key) as client, \
            pytest.raises(AcademusError) as info:
        client.infer(model, texts, **kwargs)
    assert info.value.code == code and detail in info.value.details


def test_cli_failure_exits_non_zero_with_status_name(mesh):
    out = cli(mesh, "infer", "--model", "spam", "--key", "wrong", "hi")
    assert out.returncode != 0 and out.stdout.strip() == "UNAUTHENTICATED"
    out = cli(mesh, "infer", "--model", "nope", "hi")
    assert out.returncode != 0 and out.stdout.strip() == "NOT_FOUND"


def test_invalid_utf8_is_invalid_argument_naming_the_message_and_the_gateway_survives(mesh, admin_key):
    import grpc

    from academus.v1 import inference_pb2

    raw = inference_pb2.InferRequest(model="spam").SerializeToString() + b"\x12\x04\x0a\x02\xff\xfe"
    with grpc.insecure_channel(mesh.gateway) as ch:
        call = ch.unary_unary("/academus.v1.Inference/Infer", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            call(raw, timeout=5, metadata=(("x-api-key", admin_key),))
    # parsed by the edge, not grpc (which says UNKNOWN): the caller's fault, named; the gateway keeps serving
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "academus.v1.InferRequest" in info.value.details() and "bad UTF-8" in info.value.details()
    with Client(mesh.gateway, api_key=admin_key) as client:
        assert client.infer("spam", ["still serving"]).predictions


def test_every_service_froze_its_start_up_heap_and_times_its_collections(mesh, admin_key):
    """A full collection walking the worker's loaded models stalled every request it held; frozen at
    start, they are out of the collector's walk, and the pauses that remain are on /metrics."""
    with Client(mesh.gateway, api_key=admin_key) as client:
        for text in TEXTS * 5:
            client.infer("sentiment", [text])
    frozen = {s.name: metric(s.metrics_port, "academus_gc_frozen_objects_total", service=s.name.split("-")[0])
              for s in mesh.services if s.metrics_port > 0}
    assert all(count > 10_000 for count in frozen.values()), frozen
    assert frozen["worker-0"] > frozen["gateway"], "the worker holds the models: the most objects to freeze"
    collections = sum(metric(service(mesh, "worker-0").metrics_port, "academus_gc_pause_seconds_count",
                             service="worker", generation=str(g)) for g in range(3))
    assert collections > 0, "serving 20 requests allocates enough for the collector to run, and be timed"


def test_every_service_times_its_event_loop(mesh, admin_key):
    """A hold-up of a service's loop delays every call it holds; each service's timer lateness is on /metrics."""
    with Client(mesh.gateway, api_key=admin_key) as client:
        client.infer("sentiment", TEXTS[:1])
    late = {s.name: metric(s.metrics_port, "academus_event_loop_lag_seconds_count", service=s.name.split("-")[0])
            for s in mesh.services if s.metrics_port > 0}
    assert late and all(count > 0 for count in late.values()), late


def test_the_design_metrics_are_on_the_scheduler_and_worker_endpoints(mesh, admin_key):
    """DESIGN §6 after requests: queue wait, batch size and padding ratio, cache hits (the student number:
    test_default_deployments.py, whose mesh has a student group)."""
    scheduler, worker = service(mesh, "scheduler").metrics_port, service(mesh, "worker-0").metrics_port
    with Client(mesh.gateway, api_key=admin_key) as client:
        client.infer("spam", TEXTS[:2])   # two texts of different lengths: one padded batch
    assert metric(scheduler, "academus_scheduler_queue_wait_seconds_count", policy="fifo", model="spam") >= 1
    assert metric(worker, "academus_worker_batch_size_texts_sum", model="spam") >= 2
    assert metric(worker, "academus_worker_padding_ratio_sum", model="spam") > 0
    names = {s.name for s in scrape(worker) if s.labels.get("cache") == "adapter"}
    assert names >= {"academus_cache_hits_total", "academus_cache_misses_total"}


def test_expired_request_is_answered_and_never_computed(mesh, admin_key):
    worker = service(mesh, "worker-0")
    scheduler = service(mesh, "scheduler")
    long_batch = [f"{i} " + "the quick brown fox jumps over the lazy dog " * 40 for i in range(64)]
    before = metric(worker.metrics_port, "academus_worker_batches_total", model="spam")
    results: list = []

    def occupy() -> None:
        with Client(mesh.gateway, api_key=admin_key, timeout=60) as c:
            results.append(c.infer("spam", long_batch))

    thread = threading.Thread(target=occupy)
    thread.start()
    time.sleep(0.5)  # the long batch is now running on the only worker
    with Client(mesh.gateway, api_key=admin_key) as client:
        start = time.monotonic()
        with pytest.raises(AcademusError) as info:
            client.infer("spam", ["queued behind the long batch"], timeout=0.3)
        waited = time.monotonic() - start
    thread.join()
    assert info.value.code == "DEADLINE_EXCEEDED" and waited < 2.0
    assert results and len(results[0].predictions) == 64
    time.sleep(1.0)
    after = metric(worker.metrics_port, "academus_worker_batches_total", model="spam")
    assert after - before == 1, "the expired request must not be computed"
    dropped = metric(scheduler.metrics_port, "academus_scheduler_dropped_total", reason="cancelled") + metric(
        scheduler.metrics_port, "academus_scheduler_dropped_total", reason="expired")
    assert dropped >= 1


def test_deadline_shorter_than_the_work_stops_the_forward_pass(mesh, admin_key):
    worker = service(mesh, "worker-0")
    long_batch = [f"{i} " + "every layer of this batch takes a while on a small CPU " * 40 for i in range(64)]
    batches = metric(worker.metrics_port, "academus_worker_batches_total", model="spam")
    expired = metric(worker.metrics_port, "academus_worker_expired_total")
    with Client(mesh.gateway, api_key=admin_key) as client, pytest.raises(AcademusError) as info:
        client.infer("spam", long_batch, timeout=0.4)
    assert info.value.code == "DEADLINE_EXCEEDED"
    end = time.monotonic() + 10
    while metric(worker.metrics_port, "academus_worker_expired_total") == expired and time.monotonic() < end:
        time.sleep(0.1)
    assert metric(worker.metrics_port, "academus_worker_expired_total") == expired + 1
    assert metric(worker.metrics_port, "academus_worker_batches_total", model="spam") == batches


async def test_a_caller_that_leaves_stops_the_forward_pass_downstream(mesh, admin_key):
    """Cancelled at the client while the worker computes: gateway, scheduler and worker calls are cancelled
    in turn, and the worker stops the batch between layers rather than finishing it for nobody."""
    worker = service(mesh, "worker-0")
    long_batch = [f"{i} " + "every layer of this batch takes a while on a small CPU " * 40 for i in range(64)]
    batches = metric(worker.metrics_port, "academus_worker_batches_total", model="spam")
    abandoned = metric(worker.metrics_port, "academus_worker_abandoned_total")
    async with AsyncClient(mesh.gateway, api_key=admin_key) as client:
        call = asyncio.create_task(client.infer("spam", long_batch, timeout=60))
        end = time.monotonic() + 30
        while metric(worker.metrics_port, "academus_rpc_in_flight", service="worker", method="Run") < 1:
            assert time.monotonic() < end and not call.done(), "the batch never reached the worker"
            await asyncio.sleep(0.02)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    end = time.monotonic() + 20
    while metric(worker.metrics_port, "academus_worker_abandoned_total") == abandoned and time.monotonic() < end:
        await asyncio.sleep(0.1)
    assert metric(worker.metrics_port, "academus_worker_abandoned_total") == abandoned + 1
    assert metric(worker.metrics_port, "academus_worker_batches_total", model="spam") == batches


def test_one_trace_spans_gateway_scheduler_and_worker(mesh, admin_key, otlp):
    """Exported both over OTLP (a real receiver) and to the run directory's JSON-lines file."""
    with Client(mesh.gateway, api_key=admin_key) as client:
        client.infer("spam", ["trace me"], request_id="trace-probe")
    wanted = {"academus-gateway", "academus-scheduler", "academus-worker"}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        by_trace: dict[str, set[str]] = {}
        for trace_id, service_name, _ in otlp.spans:
            by_trace.setdefault(trace_id, set()).add(service_name)
        in_file = read_traces([f"{mesh.run_dir}/traces.jsonl"])
        complete = [t for t, names in by_trace.items() if wanted <= names]
        if complete and any(wanted <= {s["service"] for s in in_file.get(t, [])} for t in complete):
            break
        time.sleep(0.3)
    else:
        raise AssertionError(f"no trace with spans from all three services; OTLP got {by_trace}")
    spans = [name for t, _, name in otlp.spans if t == complete[-1]]
    assert "/academus.v1.Inference/Infer" in spans and "/academus.v1.Worker/Run" in spans


def test_loadgen_compare_writes_report_and_plots(mesh, tmp_path):
    out = tmp_path / "lg"
    proc = cli(mesh, "loadgen", "compare", "--runs", "spam,minilm", "--schedule", "poisson:8", "--duration", "3",
               "--texts", "task:spam", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert json.loads((out / "report.json").read_text()) == report
    spam, minilm = report["runs"]
    assert spam["sent"] == minilm["sent"] > 5 and spam["completed"] == spam["sent"] and not spam["errors"]
    assert spam["accuracy"] is not None and spam["accuracy"] > 0.5 and minilm["accuracy"] is None
    assert spam["policy"] == "fifo" and spam["latency_ms"]["p50"] > 0
    assert report["ratios_vs_first"][0]["vs"] == "spam:fifo"
    assert (out / "latency_cdf.png").stat().st_size > 1000 and (out / "timeline_0_spam.png").exists()


def test_loadgen_closed_loop_keeps_n_callers_busy(mesh, tmp_path):
    """`closed:N` (capacity): N callers each send their next text when the last is answered, so every
    request is answered and none expires."""
    out = tmp_path / "closed"
    proc = cli(mesh, "loadgen", "run", "--model", "spam", "--schedule", "closed:3", "--duration", "2",
               "--texts", "task:spam", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    run = json.loads(proc.stdout.splitlines()[-1])["runs"][0]
    assert run["concurrency"] == 3 and run["offered_rps"] is None
    assert run["completed"] == run["sent"] > 3 and not run["errors"]
    assert run["throughput_rps"] > 0 and run["accuracy"] > 0.5


def test_loadgen_procs_share_one_schedule_and_merge_into_one_run(mesh, tmp_path):
    """--procs 2: two processes send the schedule's requests between them, each with the text one process
    would have sent; the report is one run over all of them."""
    from academus.loadgen import schedule

    proc = cli(mesh, "loadgen", "run", "--model", "spam", "--schedule", "poisson:12", "--duration", "3",
               "--texts", "task:spam", "--procs", "2", "--out", str(tmp_path / "open"))
    assert proc.returncode == 0, proc.stderr
    run = json.loads(proc.stdout.splitlines()[-1])["runs"][0]
    assert run["sent"] == len(schedule.parse("poisson:12", 3, 0)) == run["completed"] and not run["errors"]
    assert run["accuracy"] > 0.5 and sum(b["completed"] for b in run["timeline"]) == run["completed"]
    proc = cli(mesh, "loadgen", "run", "--model", "spam", "--schedule", "closed:3", "--duration", "2",
               "--texts", "task:spam", "--procs", "2", "--out", str(tmp_path / "closed"))
    assert proc.returncode == 0, proc.stderr
    run = json.loads(proc.stdout.splitlines()[-1])["runs"][0]
    assert run["concurrency"] == 3 and run["completed"] == run["sent"] > 3 and not run["errors"]


def test_every_server_offers_reflection_and_health(mesh):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    expected = {"gateway": "academus.v1.Inference", "scheduler": "academus.v1.Scheduler",
                "worker-0": "academus.v1.Worker", "resource_manager": "academus.v1.ResourceManager",
                "adapter_store": "academus.v1.AdapterStore", "trainer": "grpc.health.v1.Health"}
    if plot_tables(artifacts_dir()):
        expected["plot"] = "academus.v1.Plot"
    for name, service_name in expected.items():
        with grpc.insecure_channel(service(mesh, name).address) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                timeout=5)
            listed = {s.name for r in replies for s in r.list_services_response.service}
        assert {service_name, "grpc.health.v1.Health"} <= listed, (name, listed)


@pytest.mark.parametrize("name", ["scheduler", "worker-0", "resource_manager", "adapter_store"])
def test_internal_services_refuse_a_caller_outside_the_mesh(mesh, admin_key, name):
    """`academus up` gives its services a token; a process that has not got it cannot name a tenant to a scheduler
    or run a batch on a worker (the gateway, which takes the tenant from the API key, is the way in)."""
    from academus.v1 import (
        adapter_store_pb2,
        adapter_store_pb2_grpc,
        resource_manager_pb2,
        resource_manager_pb2_grpc,
        scheduler_pb2,
        scheduler_pb2_grpc,
        worker_pb2,
        worker_pb2_grpc,
    )

    calls = {"scheduler": lambda ch: scheduler_pb2_grpc.SchedulerStub(ch).Schedule(
                 scheduler_pb2.ScheduleRequest(model="minilm", tenant="someone-else"), timeout=5),
             "worker-0": lambda ch: worker_pb2_grpc.WorkerStub(ch).Run(worker_pb2.RunRequest(), timeout=5),
             "resource_manager": lambda ch: resource_manager_pb2_grpc.ResourceManagerStub(ch).ListPlacements(
                 resource_manager_pb2.ListPlacementsRequest(), timeout=5),
             "adapter_store": lambda ch: adapter_store_pb2_grpc.AdapterStoreStub(ch).List(
                 adapter_store_pb2.ListAdaptersRequest(tenant="someone-else"), timeout=5)}
    assert mesh.mesh_token and all(s.env["ACADEMUS_MESH_TOKEN"] == mesh.mesh_token for s in mesh.services)
    with grpc.insecure_channel(service(mesh, name).address) as ch, pytest.raises(grpc.RpcError) as refused:
        calls[name](ch)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "academus-mesh-token" in refused.value.details()
    with Client(mesh.gateway, api_key=admin_key) as client:   # the mesh's own calls carry it
        assert client.infer("sentiment", ["still served"]).predictions[0].label in ("fresh", "rotten")
