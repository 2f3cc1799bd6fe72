#!/bin/sh
# Container entry point for every Academus service image.
# Services register `ACADEMUS_ADVERTISE_HOST:port` in Redis for others to dial; inside a container the
# bind address (0.0.0.0) is no such address. When the variable is unset or empty, use this container's
# own IP (what its hostname resolves to: the container IP under Docker, the pod IP under Kubernetes),
# so `docker compose up --scale worker=N` works without per-replica settings. Then exec CMD.
set -eu
# If the hostname does not resolve (or only to loopback), the variable is left as it was and the
# service falls back to its default (ACADEMUS_HOST).
if [ -z "${ACADEMUS_ADVERTISE_HOST:-}" ]; then
    ip="$(python -c 'import socket; a = socket.gethostbyname(socket.gethostname()); print("" if a.startswith("127.") else a)' 2>/dev/null)" || ip=""
    if [ -n "$ip" ]; then
        ACADEMUS_ADVERTISE_HOST="$ip"
        export ACADEMUS_ADVERTISE_HOST
    fi
fi
exec "$@"
