"""Shared fixtures: a real redis-server on loopback (never a mock), and factories."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from prometheus_client import REGISTRY

from academus.shared.cli.redis_server import RedisServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads for a block: all the cores for training while nothing else runs, one beside
    services the test started."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def parent_pid(pid: int) -> int:
    """A process's parent, from /proc (field 4 of its stat, after the command name in parentheses)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def all_cores() -> int:
    return os.cpu_count() or 1


@pytest.fixture(scope="module")
def teacher() -> Iterator:
    """The real teacher, one torch thread while the module runs (tables built beside other work stay
    deterministic and do not oversubscribe the cores); training with nothing beside it takes `all_cores()`."""
    from academus.shared.models.model import TeacherEncoder

    with torch_threads(1):
        yield TeacherEncoder.load()


def write_reviews(path: Path, examples: Iterable[tuple[str, str]]) -> Path:
    """A user's labelled file: a {"text", "label"} line an example."""
    return _write_jsonl(path, ({"text": text, "label": label} for text, label in examples))


def write_texts(path: Path, texts: Iterable[str]) -> Path:
    """A user's file of texts: a {"text"} line a text."""
    return _write_jsonl(path, ({"text": text} for text in texts))


def _write_jsonl(path: Path, rows: Iterable[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


class CriticStudents(NamedTuple):
    artifacts: Path            # read only: a test that serves or writes it copies it first
    summary: dict[str, Any]    # what `distill` returned


@pytest.fixture(scope="session")
def critic_students(tmp_path_factory: pytest.TempPathFactory) -> CriticStudents:
    """A user's fine-tuned classifier `critic` (MiniLM fitted on reviews 300-899 of the sentiment training split) and
    its students distilled --quick on a file of reviews 0-299: built once for the tests of both."""
    from dataclasses import replace

    from academus.loadgen.probes.user_classifier import sentiment_classifier
    from academus.shared.models.user_models import add_model
    from academus.shared.training.data import data_dir, fetch, load_task
    from academus.shared.training.distill import distill
    from academus.shared.training.distill_data import QUICK

    root = tmp_path_factory.mktemp("critic")
    task = load_task("sentiment", fetch(data_dir()))
    examples = [(e.text, task.labels[e.label]) for e in task.train[:900]]
    artifacts = root / "artifacts"
    add_model(artifacts, "critic", sentiment_classifier(root / "critic", examples[300:]))
    summary = distill(None, artifacts, root / "data", replace(QUICK, max_students=2), quick=True, model="critic",
                      data_file=write_reviews(root / "reviews.jsonl", examples[:300]))
    return CriticStudents(artifacts, summary)


class SuiteLauncher(NamedTuple):
    socket: str
    pid: int


@pytest.fixture(scope="session", autouse=True)
def warm_launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SuiteLauncher]:
    """The suite's meshes fork their services from one warm launcher (shared/cli/launcher.py): each start skips
    the imports, most of a worker's. Until it is ready they start as plain processes, so nothing waits for it;
    tests of the plain path unset ACADEMUS_LAUNCHER."""
    from academus.shared.cli.launcher import start_launcher
    from academus.shared.runtime.config import LAUNCHER

    socket_path = tmp_path_factory.mktemp("launcher") / "launcher.sock"
    proc = start_launcher(socket_path)
    os.environ[LAUNCHER.name] = str(socket_path)
    yield SuiteLauncher(str(socket_path), proc.pid)
    os.environ.pop(LAUNCHER.name, None)
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def ready_launcher(warm_launcher: SuiteLauncher) -> SuiteLauncher:
    """The suite's warm launcher once it listens, for a test of what is forked from it."""
    from academus.shared.cli.launcher import wait_ready

    log = Path(warm_launcher.socket).with_name("launcher.log")
    assert wait_ready(warm_launcher.pid, log, 180), f"the suite's launcher is not listening: {log}"
    return warm_launcher


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """A clean database for each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield redis_server.url
    client.close()


def artifacts_path() -> Path:
    from academus.shared.runtime.config import artifacts_dir

    return artifacts_dir()


@pytest.fixture
async def redis(redis_url: str):
    """An asyncio client on the clean database, closed after the test."""
    from academus.shared.runtime.redis_conn import connect

    client = connect(redis_url)
    yield client
    await client.aclose()


def sample(name: str, **labels: str) -> float:
    """One sample of this process's Prometheus registry, 0 while absent (tests compare before and after)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


# The serving tests' meshes run without the queue's wait bound: their bursts queue for seconds on a loaded 2-core
# machine, and refusing them is not what they test. test_admission.py and the scheduler's unit tests set it.
NO_WAIT_BOUND = {"ACADEMUS_MAX_QUEUE_WAIT_MS": "0"}


@contextmanager
def env(**values: str) -> Iterator[None]:
    """Environment variables set for a block (services read their config from it at build time)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def small_student_artifacts(root: Path, best_k: int) -> Path:
    """The prepared catalogue plus an untrained 2-student sentiment group (the teacher's bottom layers):
    for tests of serving mechanics, not of quality."""
    from academus.shared.models.model import TeacherEncoder
    from academus.shared.models.students import from_teacher
    from academus.shared.training.student_artifacts import write_student_catalogue, write_student_group

    shutil.copy(artifacts_path() / "models.json", root / "models.json")
    shutil.copytree(artifacts_path() / "heads", root / "heads")
    group = from_teacher(TeacherEncoder.load().body, layers=2, labels=["rotten", "fresh"])
    group.add_student(alpha=0.5)
    group.best_k = best_k
    write_student_group(root, "sentiment", group, metrics={})
    write_student_catalogue(root)
    return root
