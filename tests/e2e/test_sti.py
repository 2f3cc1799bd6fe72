"""Elastic loading from shards (STI) through the CLI and the real mesh: `academus shard build --quick` writes the
artifact and registers `sentiment-sti`; `info`, `verify`, `profile` and `plan` read it; a worker serves the
model from shards under a memory budget, planned for each batch's time, with the plan in the response's
metadata; a time no submodel fits is refused at once, a budget below the smallest plan is refused with both
numbers, a lowered budget is planned within; a corrupted shard is refused at `verify` and never served."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from academus.client import AcademusError, Client
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshState, down
from academus.shared.models.shard_store import ShardStore
from academus.shared.runtime.config import artifacts_dir
from academus.shared.state.catalogue import read_catalogue, write_entry
from tests.e2e.conftest import metric, service, start_mesh

pytestmark = pytest.mark.e2e
TEXTS = ["a gorgeous, witty, seductive movie", "the plot is a mess and the acting is worse",
         "one of the best films of the year"]


def academus(*args: str | Path, run_dir: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    head = ["--run-dir", str(run_dir)] if run_dir else []
    return subprocess.run([sys.executable, "-m", "academus.shared.cli", *head, *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def last_json(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    artifacts = tmp_path_factory.mktemp("artifacts")
    write_entry(artifacts, "sentiment", read_catalogue(artifacts_dir())["sentiment"])
    shutil.copytree(artifacts_dir() / "heads" / "sentiment", artifacts / "heads" / "sentiment")
    summary = last_json(academus("shard", "build", "--tasks", "sentiment", "--quick", "--artifacts", artifacts))
    assert summary["geometry"] == {"layers": 6, "heads": 12, "hidden": 384, "intermediate": 1536}
    assert summary["tasks"]["sentiment"]["served_as"] == "sentiment-sti"
    assert int(summary["bytes"]["2"]) < int(summary["bytes"]["6"]) < int(summary["bytes"]["32"]) / 4
    entry = read_catalogue(artifacts)["sentiment-sti"]
    assert entry["shards"] == "shards/minilm" and entry["task"] == "sentiment"
    return artifacts


def test_info_verify_profile_and_plan(built: Path) -> None:
    info = last_json(academus("shard", "info", "--artifacts", built))
    assert info["versions"] == [2, 3, 4, 5, 6, 32] and info["tasks"]["sentiment"]["widths"] == [3, 6, 9, 12]
    assert info["shard_bytes"]["32"] == 4 * (4 * 384 * 32 + 2 * 384 * 128)
    assert info["embedding_rows_bytes"] == 30522 * 384 * 4 and info["resident_bytes"] < 2 << 20   # table not held
    task = ShardStore(built / "shards" / "minilm").tasks["sentiment"]    # every shard in the planner's upgrade order
    assert sorted(task.upgrade_order) == [(k, s) for k in range(6) for s in range(12)]
    assert info["tasks"]["sentiment"]["upgrade_order_top"] == [list(x) for x in task.upgrade_order[:8]]
    table = task.metrics["sensitivity_table"]
    assert len(table) == 72 and max(r["kl"] for r in table) > 0
    assert last_json(academus("shard", "verify", "--artifacts", built)) == {
        "directory": str(built / "shards" / "minilm"), "files": 39, "shards": 432, "row_blocks": -(-30522 // 16),
        "ok": True}
    profile = last_json(academus("shard", "profile", "--io", "cold", "--repeats", "3", "--artifacts", built))
    assert profile["source"] == "cold" and set(profile["load_ms"]) == {"2", "3", "4", "5", "6", "32"}
    assert set(profile["compute_ms"]) == set(profile["load_by_width"]) == {"3", "6", "9", "12"}
    assert profile["load_by_width"]["12"] == profile["load_ms"]      # the widest's, for what reads one table
    full = 6 * profile["compute_ms"]["12"]["32"] + profile["overhead_ms"]["32"]
    plan = last_json(academus("shard", "plan", "--task", "sentiment", "--io", "cold", "--target-ms", str(20 * full),
                              "--preload-bytes", str(1 << 20), "--length", "32", "--artifacts", built))
    assert plan["feasible"] and plan["depth"] * plan["width"] == sum(len(x["shards"]) for x in plan["layers"])
    assert plan["preload_bytes"] <= 1 << 20 and plan["plan_ms"] >= 0
    short = academus("shard", "plan", "--task", "sentiment", "--io", "cold", "--target-ms", "0.01",
                     "--artifacts", built)
    assert short.returncode == 1 and "--target-ms 0.01: no submodel fits; the smallest needs" in short.stderr


def test_a_corrupted_shard_fails_verify_naming_it(built: Path, tmp_path: Path) -> None:
    copy = tmp_path / "artifacts"
    shutil.copytree(built / "shards", copy / "shards")
    store = ShardStore(copy / "shards" / "minilm")
    entry = store.entry(2, 5, 3)
    path = copy / "shards" / "minilm" / entry.file
    data = bytearray(path.read_bytes())
    data[entry.offset + 7] ^= 0x55
    path.write_bytes(bytes(data))
    done = academus("shard", "verify", "--artifacts", copy)
    assert done.returncode == 1 and "layer2.q3: sha256" in done.stderr and "does not match" in done.stderr


@pytest.fixture(scope="module")
def sti_mesh(built: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshState]:
    run_dir = tmp_path_factory.mktemp("run")
    state = start_mesh(run_dir, deployments=[Deployment("padded")], artifacts=built,
                       env={"ACADEMUS_STI_IO": "cold"})
    yield state
    down(run_dir)


@pytest.fixture(scope="module")
def client(sti_mesh: MeshState) -> Iterator[Client]:
    key = (Path(sti_mesh.run_dir) / ADMIN_KEY_FILE).read_text().strip()
    with Client(sti_mesh.gateway, api_key=key, timeout=30) as c:
        yield c


def test_served_from_shards_with_the_plan_in_the_metadata(client: Client, sti_mesh: MeshState) -> None:
    result = client.infer("sentiment-sti", TEXTS)
    shards = result.metadata.shards
    # 30 s of deadline: the whole model, every shard at full precision but the preload buffer's
    assert shards is not None and (shards.layers, shards.width, shards.mean_bits) == (6, 12, 32)
    assert shards.io_source == "cold" and shards.io_ms > 0 and shards.resident_bytes > 0
    teacher = client.infer("sentiment", TEXTS)      # the full-precision whole model is the teacher
    assert teacher.metadata.shards is None
    for p, q in zip(result.predictions, teacher.predictions, strict=True):
        assert p.label == q.label and p.probs == pytest.approx(q.probs, abs=1e-4)
    assert metric(service(sti_mesh, "worker-0").metrics_port, "academus_worker_sti_batches_total",
                  model="sentiment-sti") >= 1


def test_a_short_deadline_plans_less_or_is_refused_at_once(client: Client) -> None:
    """30 ms for the hops and the model: too little for all 72 shards at full precision read cold."""
    started = time.perf_counter()
    try:
        result = client.infer("sentiment-sti", TEXTS[:1], timeout=0.03)
    except AcademusError as e:
        assert e.code == "DEADLINE_EXCEEDED", e
        assert time.perf_counter() - started < 1.0
        return
    shards = result.metadata.shards
    assert shards is not None and (shards.layers * shards.width < 72 or shards.mean_bits < 32)


def test_budget_below_the_minimum_is_refused_and_a_lowered_one_is_planned_within(
        client: Client, sti_mesh: MeshState) -> None:
    run_dir = sti_mesh.run_dir
    refused = academus("shard", "budget", "--model", "sentiment-sti", "--bytes", "1000", run_dir=run_dir)
    assert refused.returncode == 2
    assert "a budget of 1000 bytes is below the" in refused.stderr and "bytes its smallest plan needs" in refused.stderr
    before = client.infer("sentiment-sti", TEXTS).metadata.shards
    minimum = int(refused.stderr.split("below the ")[1].split(" bytes")[0])
    lowered = last_json(academus("shard", "budget", "--model", "sentiment-sti", "--bytes", str(minimum),
                                 run_dir=run_dir))
    (reply,) = lowered.values()
    assert reply["budget_bytes"] == minimum and reply["resident_bytes"] <= minimum
    after = client.infer("sentiment-sti", TEXTS).metadata.shards
    assert after is not None and after.resident_bytes < before.resident_bytes
    assert after.resident_bytes <= minimum
    last_json(academus("shard", "budget", "--model", "sentiment-sti", "--bytes", "0", run_dir=run_dir))


def test_unknown_models_for_a_budget_are_not_found(sti_mesh: MeshState) -> None:
    done = academus("shard", "budget", "--model", "sentiment", "--bytes", "0", run_dir=sti_mesh.run_dir)
    assert done.returncode == 2 and "NOT_FOUND" in done.stderr and "not served from shards" in done.stderr
