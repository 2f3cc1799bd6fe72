"""Who may call whom. TLS from PEM files that settings name: the gateway's public port (the server's
certificate, a client's when `tls_client_ca` asks for one), and mutual TLS among the mesh's services
(`mesh_tls`), where every internal server and channel presents the process's certificate and accepts only a
peer whose certificate the mesh CA signed. A file that cannot be read stops the service at start, naming the
setting and the path. Without mutual TLS, the mesh's token (`mesh_token`) keeps its internal services to its
members: every call between services carries it, and a service other than the gateway refuses a call without
it (`MeshTokenCheck`).

A process has one identity in the mesh: `RunningService.start` sets it from the service's settings
(`use_mesh`), the CLI from the mesh's state, and every internal channel opened afterwards (`mesh_channel`,
`mesh_channel_sync`) carries it. Imports grpc, the standard library, config.py and interceptors.py only: the
light client SDK makes its credentials here too."""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from academus.shared.runtime.config import CommonConfig, ConfigError, env_name
from academus.shared.runtime.interceptors import is_plumbing

PEM_MARK = b"-----BEGIN "
MESH_TOKEN_KEY = "academus-mesh-token"   # call metadata: the mesh's shared secret (`mesh_token`)
Options = Sequence[tuple[str, object]]


def channel_credentials(tls: bool, root_certificates: bytes | None, private_key: bytes | None,
                        certificate_chain: bytes | None) -> grpc.ChannelCredentials | None:
    """TLS credentials, or None for a plaintext channel. Any certificate asks for TLS; `root_certificates`
    (PEM) replace the system's roots; `private_key` and `certificate_chain` (PEM) are the client's own, for a
    server that asks for one (mutual TLS)."""
    if not (tls or root_certificates or private_key or certificate_chain):
        return None
    if (private_key is None) != (certificate_chain is None):
        raise ValueError("private_key and certificate_chain go together: the client's key and its certificate")
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)


def read_pem(setting: str, path: str) -> bytes:
    """The PEM file the setting `setting` names; ConfigError naming both when it is unreadable or holds no PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{env_name(setting)}={path!r}: cannot read it ({e.strerror or e})") from e
    if PEM_MARK not in data:
        raise ConfigError(f"{env_name(setting)}={path!r}: not a PEM file (no '-----BEGIN' line)")
    return data


@dataclass(frozen=True)
class MeshTls:
    """The process's key and certificate in the mesh and the CA every peer's certificate must be signed by (PEM)."""

    ca: bytes
    key: bytes
    cert: bytes
    server_name: str = ""   # what a peer's certificate must name; empty: the address dialled

    @classmethod
    def from_config(cls, config: CommonConfig) -> MeshTls | None:
        """None unless `mesh_tls` is on."""
        if not config.mesh_tls:
            return None
        return cls(read_pem("mesh_ca", config.mesh_ca), read_pem("mesh_key", config.mesh_key),
                   read_pem("mesh_cert", config.mesh_cert), config.mesh_server_name)

    def channel_options(self) -> Options:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    @classmethod
    def from_files(cls, ca: str, key: str, cert: str, server_name: str = "") -> MeshTls:
        return cls(Path(ca).read_bytes(), Path(key).read_bytes(), Path(cert).read_bytes(), server_name)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


_mesh: MeshTls | None = None   # the identity of this process's internal channels
_token = ""                    # ... and the mesh's token they carry
_generation = 0                # how many times they changed: a channel cache renews what it opened before


def use_mesh(tls: MeshTls | None, token: str = "") -> None:
    """Internal channels opened from now on present `tls` (None: plaintext) and carry `token` (empty: none)."""
    global _mesh, _token, _generation
    _mesh, _token, _generation = tls, token, _generation + 1


def mesh_generation() -> int:
    """Changes with every `use_mesh`: a cached channel opened under another generation presents an identity the
    process no longer has (a rotated certificate), and gRPC cannot change an open channel's credentials."""
    return _generation


