"""Early exits (Apparate) through the real mesh: ramps trained by `academus ramps train --quick`, released by the
worker inside the teacher's forward, carried as partial replies over both hops, streamed by `InferStream`
(SDK and `academus infer --stream`) and answered early by unary `Infer(early_exit)`. The final answer equals
the plain `Infer`'s; a model without ramps, or with a malformed ramps artifact, answers the final message only;
a client that leaves a stream stops the batch."""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from academus.client import AsyncClient, Client
from academus.loadgen import exits_live
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshState, down
from academus.shared.models.user_models import add_model
from academus.shared.runtime.config import artifacts_dir
from academus.shared.state.catalogue import read_catalogue, write_entry
from academus.shared.training.data import load_task
from tests.conftest import write_texts
from tests.e2e.conftest import academus, metric, service, start_mesh, wait_for
from tests.e2e.test_http_api import call
from tests.models import tiny_model_dir

pytestmark = pytest.mark.e2e

TEXTS = ["Congratulations! You have won a free cruise, click here to claim your prize now",
         "Hi Bob, the meeting moved to 3pm; the agenda is attached", "cheap meds online, no prescription needed",
         "Can you send me the slides from yesterday?"]


@pytest.fixture(scope="module")
def exit_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshState]:
    """spam with quick ramps, sentiment with a corrupted ramps artifact, minilm without; PABEE patience 2 (every
    text whose first two ramps agree is released at layer 2), so that early answers come for sure."""
    artifacts = tmp_path_factory.mktemp("artifacts")
    catalogue = read_catalogue(artifacts_dir())
    for name in ("minilm", "spam", "sentiment"):
        write_entry(artifacts, name, catalogue[name])
    for task in ("spam", "sentiment"):
        shutil.copytree(artifacts_dir() / "heads" / task, artifacts / "heads" / task)
    trained = academus(tmp_path_factory.mktemp("unused"), "ramps", "train", "--task", "spam", "--quick",
                       "--artifacts", artifacts)
    assert trained.returncode == 0, trained.stderr[-2000:]
    summary = json.loads(trained.stdout.strip().splitlines()[-1])
    assert summary["layers"] == [1, 2, 3, 4, 5] and set(summary["agreement"]) == {"1", "2", "3", "4", "5"}
    # sentiment's ramps are refused by their checksum before anything else is read, so spam's copy will do
    shutil.copytree(artifacts / "ramps" / "spam", artifacts / "ramps" / "sentiment")
    weights = artifacts / "ramps" / "sentiment" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64] + b"\0" * 64)   # corrupt: its sha256 no longer matches
    run_dir = tmp_path_factory.mktemp("run")
    state = start_mesh(run_dir, deployments=[Deployment("padded")], artifacts=artifacts,
                       env={"ACADEMUS_EXIT_POLICY": "pabee2"}, http_port=0)
    yield state
    down(run_dir)


@pytest.fixture(scope="module")
def client(exit_mesh: MeshState) -> Iterator[Client]:
    key = (Path(exit_mesh.run_dir) / ADMIN_KEY_FILE).read_text().strip()
    with Client(exit_mesh.gateway, api_key=key, timeout=60) as c:
        yield c


def test_stream_sends_early_results_then_the_exact_final_answer(client: Client) -> None:
    results = list(client.infer_stream("spam", TEXTS))
    *early, final = results
    assert early, "no early result: every text was answered by the full model only"
    for result in early:
        assert all(not p.final and 1 <= p.exit_layer <= 5 for p in result.predictions)
    released = [p.input_index for r in early for p in r.predictions]
    assert len(released) == len(set(released)), "a text was released twice"
    assert [p.input_index for p in final.predictions] == list(range(len(TEXTS)))
    assert all(p.final and p.exit_layer == 0 for p in final.predictions)
    exact = client.infer("spam", TEXTS)
    for streamed, plain in zip(final.predictions, exact.predictions, strict=True):
        assert streamed.label == plain.label
        np.testing.assert_allclose(list(streamed.probs.values()), list(plain.probs.values()), atol=1e-5)


def test_unary_early_exit_answers_every_text_once(client: Client) -> None:
    result = client.infer("spam", TEXTS, early_exit=True)
    assert sorted(p.input_index for p in result.predictions) == list(range(len(TEXTS)))
    early = [p for p in result.predictions if not p.final]
    assert early and all(1 <= p.exit_layer <= 5 for p in early)
    assert all(p.label in ("ham", "spam") and abs(sum(p.probs.values()) - 1) < 1e-4 for p in result.predictions)


