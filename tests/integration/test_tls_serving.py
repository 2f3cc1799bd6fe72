"""TLS on real in-process servers: the gateway's public port (TLS only, on its own port too, a client
certificate when it asks for one), mutual TLS between services (the real adapter store and its clients, the
trainer's asyncio one and the worker's blocking channel), a certificate that cannot be read stopping the
start, and the container probe over TLS. The certificates are `academus up --tls`'s (shared/cli/pki.py),
and a stranger's from another CA."""

from __future__ import annotations

import asyncio
import functools
import re
import shutil
import ssl
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import save as st_save

from academus.services.worker.adapters import StoreFetcher
from academus.shared.cli.pki import CLI, Pki, make_pki
from academus.shared.cli.redis_server import free_port
from academus.shared.runtime.certificates import LOOK_S, public_certificates, public_credentials
from academus.shared.runtime.config import CommonConfig, ConfigError, GatewayConfig, load
from academus.shared.runtime.errors import Unavailable
from academus.shared.runtime.redis_conn import connect
from academus.shared.runtime.serving import RunningService, ServiceSpec, Stubs
from academus.shared.runtime.tls import MeshTls, mesh, mesh_channel_sync, use_mesh
from academus.shared.state.keys import Keys
from academus.shared.training.onboarding import AdapterStoreClient
from tests.conftest import env
from tests.integration.test_adapter_store_service import tensors

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("openssl") is None, reason="no `openssl` command to make certificates")]
PROBE = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "healthcheck.py"
QUIET = {"ACADEMUS_PORT": "0", "ACADEMUS_METRICS_PORT": "-1", "ACADEMUS_GRACE_S": "1"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("run"), ["gateway", "adapter_store", CLI])


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("elsewhere"), [CLI])


@pytest.fixture(autouse=True)
def plaintext_after() -> Iterator[None]:
    """A started service gives this process its mesh identity; the next test starts without one."""
    yield
    use_mesh(None)


def identity(ca: Pki, holder: Pki) -> MeshTls:
    """Trusting `ca`'s CA, presenting `holder`'s command-line certificate."""
    return MeshTls(ca.ca.read_bytes(), holder.key(CLI).read_bytes(), holder.cert(CLI).read_bytes())


async def check(target: str, credentials: grpc.ChannelCredentials | None = None) -> str:
    """The server's health over TLS with `credentials` (None: plaintext); the status code when refused."""
    channel = grpc.aio.secure_channel(target, credentials) if credentials else grpc.aio.insecure_channel(target)
    async with channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def gateway_like(settings: dict[str, str], own_port: int = 0) -> RunningService:
    """A server started as the gateway's is: its ports secured by the public TLS settings."""
    config = load(GatewayConfig, {**QUIET, **settings})
    spec = ServiceSpec("tls-gateway", config, lambda server: None, [], own_port=own_port,
                       public_credentials=functools.partial(public_credentials, config))
    service = RunningService(spec)
    await service.start()
    return service


async def probe(port: int, **settings: str) -> int:
    """deploy/docker/healthcheck.py's exit status against 127.0.0.1:`port` (a process: the server runs on this loop)."""
    done = await asyncio.create_subprocess_exec(sys.executable, str(PROBE),
                                                env={"ACADEMUS_PORT": str(port), **settings})
    return await done.wait()


async def test_the_gateway_serves_tls_only_on_both_its_ports_and_the_probe_speaks_it(pki, stranger):
    own_port = free_port()
    tls = {"ACADEMUS_TLS_CERT": str(pki.cert("gateway")), "ACADEMUS_TLS_KEY": str(pki.key("gateway"))}
    service = await gateway_like(tls, own_port)
    try:
        for target in (service.address, f"127.0.0.1:{own_port}"):
            assert await check(target, grpc.ssl_channel_credentials(pki.ca.read_bytes())) == "SERVING"
            assert await check(target) == "UNAVAILABLE"
            assert await check(target, grpc.ssl_channel_credentials(stranger.ca.read_bytes())) == "UNAVAILABLE"
        port = int(service.address.rsplit(":", 1)[1])
        assert await probe(port, **tls, ACADEMUS_HEALTHCHECK_CA=str(pki.ca)) == 0
        assert await probe(port, **tls, ACADEMUS_HEALTHCHECK_CA=str(stranger.ca)) == 1
        assert await probe(port) == 1   # plaintext to a TLS port
    finally:
        await service.stop()


