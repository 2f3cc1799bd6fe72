"""`academus keys list | revoke | rotate` on the mesh as real processes. The gateway trusts a verified key for ten
minutes here (ACADEMUS_AUTH_CACHE_S=600), so a revoked key refused on the next call can only be the revocation's
event reaching the gateway, not its cache running out."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from academus.shared.cli.mesh import ADMIN_KEY_FILE, MeshState, down
from tests.e2e.conftest import administer, start_mesh, wait_for
from tests.e2e.test_serving import cli

pytestmark = pytest.mark.e2e
FAILURE_LIMIT = 8   # invalid keys one address may present a minute: the tests above present 3 between them


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshState]:
    run_dir = tmp_path_factory.mktemp("keys")
    state = start_mesh(run_dir, env={"ACADEMUS_AUTH_CACHE_S": "600", "ACADEMUS_MODELS": "null",
                                     "ACADEMUS_AUTH_FAILURE_LIMIT": str(FAILURE_LIMIT)})
    yield state
    down(run_dir)


def answered(mesh: MeshState, key: str) -> str:
    """The first line `academus infer` prints with this key: a prediction's JSON, or the status's name."""
    out = cli(mesh, "infer", "--key", key, "--model", "null", "hello")
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else out.stderr


def listed(mesh: MeshState, *args: str) -> list[dict]:
    out = cli(mesh, "keys", "list", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_a_revoked_key_is_refused_by_the_gateway_that_had_trusted_it(mesh):
    key = json.loads(cli(mesh, "keys", "create", "acme").stdout)["key"]
    assert answered(mesh, key).startswith("{")                       # served; the gateway now trusts the key
    keys = listed(mesh, "--tenant", "acme")
    assert [k["tenant"] for k in keys] == ["acme"] and key not in json.dumps(keys)
    out = cli(mesh, "keys", "revoke", keys[0]["id"])
    assert out.returncode == 0 and json.loads(out.stdout) == {"revoked": keys[0]["id"], "tenant": "acme"}
    wait_for(lambda: answered(mesh, key) == "UNAUTHENTICATED", timeout_s=30, what="the revoked key refused")
    assert listed(mesh, "--tenant", "acme") == []


def test_rotation_gives_a_new_key_and_the_old_one_stops_working(mesh):
    old = json.loads(cli(mesh, "keys", "create", "globex").stdout)["key"]
    assert answered(mesh, old).startswith("{")
    out = cli(mesh, "keys", "rotate", "globex")
    assert out.returncode == 0, out.stderr
    rotated = json.loads(out.stdout)
    assert rotated["key"] != old and len(rotated["revoked"]) == 1
    assert answered(mesh, rotated["key"]).startswith("{")
    wait_for(lambda: answered(mesh, old) == "UNAUTHENTICATED", timeout_s=30, what="the rotated-out key refused")


def test_the_admin_key_rotates_into_its_file_and_cannot_be_revoked(mesh):
    admin_file = Path(mesh.run_dir) / ADMIN_KEY_FILE
    before = admin_file.read_text().strip()
    refused = cli(mesh, "keys", "revoke", before)
    assert refused.returncode == 2 and "FAILED_PRECONDITION" in refused.stderr and "rotate" in refused.stderr
    out = cli(mesh, "keys", "rotate", "admin")
    assert out.returncode == 0, out.stderr
    after = admin_file.read_text().strip()
    assert after == json.loads(out.stdout)["key"] != before
    assert admin_file.stat().st_mode & 0o777 == 0o600, "the new key is this user's alone, as the first was"
    assert [k["role"] for k in listed(mesh, "--tenant", "admin")] == ["admin"]
    served = cli(mesh, "infer", "--model", "null", "hello")                  # the command line's key: the file's
    assert served.returncode == 0 and served.stdout.startswith("{"), served.stderr
    wait_for(lambda: answered(mesh, before) == "UNAUTHENTICATED", timeout_s=30, what="the old admin key refused")
    short = cli(mesh, "keys", "revoke", "abc")
    assert short.returncode == 2 and "INVALID_ARGUMENT" in short.stderr and "8 hex digits" in short.stderr


def test_a_mesh_up_did_not_start_is_administered_through_its_redis(mesh, tmp_path):
    """Compose and Kubernetes meshes have no mesh.json: `docker compose exec gateway academus keys create T`."""
    env = {"ACADEMUS_REDIS_URL": mesh.redis_url, "ACADEMUS_KEY_PREFIX": mesh.key_prefix}
    made = administer(tmp_path, env, "keys", "create", "umbrella")
    assert made.returncode == 0, made.stderr
    key = json.loads(made.stdout)["key"]
    assert answered(mesh, key).startswith("{")
    admin = administer(tmp_path, env, "keys", "create", "admin")     # the administrator's, for a mesh without admin.key
    assert admin.returncode == 0, admin.stderr
    assert [k["role"] for k in listed(mesh, "--tenant", "admin")] == ["admin", "admin"]
    rotated = administer(tmp_path, env, "keys", "rotate", "umbrella")
    assert rotated.returncode == 0, rotated.stderr
    assert answered(mesh, json.loads(rotated.stdout)["key"]).startswith("{")
    assert [k["tenant"] for k in json.loads(administer(tmp_path, env, "keys", "list").stdout.splitlines()[-1])
            if k["tenant"] == "umbrella"] == ["umbrella"]
    nowhere = administer(tmp_path, {}, "keys", "create", "umbrella")
    assert nowhere.returncode != 0 and "academus up" in nowhere.stderr and "ACADEMUS_REDIS_URL" in nowhere.stderr
    assert list(tmp_path.iterdir()) == [], "nothing of a local mesh is written beside a deployed one"


def test_a_mesh_up_did_not_start_reports_its_registered_services_and_models(mesh, tmp_path):
    """`academus status` in a deployed mesh's container: what Redis has registered, each one's health."""
    env = {"ACADEMUS_REDIS_URL": mesh.redis_url, "ACADEMUS_KEY_PREFIX": mesh.key_prefix}
    out = administer(tmp_path, env, "status", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["deployed"] and report["redis"]["health"] == "SERVING"
    own = {s.address for s in mesh.services if s.service in ("resource_manager", "adapter_store", "scheduler",
                                                            "worker")}
    assert {s["address"] for s in report["services"]} == own | {mesh.gateway}   # the gateway, on the mesh's port
    assert all(s["health"] == "SERVING" for s in report["services"])
    assert report["http"] == mesh.http
    assert {m["name"] for m in report["models"]} == {"null"}
    plain = administer(tmp_path, env, "status")
    assert plain.returncode == 0 and "supervisor" not in plain.stdout and "worker " in plain.stdout


def test_an_address_guessing_keys_is_refused_even_a_good_key_until_its_window_ends(mesh):
    """Last in this module: it spends the address's allowance of invalid keys (every call here comes from
    127.0.0.1, over a connection of its own)."""
    good = json.loads(cli(mesh, "keys", "create", "initech").stdout)["key"]
    answers = [answered(mesh, f"acd_guess_{k}") for k in range(FAILURE_LIMIT + 1)]
    assert "RESOURCE_EXHAUSTED" in answers and answers.index("RESOURCE_EXHAUSTED") <= FAILURE_LIMIT
    assert set(answers[:answers.index("RESOURCE_EXHAUSTED")]) == {"UNAUTHENTICATED"}
    refused = cli(mesh, "infer", "--key", good, "--model", "null", "hello")
    assert refused.stdout.strip() == "RESOURCE_EXHAUSTED" and "ACADEMUS_AUTH_FAILURE_LIMIT" in refused.stderr
