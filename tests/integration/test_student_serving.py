"""The worker serves a student-group artifact through the same ModelRunner (and gRPC path) as the teacher."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from academus.services.worker.core import OUTPUT_EMBEDDING, OUTPUT_PROBS, ModelRunner
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.work import Batch
from academus.shared.runtime.errors import InvalidArgument
from academus.shared.runtime.redis_conn import connect
from academus.shared.state.keys import Keys
from tests.conftest import small_student_artifacts


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """The prepared catalogue plus an untrained 2-student sentiment group, best k = 1."""
    return small_student_artifacts(tmp_path_factory.mktemp("artifacts"), best_k=1)


def tokens(texts: list[str]) -> tuple[list[int], list[int]]:
    encoded = TeacherTokenizer(teacher_dir()).encode(texts)
    return [i for e in encoded for i in e.input_ids], [len(e.input_ids) for e in encoded]


def test_catalogue_names_the_student_model(artifacts):
    entry = json.loads((artifacts / "models.json").read_text())["sentiment-students"]
    assert entry["students"] == "students/sentiment" and entry["labels"] == ["rotten", "fresh"]


def test_student_group_runs_best_k_by_default_and_any_prefix_on_request(artifacts):
    runner = ModelRunner(artifacts, ["sentiment-students", "sentiment"])
    ids, lengths = tokens(["a warm, funny film", "a dull mess"])
    default = runner.run(Batch("sentiment-students", OUTPUT_PROBS, ids, lengths))
    both = runner.run(Batch("sentiment-students", OUTPUT_PROBS, ids, lengths, num_students=2))
    assert default.student_count == 1 and both.student_count == 2
    assert default.labels == ["rotten", "fresh"] and default.values.shape == (2, 2)
    assert not torch.allclose(torch.from_numpy(default.values), torch.from_numpy(both.values))
    pooled = runner.run(Batch("sentiment-students", OUTPUT_EMBEDDING, ids, lengths, num_students=2)).values
    assert pooled.shape == (2, 384)
    assert runner.run(Batch("sentiment", OUTPUT_PROBS, ids, lengths)).student_count == 1  # the teacher


def test_more_students_than_the_group_holds_is_invalid(artifacts):
    runner = ModelRunner(artifacts, ["sentiment-students"])
    ids, lengths = tokens(["hi"])
    with pytest.raises(InvalidArgument, match="num_students=3 exceeds the 2 students"):
        runner.run(Batch("sentiment-students", OUTPUT_PROBS, ids, lengths, num_students=3))


async def test_student_model_served_through_the_grpc_path(artifacts, redis_server):
    """Gateway -> scheduler -> worker in process: the metadata reports the students that ran."""
    from academus.client import AsyncClient
    from tests.integration.test_inprocess_mesh import KEY, start_services

    running = await start_services(redis_server.url, "students", ACADEMUS_ARTIFACTS=str(artifacts),
                                   ACADEMUS_MODELS="sentiment-students,sentiment")
    redis = connect(redis_server.url)
    try:
        async with AsyncClient(running[-1].address, api_key=KEY) as client:
            students = await client.infer("sentiment-students", ["a warm, funny film"])
            teacher = await client.infer("sentiment", ["a warm, funny film"])
            # the resource manager's lever: the student number published in Redis
            await redis.set(Keys("students").students("sentiment-students"), 2)
            await redis.publish(Keys("students").events(), "students")
            await asyncio.sleep(0.3)
            two = await client.infer("sentiment-students", ["a warm, funny film"])
    finally:
        for service in reversed(running):
            await service.stop()
        await redis.aclose()
    assert students.metadata.student_count == 1 and teacher.metadata.student_count == 1
    assert two.metadata.student_count == 2
    assert set(students.predictions[0].probs) == {"rotten", "fresh"}


def test_the_single_2_layer_baseline_serves_the_first_student_alone(artifacts):
    entry = json.loads((artifacts / "models.json").read_text())["sentiment-2l"]
    assert entry["limit_students"] == 1 and entry["students"] == "students/sentiment"
    runner = ModelRunner(artifacts, ["sentiment-2l", "sentiment-students"])
    ids, lengths = tokens(["a warm, funny film"])
    alone = runner.run(Batch("sentiment-2l", OUTPUT_PROBS, ids, lengths))
    first = runner.run(Batch("sentiment-students", OUTPUT_PROBS, ids, lengths, num_students=1))
    assert runner.specs["sentiment-2l"].max_students == 1 and alone.student_count == 1
    assert torch.allclose(torch.from_numpy(alone.values), torch.from_numpy(first.values))
    with pytest.raises(InvalidArgument, match="exceeds the 1 students"):
        runner.run(Batch("sentiment-2l", OUTPUT_PROBS, ids, lengths, num_students=2))