def test_http_early_exit_answers_every_input_and_names_the_layer_that_released_it(exit_mesh: MeshState) -> None:
    """TEI's `/predict` with `"early_exit": true`: every input answered, its releasing layer in
    `x-academus-exit-layers` (0: the full model); without it, the exact answer and no such header."""
    key = (Path(exit_mesh.run_dir) / ADMIN_KEY_FILE).read_text().strip()
    inputs = [[text] for text in TEXTS]
    status, predicted, headers = call(exit_mesh, "/predict", {"inputs": inputs, "model": "spam", "early_exit": True},
                                      key)
    assert status == 200 and len(predicted) == len(TEXTS), predicted
    layers = [int(layer) for layer in {k.lower(): v for k, v in headers.items()}["x-academus-exit-layers"].split(",")]
    assert len(layers) == len(TEXTS) and all(0 <= layer <= 5 for layer in layers) and max(layers) >= 1, layers
    for scores in predicted:
        assert {s["label"] for s in scores} == {"ham", "spam"} and sum(s["score"] for s in scores) == pytest.approx(1)
    status, exact, headers = call(exit_mesh, "/predict", {"inputs": inputs, "model": "spam"}, key)
    assert status == 200 and "x-academus-exit-layers" not in {k.lower() for k in headers}
    with Client(exit_mesh.gateway, api_key=key) as grpc_client:
        served = grpc_client.infer("spam", TEXTS).predictions
    assert [scores[0]["label"] for scores in exact] == [p.label for p in served]


def test_loadgen_asks_for_early_exits_over_grpc_and_http_and_counts_the_layers_that_released(
        exit_mesh: MeshState, tmp_path: Path) -> None:
    """`academus loadgen compare --runs spam,spam+early-exit` (gRPC) and `run --early-exit` to the HTTP port: every
    request answered, the early-exit run's report counting each layer's releases (PABEE 2 from layer 2 on), the
    plain run's none."""
    key = (Path(exit_mesh.run_dir) / ADMIN_KEY_FILE).read_text().strip()
    # an open loop below capacity: a saturated worker (a closed loop's) stands its ramps down
    load = ("--schedule", "poisson:6", "--duration", "3", "--texts", "task:spam", "--out", tmp_path)
    compared = academus(exit_mesh.run_dir, "loadgen", "compare", "--runs", "spam:padded,spam:padded+early-exit", *load)
    assert compared.returncode == 0, compared.stderr[-2000:]
    report = json.loads(compared.stdout.strip().splitlines()[-1])
    plain, early = report["runs"]
    over_http = academus(exit_mesh.run_dir, "loadgen", "run", "--model", "spam", "--early-exit", "--key", key,
                         "--gateway", f"http://{exit_mesh.http}/predict", *load)
    assert over_http.returncode == 0, over_http.stderr[-2000:]
    http_early = json.loads(over_http.stdout.strip().splitlines()[-1])["runs"][0]
    assert not plain["early_exit"] and "exits" not in plain and plain["completed"] == plain["sent"] > 2, plain
    for run in (early, http_early):
        assert run["early_exit"] and run["completed"] == run["sent"] > 2 and not run["errors"], run
        exits = run["exits"]
        assert sum(exits["exit_layers"].values()) == run["completed"], exits
        # PABEE 2 releases where two ramps in a row agree: at layer 2 most often, never at layer 1
        layers = {int(layer) for layer in exits["exit_layers"]}
        assert layers <= {0, 2, 3, 4, 5} and exits["exit_layers"].get("2", 0) > 0
        released = sum(n for layer, n in exits["exit_layers"].items() if layer != "0")
        assert exits["released_early"] == round(released / run["completed"], 4)
    assert report["ratios_vs_first"][0]["run"] == "spam:padded+early-exit"
    answers = report["ratios_vs_first"][0]["answers"]   # the same texts in both runs: every early answer compared
    assert answers["compared"] == early["completed"] and 0.5 < answers["agreement"] <= 1.0, answers
    assert "released early:" in compared.stdout and "answers agreeing with spam:padded's" in compared.stdout