async def test_a_gateway_with_a_client_ca_takes_only_clients_that_ca_signed(pki, stranger):
    service = await gateway_like({"ACADEMUS_TLS_CERT": str(pki.cert("gateway")),
                                  "ACADEMUS_TLS_KEY": str(pki.key("gateway")), "ACADEMUS_TLS_CLIENT_CA": str(pki.ca)})
    try:
        assert await check(service.address, identity(pki, pki).channel_credentials()) == "SERVING"
        assert await check(service.address, identity(pki, stranger).channel_credentials()) == "UNAVAILABLE"
        assert await check(service.address, grpc.ssl_channel_credentials(pki.ca.read_bytes())) == "UNAVAILABLE"
    finally:
        await service.stop()


async def test_a_certificate_that_cannot_be_read_stops_the_start_naming_setting_and_path(pki, tmp_path):
    missing = tmp_path / "gone.crt"
    with pytest.raises(ConfigError, match=re.escape(f"ACADEMUS_TLS_CERT='{missing}': cannot read it")):
        await gateway_like({"ACADEMUS_TLS_CERT": str(missing), "ACADEMUS_TLS_KEY": str(pki.key("gateway"))})
    (tmp_path / "notes.txt").write_text("not a certificate")
    config = load(CommonConfig, {**QUIET, "ACADEMUS_MESH_TLS": "true", "ACADEMUS_MESH_CA": str(tmp_path / "notes.txt"),
                                 "ACADEMUS_MESH_CERT": str(pki.cert(CLI)), "ACADEMUS_MESH_KEY": str(pki.key(CLI))})
    with pytest.raises(ConfigError, match=re.escape(f"ACADEMUS_MESH_CA='{tmp_path / 'notes.txt'}': not a PEM file")):
        await RunningService(ServiceSpec("tls-mesh", config, lambda server: None, [])).start()


@pytest.fixture
async def store_with_mtls(pki, tmp_path, redis_server):
    """The real adapter store serving mutual TLS with its certificate from the mesh CA."""
    from academus.services.adapter_store.server import build

    settings = {**QUIET, "ACADEMUS_REDIS_URL": redis_server.url, "ACADEMUS_KEY_PREFIX": "tls-store",
                "ACADEMUS_ADAPTER_DIR": str(tmp_path / "adapters"), "ACADEMUS_MESH_TLS": "true",
                "ACADEMUS_MESH_CA": str(pki.ca), "ACADEMUS_MESH_CERT": str(pki.cert("adapter_store")),
                "ACADEMUS_MESH_KEY": str(pki.key("adapter_store"))}
    with env(**settings):
        service = RunningService(await build())
        await service.start()
    yield service
    await service.stop()


async def test_internal_channels_present_the_mesh_identity_and_a_stranger_is_refused(
        store_with_mtls, pki, stranger, redis_server):
    redis = connect(redis_server.url)
    client = AdapterStoreClient(redis, Keys("tls-store"))
    fetcher = StoreFetcher(redis_server.url, Keys("tls-store"))   # the worker's, whose channel is kept
    fetch = functools.partial(fetcher, ("acme", "support", 0), [0], True)
    try:
        use_mesh(identity(pki, pki))   # the command line's certificate (`academus tenants` does this)
        assert await client.put("acme", "support", st_save(tensors()), {}) == 1
        assert await asyncio.to_thread(health_over, mesh_channel_sync, store_with_mtls.address) == "SERVING"
        assert await asyncio.to_thread(fetch)
        for other in (identity(pki, stranger), None):   # another CA's certificate; none
            use_mesh(other)   # the kept channel is not reused under another identity
            with pytest.raises(Unavailable):
                await asyncio.to_thread(fetch)
            with pytest.raises(Unavailable):
                await client.put("acme", "support", st_save(tensors()), {})
            assert await check(store_with_mtls.address, other and other.channel_credentials()) == "UNAVAILABLE"
    finally:
        await redis.aclose()


def health_over(open_channel, target: str) -> str:
    with open_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def test_the_probe_of_a_service_with_mutual_tls_presents_its_certificate(store_with_mtls, pki):
    port = int(store_with_mtls.address.rsplit(":", 1)[1])
    mesh = {"ACADEMUS_MESH_CA": str(pki.ca), "ACADEMUS_MESH_CERT": str(pki.cert("adapter_store")),
            "ACADEMUS_MESH_KEY": str(pki.key("adapter_store"))}
    assert await probe(port, ACADEMUS_MESH_TLS="true", **mesh) == 0
    assert await probe(port, **mesh) == 1   # mutual TLS off: plaintext, refused



