#!/usr/bin/env bash
# The compose mesh's sequential latency with the node-local plane (as deploy/compose.yaml ships it) and without
# (plane_off.yaml), ROUNDS rounds, the arms' order alternating; the gateway, scheduler and worker recreated for
# each arm. Run from the repository root after deploy/docker/check.sh built the images:
#   bash docs/benchmarks/data/deploy/2026-12-07-compose-plane/plane_ab.sh ROUNDS N OUT.jsonl
# COMPOSE, COMPOSE_YAML and SEED as for check.sh. An administrator's key: a tenant's quota (100/s) would pace it.
set -euo pipefail
ROUNDS=$1 N=$2 OUT=$3
HERE=$(cd "$(dirname "$0")" && pwd)
COMPOSE=${COMPOSE:-docker compose}
COMPOSE_YAML=${COMPOSE_YAML:-deploy/compose.yaml}
WORK=$(mktemp -d)
export ACADEMUS_REDIS_PASSWORD ACADEMUS_GATEWAY_PORT=127.0.0.1:50761 ACADEMUS_GATEWAY_HTTP_PORT=127.0.0.1:8791 \
    ACADEMUS_GATEWAY_METRICS_PORT=50762 ACADEMUS_CERTS_SEED="$WORK/certs" ACADEMUS_ARTIFACTS_SEED
ACADEMUS_REDIS_PASSWORD=$(python3 -c "import secrets; print(secrets.token_hex(24))")
ACADEMUS_ARTIFACTS_SEED=$(cd "${SEED:-.academus/artifacts}" && pwd)
compose() { $COMPOSE -p academus-plane "$@"; }
trap 'compose -f "$COMPOSE_YAML" --profile init down -v >/dev/null 2>&1; rm -rf "$WORK"' EXIT
healthy() { docker inspect -f '{{.State.Health.Status}}' "$(compose -f "$COMPOSE_YAML" ps -q gateway)"; }

academus certs "$WORK/certs" >/dev/null
compose -f "$COMPOSE_YAML" --profile init run --rm artifacts-init >/dev/null 2>&1
compose -f "$COMPOSE_YAML" --profile init run --rm certs-init >/dev/null 2>&1
compose -f "$COMPOSE_YAML" up -d >/dev/null 2>&1
key=$(compose -f "$COMPOSE_YAML" exec -T gateway academus keys create admin | python3 -c "import json, sys; print(json.load(sys.stdin)['key'])")
: > "$OUT"
for round in $(seq 0 $((ROUNDS - 1))); do
    arms=(plane grpc); [ $((round % 2)) = 1 ] && arms=(grpc plane)
    for arm in "${arms[@]}"; do
        files=(-f "$COMPOSE_YAML"); [ "$arm" = grpc ] && files+=(-f "$HERE/plane_off.yaml")
        compose "${files[@]}" up -d gateway scheduler worker >/dev/null 2>&1
        sleep 5
        for _ in $(seq 1 180); do [ "$(healthy)" = healthy ] && break; sleep 1; done
        python "$HERE/sequential.py" localhost:50761 "$WORK/certs/ca.crt" "$key" "$N" "$arm" "$round" | tee -a "$OUT"
    done
done
