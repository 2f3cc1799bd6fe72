"""`academus up --mtls` as real processes (ACADEMUS_MODELS=null: no weights to load): a local CA signs the
gateway's and every service's certificate; the gateway serves TLS only, the services mutual TLS among
themselves, the mesh's Redis asks for a password. An insecure client is refused and one trusting the CA
answered; the CLI (infer, status, tenants) connects with the CA and its own certificate; an internal service
refuses a certificate another CA signed; a CA rotated in place, without a restart, keeps the mesh serving."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import ssl
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from academus.client import AcademusError, Client
from academus.loadgen.chaos_bench import current_pid, serving
from academus.shared.cli.mesh import ADMIN_KEY_FILE, STATE_FILE, MeshState, health
from academus.shared.cli.pki import CLI, Pki, make_pki
from academus.shared.runtime.certificates import LOOK_S
from academus.shared.runtime.redis_conn import connect
from academus.shared.state.keys import Keys
from academus.shared.state.tenants import TenantRegistry
from tests.conftest import env
from tests.e2e.conftest import administer, wait_for
from tests.e2e.test_serving import cli

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(shutil.which("openssl") is None, reason="no `openssl` command to make certificates")]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshState]:
    run_dir = tmp_path_factory.mktemp("tls-run")
    placeholder = MeshState(str(run_dir), "", None, "", "acd")   # `cli` needs only the run directory
    with env(ACADEMUS_MODELS="null", ACADEMUS_GRACE_S="5"):
        started = cli(placeholder, "up", "--mtls", "--detach", "--port", "0", "--http-port", "0", "--deployment",
                      "fifo", "--worker-threads", "1", timeout=120)
    assert started.returncode == 0, started.stderr[-3000:]
    state = MeshState.load(run_dir)
    yield state
    cli(state, "down")


def admin_key(mesh: MeshState) -> str:
    return (Path(mesh.run_dir) / ADMIN_KEY_FILE).read_text().strip()


def test_an_insecure_client_is_refused_and_one_trusting_the_mesh_ca_is_answered(mesh):
    with Client(mesh.gateway, api_key=admin_key(mesh), timeout=5) as plaintext, pytest.raises(AcademusError) as refused:
        plaintext.infer("null", ["hello"])
    assert refused.value.code == "UNAVAILABLE"
    ca = Path(mesh.tls_ca).read_bytes()
    with Client(mesh.gateway, api_key=admin_key(mesh), timeout=10, root_certificates=ca) as client:
        result = client.infer("null", ["hello", "over TLS"])   # gateway -> scheduler -> worker, mutual TLS
    assert [len(p.embedding) for p in result.predictions] == [384, 384]


def test_the_http_api_serves_tls_with_the_gateways_certificate(mesh):
    """`up --http-port` beside `--mtls`: the HTTP/JSON API answers over TLS with the public port's certificate, and a
    plaintext request gets no answer."""
    body = json.dumps({"inputs": ["hello"], "model": "null"}).encode()
    request = urllib.request.Request(f"https://{mesh.http}/embed", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {admin_key(mesh)}"})
    with urllib.request.urlopen(request, context=ssl.create_default_context(cafile=mesh.tls_ca), timeout=30) as got:
        assert got.status == 200 and json.loads(got.read()) == [[0.0] * 384]   # null's zeros stay zeros
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{mesh.http}/health", timeout=10)


def test_the_cli_connects_with_the_mesh_ca_and_its_own_certificate(mesh):
    inferred = cli(mesh, "infer", "--model", "null", "hi")
    assert inferred.returncode == 0, inferred.stderr
    assert len(json.loads(inferred.stdout)["embedding"]) == 384
    status = cli(mesh, "status", "--json")
    assert status.returncode == 0, status.stdout
    report = json.loads(status.stdout)
    assert {s["health"] for s in report["services"]} == {"SERVING"}
    assert report["redis"]["url"].startswith("redis://:***@")   # the password is not printed
    asyncio.run(add_tenant(mesh, "acme"))
    deleted = cli(mesh, "tenants", "delete", "acme")   # asks the adapter store, presenting the CLI's certificate
    assert deleted.returncode == 0, deleted.stderr
    assert json.loads(deleted.stdout.splitlines()[-1])["adapter_versions_deleted"] == 0


def test_status_beside_no_up_checks_the_gateways_tls_and_the_services_mutual_tls(mesh, tmp_path):
    """`academus status` in a deployed mesh's container: the services' settings in its environment, the CLI's
    certificate its identity; the gateway, registered in Redis, checked as a client reaches it (the mesh's CA)."""
    pki = Path(mesh.tls_ca).parent
    env = {"ACADEMUS_REDIS_URL": mesh.redis_url, "ACADEMUS_KEY_PREFIX": mesh.key_prefix, "ACADEMUS_MESH_TLS": "true",
           "ACADEMUS_MESH_CA": mesh.tls_ca, "ACADEMUS_MESH_CERT": str(pki / f"{CLI}.crt"),
           "ACADEMUS_MESH_KEY": str(pki / f"{CLI}.key")}
    out = administer(tmp_path, env, "status", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["deployed"] and {s["health"] for s in report["services"]} == {"SERVING"}
    gateways = [s["address"] for s in report["services"] if s["name"].startswith("gateway")]
    assert gateways == [mesh.gateway] and report["http"] == mesh.http
    without = {k: v for k, v in env.items() if not k.startswith("ACADEMUS_MESH")}
    plain = administer(tmp_path, without, "status", "--json")
    assert plain.returncode == 1   # no mesh identity: the services refuse its plaintext, the gateway its trust
    assert {s["health"] for s in json.loads(plain.stdout)["services"]} == {"UNREACHABLE"}


async def add_tenant(mesh: MeshState, name: str) -> None:
    client = connect(mesh.redis_url)
    try:
        await TenantRegistry(client, Keys(mesh.key_prefix)).create_tenant(name)
    finally:
        await client.aclose()


def test_an_internal_service_refuses_a_certificate_the_mesh_ca_did_not_sign(mesh, tmp_path):
    scheduler = next(s for s in mesh.services if s.service == "scheduler")
    ca = Path(mesh.tls_ca).read_bytes()
    stranger = make_pki(tmp_path, [CLI])
    foreign = grpc.ssl_channel_credentials(ca, stranger.key(CLI).read_bytes(), stranger.cert(CLI).read_bytes())
    assert health(scheduler.address, 5, foreign) == "UNREACHABLE"
    assert health(scheduler.address, 5, grpc.ssl_channel_credentials(ca)) == "UNREACHABLE"   # no certificate
    assert health(scheduler.address, 5) == "UNREACHABLE"   # plaintext
    assert health(scheduler.address, 5, mesh.credentials(scheduler)) == "SERVING"   # the CLI's own


def test_the_mesh_redis_refuses_a_client_without_its_password(mesh):
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(f"redis://{mesh.redis_url.rsplit('@', 1)[1]}").ping()
    assert redis.Redis.from_url(mesh.redis_url).ping()
    assert (Path(mesh.run_dir) / STATE_FILE).stat().st_mode & 0o077 == 0   # it holds the password


def test_a_ca_rotated_in_place_keeps_the_mesh_serving_and_its_channels_reopen(mesh, tmp_path):
    """A CA's rotation as cert-manager does it, in three writes of the files the services read: both CAs trusted,
    then every certificate the new CA's, then the old CA gone; no service restarted. Then a scheduler killed and
    restarted trusts only the new CA, and the gateway reaches it again: its channel to the scheduler reopened
    under the new certificate (gRPC cannot change an open channel's credentials)."""
    ca = Path(mesh.tls_ca)
    live = Pki(ca.parent)
    leaves = sorted(p.stem for p in ca.parent.glob("*.crt") if p != ca)
    successor = make_pki(tmp_path, leaves)
    old, new = ca.read_bytes(), successor.ca.read_bytes()

    def answers(trusted: bytes) -> bool:
        try:
            with Client(mesh.gateway, api_key=admin_key(mesh), timeout=10, root_certificates=trusted) as client:
                return len(client.infer("null", ["rotated"]).predictions[0].embedding) == 384
        except AcademusError:
            return False

    ca.write_bytes(old + new)
    time.sleep(LOOK_S * 2.5)   # each service looks once a LOOK_S
    assert answers(old + new)
    for leaf in leaves:        # a key and its certificate: a set caught half-written is taken once whole
        shutil.copy(successor.key(leaf), live.key(leaf))
        shutil.copy(successor.cert(leaf), live.cert(leaf))
    time.sleep(LOOK_S * 2.5)
    assert answers(old + new)
    ca.write_bytes(new)
    time.sleep(LOOK_S * 2.5)
    assert answers(new) and not answers(old)   # the gateway presents the new CA's certificate
    run_dir = Path(mesh.run_dir)
    scheduler = next(s.name for s in mesh.services if s.service == "scheduler")
    before = current_pid(run_dir, scheduler)
    os.kill(before, signal.SIGKILL)
    wait_for(lambda: current_pid(run_dir, scheduler) != before and serving(run_dir, scheduler), timeout_s=60,
             what="the scheduler restarted")
    wait_for(lambda: answers(new), timeout_s=10, what="the gateway to reach the restarted scheduler")