async def test_one_mesh_certificate_for_every_service_is_checked_by_its_shared_name(tmp_path, stranger):
    """Pods' addresses are not known when their certificates are made: `academus certs` makes one mesh
    certificate naming ACADEMUS_MESH_SERVER_NAME, which every channel and the probe check instead of the
    address they dial. Without that setting the same certificate is refused: it does not name 127.0.0.1."""
    from academus.shared.cli.main import main as cli

    assert cli(["certs", str(tmp_path / "certs"), "--mesh-name", "mesh.test"]) == 0
    pki = Pki(tmp_path / "certs")
    mesh = {"ACADEMUS_MESH_TLS": "true", "ACADEMUS_MESH_CA": str(pki.ca), "ACADEMUS_MESH_CERT": str(pki.cert("mesh")),
            "ACADEMUS_MESH_KEY": str(pki.key("mesh"))}
    config = load(CommonConfig, {**QUIET, **mesh, "ACADEMUS_MESH_SERVER_NAME": "mesh.test"})
    service = RunningService(ServiceSpec("shared-name", config, lambda server: None, []))
    await service.start()
    try:
        assert MeshTls.from_config(config).server_name == "mesh.test"
        assert await asyncio.to_thread(health_over, mesh_channel_sync, service.address) == "SERVING"
        port = int(service.address.rsplit(":", 1)[1])
        assert await probe(port, ACADEMUS_MESH_SERVER_NAME="mesh.test", **mesh) == 0
        assert await probe(port, **mesh) == 1                       # checked against 127.0.0.1: refused
        use_mesh(MeshTls(pki.ca.read_bytes(), pki.key("mesh").read_bytes(), pki.cert("mesh").read_bytes()))
        with pytest.raises(grpc.RpcError):                          # the same, by the address
            await asyncio.to_thread(health_over, mesh_channel_sync, service.address)
        outsider = identity(stranger, stranger)                     # another CA's, with the shared name
        use_mesh(MeshTls(outsider.ca, outsider.key, outsider.cert, "mesh.test"))
        with pytest.raises(grpc.RpcError):
            await asyncio.to_thread(health_over, mesh_channel_sync, service.address)
    finally:
        await service.stop()