def test_http_stream_sends_early_events_then_the_exact_final_answer(exit_mesh: MeshState, client: Client) -> None:
    """`/predict` with `"stream": true`: server-sent events as InferStream's messages, the final one exact."""
    key = (Path(exit_mesh.run_dir) / ADMIN_KEY_FILE).read_text().strip()
    request = urllib.request.Request(f"http://{exit_mesh.http}/predict", method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"}, data=json.dumps(
        {"inputs": [[text] for text in TEXTS], "model": "spam", "stream": True}).encode())
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert answer.headers["Content-Type"] == "text/event-stream"
        events = [json.loads(chunk.removeprefix("data: ")) for chunk in answer.read().decode().split("\n\n") if chunk]
    *early, final = events
    assert early, "no early event: every input was answered by the full model only"
    assert all(not e["final"] and 1 <= e["exit_layer"] <= 5 and e["predictions"] for e in early)
    released = [p["index"] for e in early for p in e["predictions"]]
    assert len(released) == len(set(released)) and set(released) <= set(range(len(TEXTS)))
    assert final["final"] and final["exit_layer"] == 0
    assert [p["index"] for p in final["predictions"]] == list(range(len(TEXTS)))
    exact = client.infer("spam", TEXTS).predictions
    for streamed, plain in zip(final["predictions"], exact, strict=True):
        assert streamed["scores"][0]["label"] == plain.label
        assert {s["label"]: s["score"] for s in streamed["scores"]} == pytest.approx(dict(plain.probs), abs=1e-5)


def test_a_saturated_worker_answers_streams_final_only_until_it_is_relieved(exit_mesh: MeshState,
                                                                          client: Client) -> None:
    """Closed loops of streams keep the worker's compute busy: once it counts as saturated, batches that ask for
    early exits run without ramps (final messages only, counted as stood down); once the load ends and the
    worker is relieved, early answers come again."""
    worker = service(exit_mesh, "worker-0").metrics_port
    key = (Path(exit_mesh.run_dir) / ADMIN_KEY_FILE).read_text().strip()
    stood_down = metric(worker, "academus_worker_exits_stood_down_total", model="spam")
    streams: list[int] = []   # messages a stream

    async def closed_loops(callers: int = 24, within_s: float = 60) -> None:
        stop, end = asyncio.Event(), time.monotonic() + within_s

        async def caller(c: AsyncClient) -> None:
            while not stop.is_set():
                streams.append(len([r async for r in c.infer_stream("spam", TEXTS, timeout=60)]))

        async with AsyncClient(exit_mesh.gateway, api_key=key, timeout=60) as c:
            loops = [asyncio.ensure_future(caller(c)) for _ in range(callers)]
            while time.monotonic() < end and await asyncio.to_thread(
                    metric, worker, "academus_worker_exits_stood_down_total", model="spam") < stood_down + 5:
                await asyncio.sleep(0.2)
            stop.set()
            await asyncio.gather(*loops)

    asyncio.run(closed_loops())
    assert metric(worker, "academus_worker_exits_stood_down_total", model="spam") >= stood_down + 5
    assert 1 in streams and max(streams) > 1   # early answers before saturation, final ones only during it
    wait_for(lambda: metric(worker, "academus_worker_compute_saturated") == 0, 15, "the worker to be relieved")
    assert len(list(client.infer_stream("spam", TEXTS))) > 1, "no early answer once the worker was relieved"


def test_models_without_ramps_answer_the_final_message_only(exit_mesh: MeshState, client: Client) -> None:
    for model in ("minilm", "sentiment"):   # no ramps; ramps refused as corrupt
        results = list(client.infer_stream(model, TEXTS[:2]))
        assert len(results) == 1 and all(p.final for p in results[0].predictions)
    assert len(client.infer("sentiment", TEXTS[:2], early_exit=True).predictions) == 2
    log = (Path(exit_mesh.run_dir) / "logs" / "worker-0.log").read_text()
    refusals = [line for line in log.splitlines() if "ramps_refused" in line]
    assert refusals and "weights.safetensors" in refusals[0] and "sentiment" in refusals[0]


def test_ramps_trained_on_a_running_mesh_serve_without_a_restart(exit_mesh: MeshState, client: Client) -> None:
    """`ramps train` replaces sentiment's corrupt ramps; the worker loads the new ones within seconds."""
    trained = academus(exit_mesh.run_dir, "ramps", "train", "--task", "sentiment", "--quick")
    assert trained.returncode == 0, trained.stderr[-2000:]

    def early() -> bool:
        results = list(client.infer_stream("sentiment", ["a gorgeous, moving film", "dull, long and loud"]))
        return len(results) > 1 and not results[0].predictions[0].final
    wait_for(early, 30, "sentiment's new ramps to release early results")
    log = (Path(exit_mesh.run_dir) / "logs" / "worker-0.log").read_text()
    assert any("ramps_loaded" in line and "sentiment" in line for line in log.splitlines())


