"""The SDK over TLS: real handshakes with a grpc.aio server on loopback holding self-signed certificates made
with the `openssl` command; the server's certificate is verified, and a client's own is sent when asked."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from academus.client import AcademusError, AsyncClient, Client
from academus.shared.runtime.tls import channel_credentials
from academus.v1 import inference_pb2 as pb
from academus.v1 import inference_pb2_grpc

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="no `openssl` command to make certificates")


@dataclass(frozen=True)
class Pem:
    key: bytes
    cert: bytes


def self_signed(directory: Path, name: str) -> Pem:
    """A key and a certificate for 127.0.0.1 that is its own issuer (its holder's root)."""
    key, cert = directory / f"{name}.key", directory / f"{name}.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return Pem(key.read_bytes(), cert.read_bytes())


@pytest.fixture(scope="module")
def pems(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pem]:
    directory = tmp_path_factory.mktemp("pki")
    return {name: self_signed(directory, name) for name in ("server", "client", "stranger")}


class Echo(inference_pb2_grpc.InferenceServicer):
    async def Infer(self, request, context):
        return pb.InferResponse(model=request.model)

    async def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[pb.ModelInfo(name="spam", kind="classification")])


@pytest.fixture
async def tls_server(pems):
    servers: list[grpc.aio.Server] = []

    async def serve(client_ca: bytes | None = None) -> str:
        """A TLS server's target; `client_ca`: it requires a client certificate issued by it."""
        server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServicer_to_server(Echo(), server)
        own = [(pems["server"].key, pems["server"].cert)]
        credentials = grpc.ssl_server_credentials(own, root_certificates=client_ca,
                                                  require_client_auth=client_ca is not None)
        port = server.add_secure_port("127.0.0.1:0", credentials)
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield serve
    for server in servers:
        await server.stop(None)


async def test_a_client_that_trusts_the_servers_certificate_calls_over_tls(tls_server, pems):
    target = await tls_server()
    async with AsyncClient(target, api_key="k", timeout=5.0, root_certificates=pems["server"].cert) as client:
        assert (await client.infer("spam", ["hi"])).model == "spam"
        assert [m.name for m in await client.list_models()] == ["spam"]

    def blocking() -> str:   # in a thread: the server runs on this test's loop
        with Client(target, api_key="k", timeout=5.0, root_certificates=pems["server"].cert) as client:
            return client.infer("spam", ["hi"]).model

    assert await asyncio.to_thread(blocking) == "spam"


@pytest.mark.parametrize("options", [{"tls": True}, {"root_certificates": "stranger"}, {}],
                         ids=["system-roots", "another-root", "plaintext"])
async def test_an_unverified_server_or_a_plaintext_client_gets_no_answer(tls_server, pems, options):
    target = await tls_server()
    if "root_certificates" in options:
        options = {"root_certificates": pems[options["root_certificates"]].cert}
    async with AsyncClient(target, api_key="k", timeout=2.0, **options) as client:
        with pytest.raises(AcademusError) as refused:
            await client.infer("spam", ["hi"])
    assert refused.value.code == "UNAVAILABLE"


async def test_a_server_that_asks_for_a_client_certificate_gets_the_clients_own(tls_server, pems):
    target = await tls_server(client_ca=pems["client"].cert)
    trusted = {"root_certificates": pems["server"].cert}
    async with AsyncClient(target, timeout=5.0, private_key=pems["client"].key,
                           certificate_chain=pems["client"].cert, **trusted) as client:
        assert (await client.infer("spam", ["hi"])).model == "spam"
    async with AsyncClient(target, timeout=2.0, private_key=pems["stranger"].key,
                           certificate_chain=pems["stranger"].cert, **trusted) as client:
        with pytest.raises(AcademusError) as refused:
            await client.infer("spam", ["hi"])
    assert refused.value.code == "UNAVAILABLE"


def test_credentials_only_when_tls_is_asked_for_and_a_key_goes_with_its_certificate(pems):
    assert channel_credentials(False, None, None, None) is None
    assert isinstance(channel_credentials(True, None, None, None), grpc.ChannelCredentials)
    assert isinstance(channel_credentials(False, pems["server"].cert, None, None), grpc.ChannelCredentials)
    with pytest.raises(ValueError, match="private_key and certificate_chain go together"):
        channel_credentials(True, None, pems["client"].key, None)