def mesh() -> MeshTls | None:
    return _mesh


def mesh_metadata() -> tuple[tuple[str, str], ...]:
    """What a call to a peer of the mesh carries besides its own metadata: the mesh's token, when it has one.
    A multiplexed hop sends it once, with its stream (`over_streams`), not with every frame."""
    return ((MESH_TOKEN_KEY, _token),) if _token else ()


def open_channel(target: str, credentials: grpc.ChannelCredentials | None, options: Options = (),
                 interceptors: Sequence = ()) -> grpc.aio.Channel:
    """An asyncio channel: TLS with `credentials`, plaintext without."""
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)


def open_channel_sync(target: str, credentials: grpc.ChannelCredentials | None, options: Options = ()) -> grpc.Channel:
    """The blocking `open_channel`."""
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)


def mesh_channel(target: str, options: Options = (), interceptors: Sequence = ()) -> grpc.aio.Channel:
    """An asyncio channel to another service of the mesh, with the process's identity when it has one."""
    carries = [CarriesMeshToken(_token)] if _token else []
    return open_channel(target, *_as_mesh(options), [*carries, *interceptors])


def mesh_channel_sync(target: str, options: Options = ()) -> grpc.Channel:
    """The blocking `mesh_channel`."""
    channel = open_channel_sync(target, *_as_mesh(options))
    return grpc.intercept_channel(channel, CarriesMeshTokenSync(_token)) if _token else channel


def _as_mesh(options: Options) -> tuple[grpc.ChannelCredentials | None, Options]:
    """The credentials and options of a channel to a peer of the mesh: plaintext, or its mutual TLS."""
    if _mesh is None:
        return None, options
    return _mesh.channel_credentials(), [*options, *_mesh.channel_options()]


class CarriesMeshToken(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    """Adds the mesh's token to a channel's unary and server-streaming calls. Not to its bidirectional ones:
    grpc.aio relays every message of an intercepted stream through a queue of its own, and the one such stream,
    the multiplexed hop's, sends the token in its own metadata."""

    def __init__(self, token: str) -> None:
        self.token = token

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), (MESH_TOKEN_KEY, self.token))
        return details._replace(metadata=metadata)

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


class CarriesMeshTokenSync(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                           grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """The blocking channels' `CarriesMeshToken`, every kind of call (none of them is on the request path)."""

    def __init__(self, token: str) -> None:
        self.token = token

    def _call(self, continuation, details, request):
        metadata = [*(details.metadata or ()), (MESH_TOKEN_KEY, self.token)]
        return continuation(details._replace(metadata=metadata), request)

    intercept_unary_unary = intercept_unary_stream = _call
    intercept_stream_unary = intercept_stream_stream = _call


class MeshTokenCheck(grpc.aio.ServerInterceptor):
    """An internal service's gate: a call without the mesh's token is refused UNAUTHENTICATED before its request
    is parsed or its handler runs. Health checks and reflection pass (probes and `academus status` hold no
    token; neither tells anything secret). The frames of a multiplexed stream are not checked one by one: the
    stream was, when it opened, and so was the node-local plane's token it learnt from it."""

    def __init__(self, token: str) -> None:
        self.token = token.encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or is_plumbing(method) or self._carries(handler_call_details.invocation_metadata):
            return handler
        name = method.decode() if isinstance(method, bytes) else method
        return refusing(handler, grpc.StatusCode.UNAUTHENTICATED,
                        f"{name} takes calls from the mesh's services only: metadata {MESH_TOKEN_KEY!r} is "
                        "missing or wrong (ACADEMUS_MESH_TOKEN)")

    def _carries(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        for key, value in metadata or ():
            if key == MESH_TOKEN_KEY:
                return hmac.compare_digest(value if isinstance(value, bytes) else value.encode(), self.token)
        return False


def refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that answers every call `code` with `details`, its request unread."""

    async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

    kind = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return kind[handler.request_streaming, handler.response_streaming](refuse)