def test_cli_infer_stream_prints_a_line_a_message_early_ones_first(exit_mesh: MeshState) -> None:
    done = academus(exit_mesh.run_dir, "infer", "--model", "spam", "--stream", *TEXTS, timeout=60)
    assert done.returncode == 0, done.stderr
    *early, final = [json.loads(line) for line in done.stdout.splitlines()]
    assert early and all(not m["final"] and m["exit_layer"] >= 1 and m["predictions"] for m in early)
    assert final["final"] and final["exit_layer"] == 0
    assert [p["text"] for p in final["predictions"]] == TEXTS
    assert all(p["label"] in ("ham", "spam") for m in early for p in m["predictions"])


def test_ramps_status_shows_the_workers_ramps(exit_mesh: MeshState, client: Client) -> None:
    client.infer("spam", TEXTS, early_exit=True)

    def published() -> bool:
        done = academus(exit_mesh.run_dir, "ramps", "status", timeout=30)
        status = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {}
        spam = next((models["spam"] for models in status.values() if "spam" in models), None)
        return spam is not None and spam["policy"] == "pabee2" and spam["active"] == [1, 2, 3, 4, 5]
    wait_for(published, 20, "the worker's ramps in Redis")


def test_the_live_bench_times_both_arms_and_splits_their_final_results(exit_mesh: MeshState) -> None:
    """`exits_live`'s open loop: every request answered; the early arm's first results come no later than its final
    ones, some earlier (PABEE 2 releases early for sure); the mean split of the final results adds up to their
    mean time. Its capacity loop says each process's CPU a request, the model's worker's the largest."""
    key = (Path(exit_mesh.run_dir) / ADMIN_KEY_FILE).read_text().strip()

    async def both() -> tuple[dict[str, dict], dict[str, tuple]]:
        async with AsyncClient(exit_mesh.gateway, api_key=key, timeout=60) as c:
            runs = {}
            for arm in exits_live.ARMS:
                before = exits_live.worker_counts(exit_mesh)
                runs[arm] = await exits_live.open_loop(c, arm, "spam", TEXTS, 4.0, 2.0, seed=0)
                after = exits_live.worker_counts(exit_mesh)
                runs[arm]["counts"] = {name: after[name] - before[name] for name in after}
            caps = {arm: await exits_live.capacity(c, arm, "spam", TEXTS, 2, 1.0, exit_mesh) for arm in exits_live.ARMS}
            return runs, caps

    runs, caps = asyncio.run(both())
    assert runs["vanilla"]["counts"]["exits"] == 0 < runs["early"]["counts"]["exits"]
    assert all(run["counts"]["batches"] > 0 for run in runs.values())
    for arm, (rps, cpu) in caps.items():
        assert rps > 0 and {"worker-0", "scheduler", "gateway", "loadgen"} <= set(cpu), (arm, cpu)
        assert cpu["worker-0"] == max(cpu.values()) > 0, (arm, cpu)
    for arm, run in runs.items():
        assert run["answered"] == run["sent"] == len(run["final_ms"]) > 0, arm
        split = run["final_split_mean_ms"]
        parts = sum(split[k] for k in ("network", "gateway", "scheduler_overhead", "queue", "worker_overhead",
                                       "compute"))
        assert parts == pytest.approx(np.mean(run["final_ms"]), rel=0.01), (arm, split)
        assert run["final_tail_split_mean_ms"]["answers"] >= 1
    early = runs["early"]
    assert all(f <= g for f, g in zip(early["first_ms"], early["final_ms"], strict=True))
    assert any(f < g for f, g in zip(early["first_ms"], early["final_ms"], strict=True))
    assert runs["vanilla"]["first_ms"] == runs["vanilla"]["final_ms"]


def test_a_client_leaving_the_stream_stops_the_batch(exit_mesh: MeshState, client: Client) -> None:
    worker = service(exit_mesh, "worker-0").metrics_port
    before = metric(worker, "academus_worker_abandoned_total")
    long_texts = [e.text for e in load_task("spam").test if len(e.text) > 2000][:48]
    for _ in client.infer_stream("spam", long_texts, timeout=60):
        break   # the first early answer is enough: the rest of the batch is nobody's
    wait_for(lambda: metric(worker, "academus_worker_abandoned_total") > before, 30,
             "the worker to stop the abandoned batch between layers")