@pytest.fixture(scope="module")
def successor(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """The certificates a rotation installs: another CA's, so that which set a handshake used shows."""
    return make_pki(tmp_path_factory.mktemp("rotated"), ["gateway", "mesh", CLI])


def install(pki: Pki, live: Path, files: dict[str, str]) -> None:
    """Copies `pki`'s files to `live` under the names the server reads (a Secret updated in place)."""
    for source, name in files.items():
        shutil.copy(pki.directory / source, live / name)


async def test_a_rotated_certificate_is_presented_on_the_gateways_ports_without_a_restart(pki, successor, tmp_path):
    public = {"gateway.crt": "tls.crt", "gateway.key": "tls.key"}
    install(pki, tmp_path, public)
    tls = {"ACADEMUS_TLS_CERT": str(tmp_path / "tls.crt"), "ACADEMUS_TLS_KEY": str(tmp_path / "tls.key")}
    own_port = free_port()
    service = await gateway_like(tls, own_port)
    try:
        for target in (service.address, f"127.0.0.1:{own_port}"):
            assert await check(target, grpc.ssl_channel_credentials(pki.ca.read_bytes())) == "SERVING"
        install(successor, tmp_path, public)
        await asyncio.sleep(LOOK_S)
        for target in (service.address, f"127.0.0.1:{own_port}"):   # new connections: the new certificate
            assert await check(target, grpc.ssl_channel_credentials(successor.ca.read_bytes())) == "SERVING"
            assert await check(target, grpc.ssl_channel_credentials(pki.ca.read_bytes())) == "UNAVAILABLE"
    finally:
        await service.stop()


async def test_the_http_ports_context_follows_its_files(pki, successor, tmp_path):
    """The gateway's HTTP port serves from an asyncio server given `ssl_context()` and `follow`ed, as here."""
    install(pki, tmp_path, {"gateway.crt": "tls.crt", "gateway.key": "tls.key"})
    config = load(GatewayConfig, {**QUIET, "ACADEMUS_TLS_CERT": str(tmp_path / "tls.crt"),
                                  "ACADEMUS_TLS_KEY": str(tmp_path / "tls.key")})
    certificates = public_certificates(config)
    context = certificates.ssl_context()
    server = await asyncio.start_server(lambda reader, writer: writer.close(), "127.0.0.1", 0, ssl=context)
    following = asyncio.create_task(certificates.follow())
    port = server.sockets[0].getsockname()[1]

    async def presented() -> bytes:
        client = ssl.create_default_context(cafile=None)
        client.check_hostname, client.verify_mode = False, ssl.CERT_NONE   # read what is presented, trust aside
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.close()
        return der

    try:
        assert await presented() == ssl.PEM_cert_to_DER_cert(pki.cert("gateway").read_text())
        install(successor, tmp_path, {"gateway.crt": "tls.crt", "gateway.key": "tls.key"})
        await asyncio.sleep(LOOK_S * 2.5)   # the follower looks once a LOOK_S
        assert await presented() == ssl.PEM_cert_to_DER_cert(successor.cert("gateway").read_text())
    finally:
        following.cancel()
        server.close()


async def test_the_http_port_trusts_only_the_rotated_client_ca(pki, successor, tmp_path):
    """A context can only add CAs: the port's handshakes move to a context made from the new files, so clients
    the old CA signed are refused once it is rotated out."""
    files = {"gateway.crt": "tls.crt", "gateway.key": "tls.key", "ca.crt": "client-ca.crt"}
    install(pki, tmp_path, files)
    config = load(GatewayConfig, {**QUIET, "ACADEMUS_TLS_CERT": str(tmp_path / "tls.crt"),
                                  "ACADEMUS_TLS_KEY": str(tmp_path / "tls.key"),
                                  "ACADEMUS_TLS_CLIENT_CA": str(tmp_path / "client-ca.crt")})
    certificates = public_certificates(config)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"ok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=certificates.ssl_context())
    following = asyncio.create_task(certificates.follow())
    port = server.sockets[0].getsockname()[1]

    async def answered(holder: Pki) -> bool:
        """Whether a client presenting `holder`'s certificate is answered (TLS 1.3 refuses it after the client's
        handshake: its first read fails or finds the connection closed)."""
        client = ssl.create_default_context()
        client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
        client.load_cert_chain(holder.cert(CLI), holder.key(CLI))
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
            answer = await asyncio.wait_for(reader.read(2), 5)
            writer.close()
        except (ssl.SSLError, ConnectionError):
            return False
        return answer == b"ok"

    try:
        assert await answered(pki) and not await answered(successor)
        install(successor, tmp_path, files)
        await asyncio.sleep(LOOK_S * 2.5)   # the follower looks once a LOOK_S
        assert await answered(successor)
        assert not await answered(pki)      # the old CA is no longer trusted
    finally:
        following.cancel()
        server.close()


async def test_a_rotated_mesh_identity_is_presented_and_becomes_the_process_channels(pki, successor, tmp_path):
    files = {"ca.crt": "ca.crt", "adapter_store.crt": "mesh.crt", "adapter_store.key": "mesh.key"}
    install(pki, tmp_path, files)
    config = load(CommonConfig, {**QUIET, "ACADEMUS_MESH_TLS": "true", "ACADEMUS_MESH_CA": str(tmp_path / "ca.crt"),
                                 "ACADEMUS_MESH_CERT": str(tmp_path / "mesh.crt"),
                                 "ACADEMUS_MESH_KEY": str(tmp_path / "mesh.key")})
    service = RunningService(ServiceSpec("rotating-mesh", config, lambda server: None, []))
    await service.start()
    peers = Stubs(health_pb2_grpc.HealthStub)   # the process's cached channels to its peers
    try:
        assert await check(service.address, identity(pki, pki).channel_credentials()) == "SERVING"
        before = peers(service.address)
        await before.Check(health_pb2.HealthCheckRequest(), timeout=5)
        install(successor, tmp_path, {"ca.crt": "ca.crt", "mesh.crt": "mesh.crt", "mesh.key": "mesh.key"})
        # the process's identity follows the files on its own, no handshake arriving: channels opened from now on
        # present the new certificate
        for _ in range(int(LOOK_S * 4 / 0.05)):
            if mesh().cert == successor.cert("mesh").read_bytes():
                break
            await asyncio.sleep(0.05)
        assert mesh().cert == successor.cert("mesh").read_bytes()
        assert await check(service.address, identity(successor, successor).channel_credentials()) == "SERVING"
        assert await check(service.address, identity(pki, pki).channel_credentials()) == "UNAVAILABLE"
        after = peers(service.address)   # a new channel, on a new connection: accepted only with the new identity
        assert after is not before
        reply = await after.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await service.stop()
