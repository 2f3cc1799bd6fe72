"""The tenants CLI contract on the mesh as real processes: `academus tenants create NAME --base minilm
--data FILE.jsonl` trains and registers the tenant's model and prints its key last; with that key
`academus infer --key KEY --model NAME TEXT` serves it; another tenant's key naming it gets NOT_FOUND;
`tenants delete` removes the tenant, its key and its adapters."""

from __future__ import annotations

import json

import pytest

from academus.shared.training.data import load_task
from tests.conftest import write_reviews
from tests.e2e.test_serving import cli

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    task = load_task("sentiment")
    return write_reviews(tmp_path_factory.mktemp("tenant") / "reviews.jsonl",
                         [(e.text, task.labels[e.label]) for e in task.train[:160]])


def created(mesh, name: str, data) -> dict:
    out = cli(mesh, "tenants", "create", name, "--base", "minilm", "--data", str(data), "--epochs", "3",
              timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_a_created_tenant_model_serves_with_its_key_and_only_to_its_tenant(mesh, data):
    acme = created(mesh, "acme", data)
    assert acme["key"] and acme["version"] >= 1 and acme["labels"] == ["fresh", "rotten"]
    assert acme["validation"]["accuracy"] > acme["untrained_validation"]["accuracy"]
    served = cli(mesh, "infer", "--key", acme["key"], "--model", "acme", "A moving, beautifully acted film.",
                 "A tedious, lifeless mess.")
    assert served.returncode == 0, served.stderr
    rows = [json.loads(line) for line in served.stdout.splitlines()]
    assert [set(r["probs"]) for r in rows] == [{"fresh", "rotten"}] * 2
    assert [r["label"] for r in rows] == ["fresh", "rotten"]

    globex = created(mesh, "globex", data)
    theirs = cli(mesh, "infer", "--key", globex["key"], "--model", "acme", "hello")
    assert theirs.returncode == 1 and theirs.stdout.strip() == "NOT_FOUND" and "acme" not in theirs.stderr.split(
        "not found")[1]

    listed = json.loads(cli(mesh, "tenants", "list").stdout.splitlines()[-1])
    assert {t["tenant"] for t in listed} >= {"acme", "globex"}
    deleted = cli(mesh, "tenants", "delete", "acme")
    assert deleted.returncode == 0 and json.loads(deleted.stdout)["adapter_versions_deleted"] == 1
    gone = cli(mesh, "infer", "--key", acme["key"], "--model", "acme", "hello")
    assert gone.stdout.strip() == "UNAUTHENTICATED"


def test_bad_data_is_refused_with_the_line_named_and_nothing_registered(mesh, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine", "label": "a"}\n{"text": "no label"}\n')
    out = cli(mesh, "tenants", "create", "initech", "--data", str(bad))
    assert out.returncode == 2 and "INVALID_ARGUMENT" in out.stderr and ":2" in out.stderr
    listed = json.loads(cli(mesh, "tenants", "list").stdout.splitlines()[-1])
    assert "initech" not in {t["tenant"] for t in listed}
