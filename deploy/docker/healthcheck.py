#!/usr/bin/env python
"""Container health probe: a gRPC health Check against this container's own server.

Exit status 0 only when the server answers SERVING; 1 otherwise (not listening, NOT_SERVING during
graceful shutdown, deadline). Dials 127.0.0.1:$ACADEMUS_PORT (the images set ACADEMUS_HOST=0.0.0.0, so
loopback reaches the server). Optional argument: the service name to check ("" = the whole server).
Kubernetes' native gRPC probes (`grpc: {port: ...}`) speak plaintext only; a server serving TLS is probed
with this script (deploy/k8s/gateway.yaml). The probe takes the server's own TLS settings:
- the gateway's public port (ACADEMUS_TLS_CERT set): TLS, verified against ACADEMUS_HEALTHCHECK_CA (a PEM
  file; default: the system's roots) for the name ACADEMUS_HEALTHCHECK_SERVER_NAME (default: 127.0.0.1, the
  address dialled), so the certificate must name it; a gateway requiring client certificates
  (ACADEMUS_TLS_CLIENT_CA) cannot be probed this way;
- a service with mutual TLS (ACADEMUS_MESH_TLS): its own certificate (ACADEMUS_MESH_CERT, ACADEMUS_MESH_KEY)
  and the mesh CA (ACADEMUS_MESH_CA), as its peers dial it, checking the name ACADEMUS_MESH_SERVER_NAME
  when the mesh's certificates share one (ACADEMUS_HEALTHCHECK_SERVER_NAME, when set, comes first);
- else plaintext.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    port = os.environ.get("ACADEMUS_PORT", "")
    if not port.isdigit() or int(port) == 0:
        print(f"ACADEMUS_PORT={port!r}: a fixed port is needed to probe the server", file=sys.stderr)
        return 1
    service = argv[1] if len(argv) > 1 else ""
    timeout = float(os.environ.get("ACADEMUS_HEALTHCHECK_TIMEOUT_S", "3"))
    try:
        credentials = tls(os.environ)
        name = server_name(os.environ)
        options = [("grpc.ssl_target_name_override", name)] if credentials and name else []
        with (grpc.secure_channel(f"127.0.0.1:{port}", credentials, options) if credentials
              else grpc.insecure_channel(f"127.0.0.1:{port}")) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
    except grpc.RpcError as e:
        print(f"127.0.0.1:{port} health check failed: {e.code().name}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"{e.filename}: cannot read it ({e.strerror})", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"127.0.0.1:{port} {service or '(server)'} {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def server_name(env: Mapping[str, str]) -> str:
    """The name the server's certificate must hold, where it is not the address dialled: the probe's own
    setting, else, for a service of a mesh whose certificates share one name, that name."""
    if name := env.get("ACADEMUS_HEALTHCHECK_SERVER_NAME", ""):
        return name
    return "" if env.get("ACADEMUS_TLS_CERT") else env.get("ACADEMUS_MESH_SERVER_NAME", "")


def tls(env: Mapping[str, str]) -> grpc.ChannelCredentials | None:
    """The probe's TLS credentials for the server these settings configure; None: plaintext."""
    if env.get("ACADEMUS_TLS_CERT"):
        ca = env.get("ACADEMUS_HEALTHCHECK_CA")
        return grpc.ssl_channel_credentials(Path(ca).read_bytes() if ca else None)
    if env.get("ACADEMUS_MESH_TLS", "").lower() in ("1", "true", "yes", "on"):
        ca, key, cert = (Path(env.get(f"ACADEMUS_MESH_{part}", "")).read_bytes() for part in ("CA", "KEY", "CERT"))
        return grpc.ssl_channel_credentials(ca, key, cert)
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv))
