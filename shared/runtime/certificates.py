"""A server's TLS files read again when they change, so that a rotated certificate (cert-manager renewing a
Secret mounted in place, a new `academus certs`) is presented without a restart: gRPC asks for it at each new
connection's handshake (`grpc.dynamic_ssl_server_credentials`), the HTTP port's handshakes take the context each
new set comes with (`follow`). Either way the new set replaces the old whole: a client CA rotated out is no
longer trusted. Connections already open keep the certificate they were made with.

A change is taken only whole: the files must read as PEM and the key must match the certificate. A rotation
caught half-written (a key replaced before its certificate) is logged and skipped, and taken at the first look
after the writes end. Files are looked at at most once a LOOK_S, by their stat (a Secret's update swaps a
symlink: the target's inode changes)."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections.abc import Callable

import grpc

from academus.shared.runtime.config import CommonConfig, ConfigError, GatewayConfig, env_name
from academus.shared.runtime.logs import log_event
from academus.shared.runtime.tls import MeshTls, read_pem, use_mesh

LOOK_S = 1.0
Named = tuple[str, str]   # (the setting, the path it names)


class ServerCertificates:
    """A server's key and certificate and, where clients must present one, the CA that signs theirs."""

    def __init__(self, key: Named, cert: Named, client_ca: Named | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.files = (key, cert, *((client_ca,) if client_ca else ()))
        self.clock = clock
        self._stamp = self._stamps()
        # at start, an error stops the service naming it; `_checked`: the set's context, which proved the key is the
        # certificate's and which the HTTP port's handshakes take (`ssl_context`)
        self.key, self.cert, self.client_ca, self._checked = self._read()
        self._looked = clock()
        self.reloads = 0

    @property
    def paths(self) -> list[str]:
        return [path for _, path in self.files]

    def reload(self) -> bool:
        """Reads the files again if they changed since the last look (at most one look a LOOK_S); whether it
        took a new whole set."""
        now = self.clock()
        if now - self._looked < LOOK_S:
            return False
        self._looked = now
        stamp = self._stamps()
        if stamp is None or stamp == self._stamp:
            return False
        self._stamp = stamp   # a set that fails is reported once; the rotation's next write makes a new stamp
        try:
            self.key, self.cert, self.client_ca, self._checked = self._read()
        except ConfigError as e:
            log_event("certificate_reload_skipped", logging.WARNING, error=str(e))
            return False
        self.reloads += 1
        log_event("certificate_reloaded", files=self.paths)
        return True

    def _read(self) -> tuple[bytes, bytes, bytes | None, ssl.SSLContext]:
        (key_setting, key_path), (cert_setting, cert_path) = self.files[:2]
        key, cert = read_pem(key_setting, key_path), read_pem(cert_setting, cert_path)
        client_ca = read_pem(*self.files[2]) if len(self.files) > 2 else None
        try:   # what a handshake would find: a key that signs for the certificate
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(cert_path, key_path)
            if client_ca is not None:
                context.load_verify_locations(cadata=client_ca.decode())
                context.verify_mode = ssl.CERT_REQUIRED
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"{env_name(key_setting)}={key_path!r} is not the key of "
                              f"{env_name(cert_setting)}={cert_path!r} ({e})") from e
        return key, cert, client_ca, context

    def _stamps(self) -> tuple | None:
        try:
            return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in (os.stat(p) for p in self.paths))
        except OSError:   # a file missing in the middle of a rotation: looked at again next time
            return None

    # -- gRPC ------------------------------------------------------------------------------
    def configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key, self.cert)], root_certificates=self.client_ca)

    def credentials(self) -> grpc.ServerCredentials:
        """A gRPC port's credentials, asking for a client certificate where a client CA is set."""
        return grpc.dynamic_ssl_server_credentials(
            self.configuration(), lambda: self.configuration() if self.reload() else None,
            require_client_authentication=self.client_ca is not None)

    # -- the HTTP port ---------------------------------------------------------------------
    def ssl_context(self) -> ssl.SSLContext:
        """An asyncio server's context. Each handshake switches to the newest set's context (the server-name
        callback runs for every ClientHello, a name sent or not), which `follow` keeps current: a context cannot
        forget a CA it trusted, so a client CA rotated out must not stay in the one in use."""
        listening = self._checked
        listening.sni_callback = self._to_newest
        return listening

    def _to_newest(self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        connection.context = self._checked

    async def follow(self) -> None:
        """Looks at the files once a LOOK_S, so that the HTTP port's next handshakes take a new set (an asyncio
        server's handshakes run on the loop, so none is half-way through meanwhile)."""
        while True:
            await asyncio.sleep(LOOK_S)
            self.reload()


def public_certificates(config: GatewayConfig) -> ServerCertificates | None:
    """The gateway's public ports' files: `tls_cert` and `tls_key`, and `tls_client_ca` where clients must present
    a certificate it signed; None: plaintext."""
    if not config.tls_cert:
        return None
    client_ca = ("tls_client_ca", config.tls_client_ca) if config.tls_client_ca else None
    return ServerCertificates(("tls_key", config.tls_key), ("tls_cert", config.tls_cert), client_ca)


def public_credentials(config: GatewayConfig) -> grpc.ServerCredentials | None:
    """The gateway's public gRPC port: TLS with `tls_cert` when it is set, requiring a client certificate that
    `tls_client_ca` signed when that is set too; None: plaintext."""
    certificates = public_certificates(config)
    return None if certificates is None else certificates.credentials()


def mesh_certificates(config: CommonConfig) -> ServerCertificates:
    """The mesh's files: the process's key and certificate, and the CA its peers' certificates must have."""
    return ServerCertificates(("mesh_key", config.mesh_key), ("mesh_cert", config.mesh_cert),
                              ("mesh_ca", config.mesh_ca))


def mesh_credentials(config: CommonConfig) -> grpc.ServerCredentials:
    """An internal server's mutual TLS, its files followed."""
    return mesh_certificates(config).credentials()


async def follow_mesh_identity(config: CommonConfig, mesh: MeshTls) -> None:
    """The process's identity in the mesh follows its files too, on its own clock: a port's credentials reload
    only at an incoming handshake, and a process may get none for days. Channels opened afterwards present the
    new identity, and the channel caches renew theirs (`mesh_generation`)."""
    certificates = mesh_certificates(config)
    while True:
        await asyncio.sleep(LOOK_S)
        if certificates.reload():
            use_mesh(MeshTls(certificates.client_ca or mesh.ca, certificates.key, certificates.cert, mesh.server_name),
                     config.mesh_token)
