#!/usr/bin/env python
"""Container health probe: a gRPC health Check against this container's own server.

Exit status 0 only when the server answers SERVING; 1 otherwise (not listening, NOT_SERVING during
graceful shutdown, deadline). Dials 127.0.0.1:$ACADEMUS_PORT (the images set ACADEMUS_HOST=0.0.0.0, so
loopback reaches the server). Optional argument: the service name to check ("" = the whole server).
Kubernetes does not need this: its probes speak gRPC health natively (`grpc: {port: ...}`).
"""

from __future__ import annotations

import os
import sys

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
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
    except grpc.RpcError as e:
        print(f"127.0.0.1:{port} health check failed: {e.code().name}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"127.0.0.1:{port} {service or '(server)'} {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