def test_an_http_client_leaving_the_stream_stops_the_batch(exit_mesh: MeshState) -> None:
    """A streamed `/predict` whose client closes its connection after the first event: the batch stops, as a gRPC
    stream's does."""
    key = (Path(exit_mesh.run_dir) / ADMIN_KEY_FILE).read_text().strip()
    worker = service(exit_mesh, "worker-0").metrics_port
    wait_for(lambda: metric(worker, "academus_worker_compute_saturated") == 0, 15, "the worker to be relieved")
    before = metric(worker, "academus_worker_abandoned_total")
    long_texts = [e.text for e in load_task("spam").test if len(e.text) > 2000][:48]
    host, port = exit_mesh.http.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/predict", json.dumps({"inputs": [[t] for t in long_texts], "model": "spam",
                                                       "truncate": True, "stream": True}),
                       {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    answer = connection.getresponse()
    assert answer.status == 200
    first = answer.readline()   # the first event (its chunk decoded)
    assert first.startswith(b"data: ") and not json.loads(first[6:])["final"]
    connection.close()   # the first early answer is enough: the rest of the batch is nobody's
    wait_for(lambda: metric(worker, "academus_worker_abandoned_total") > before, 30,
             "the worker to stop the batch the HTTP client left")


def test_a_stream_over_the_sdks_multiplexed_stream_is_the_same_stream(exit_mesh: MeshState, client: Client) -> None:
    """`AsyncClient(streams=True)`: InferStream's messages ride the client's one multiplexed stream (partial replies,
    then the status); early results first, the same final answer as a call of its own; leaving stops the batch."""
    key = (Path(exit_mesh.run_dir) / ADMIN_KEY_FILE).read_text().strip()
    worker = service(exit_mesh, "worker-0").metrics_port
    long_texts = [e.text for e in load_task("spam").test if len(e.text) > 2000][:48]
    wait_for(lambda: metric(worker, "academus_worker_compute_saturated") == 0, 15, "the worker to be relieved")

    async def stream() -> tuple[list, float, float]:
        async with AsyncClient(exit_mesh.gateway, api_key=key, timeout=60, streams=True) as multiplexed:
            results = [r async for r in multiplexed.infer_stream("spam", TEXTS)]
            framed = metric(service(exit_mesh, "gateway").metrics_port, "academus_multiplexed_calls_total",
                            method="/academus.v1.Inference/InferStream")
            abandoned = metric(worker, "academus_worker_abandoned_total")
            async for _ in multiplexed.infer_stream("spam", long_texts):
                break   # the first early answer is enough: the rest of the batch is nobody's
            return results, framed, abandoned

    (*early, final), framed, abandoned = asyncio.run(stream())
    assert framed >= 1, "the stream was a call of its own, not frames of the client's stream"
    assert early and all(not p.final and 1 <= p.exit_layer <= 5 for r in early for p in r.predictions)
    alone = list(client.infer_stream("spam", TEXTS))[-1]
    assert [p.label for p in final.predictions] == [p.label for p in alone.predictions]
    for multiplexed, own in zip(final.predictions, alone.predictions, strict=True):
        np.testing.assert_allclose(list(multiplexed.probs.values()), list(own.probs.values()), atol=1e-5)
    wait_for(lambda: metric(worker, "academus_worker_abandoned_total") > abandoned, 30,
             "the worker to stop the batch its multiplexed stream left")


def test_a_users_classifier_gets_ramps_on_a_running_mesh(exit_mesh: MeshState, client: Client,
                                                         tmp_path: Path) -> None:
    """A user's sequence classifier (a tiny BERT, its own nonlinear head) added to the running mesh; `ramps train
    --model --data` fits ramps after its own layers on the user's texts, and the worker releases early answers from
    them within seconds, the final answer unchanged."""
    tiny_model_dir("bert", True, tmp_path / "cls", seed=8)
    add_model(Path(exit_mesh.artifacts), "user-cls", tmp_path / "cls")   # what `models add` runs, in process
    wait_for(lambda: "user-cls" in {m.name for m in client.list_models()}, 60, "the user's classifier served")
    task = load_task("sentiment")
    texts = write_texts(tmp_path / "texts.jsonl", (e.text for e in task.train[:240]))
    trained = academus(exit_mesh.run_dir, "ramps", "train", "--model", "user-cls", "--data", texts, "--quick")
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert json.loads(trained.stdout.strip().splitlines()[-1])["layers"] == [1, 2]

    def early() -> bool:
        return len(list(client.infer_stream("user-cls", TEXTS))) > 1
    wait_for(early, 30, "the user's classifier's ramps to release early results")
    *released, final = list(client.infer_stream("user-cls", TEXTS))
    assert all(not p.final and p.exit_layer in (1, 2) for r in released for p in r.predictions)
    exact = client.infer("user-cls", TEXTS)
    for streamed, plain in zip(final.predictions, exact.predictions, strict=True):
        assert streamed.final and streamed.label == plain.label
        np.testing.assert_allclose(list(streamed.probs.values()), list(plain.probs.values()), atol=1e-5)
