#!/usr/bin/env bash
# Checks the container deployment as an operator would use it: builds the images, starts deploy/compose.yaml
# under a compose project of its own, and asks it what a user asks (deploy/README.md, "Checking the images").
#   bash deploy/docker/check.sh            (from the repository root, after `make setup` and `make prepare`)
# Needs docker with BuildKit, compose, and the `academus` command on the host (the client side of the checks).
# Settings (environment):
#   COMPOSE          the compose command (default `docker compose`)
#   COMPOSE_YAML     the compose file (default deploy/compose.yaml)
#   BUILD_ARGS       more `docker build` arguments, e.g. "--build-arg TORCH_INDEX=URL --network host"
#   SEED             the artifacts copied into the volume (default .academus/artifacts)
#   CHECK_MODEL      a classifier the artifacts serve (default sentiment)
#   KEEP=1           leave the mesh and its volumes up afterwards
# Prints one line a check; exits non-zero at the first that fails.
set -euo pipefail

COMPOSE=${COMPOSE:-docker compose}
COMPOSE_YAML=${COMPOSE_YAML:-deploy/compose.yaml}
SEED=${SEED:-.academus/artifacts}
MODEL=${CHECK_MODEL:-sentiment}
PROJECT=academus-check
GRPC_PORT=${CHECK_GRPC_PORT:-50751}
HTTP_PORT=${CHECK_HTTP_PORT:-8781}
WORK=$(mktemp -d)
export ACADEMUS_REDIS_PASSWORD ACADEMUS_GATEWAY_PORT="127.0.0.1:${GRPC_PORT}" \
    ACADEMUS_GATEWAY_HTTP_PORT="127.0.0.1:${HTTP_PORT}" ACADEMUS_GATEWAY_METRICS_PORT=$((GRPC_PORT + 1)) \
    ACADEMUS_CERTS_SEED="$WORK/certs" ACADEMUS_ARTIFACTS_SEED DOCKER_BUILDKIT=1
ACADEMUS_REDIS_PASSWORD=$(python3 -c "import secrets; print(secrets.token_hex(24))")
ACADEMUS_ARTIFACTS_SEED=$(cd "$SEED" && pwd)

compose() { $COMPOSE -p "$PROJECT" -f "$COMPOSE_YAML" "$@"; }
ok() { printf 'ok    %s\n' "$*"; }
fail() { printf 'FAIL  %s\n' "$*"; exit 1; }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }
cleanup() {
    if [ "${KEEP:-0}" = 1 ]; then echo "kept: $COMPOSE -p $PROJECT -f $COMPOSE_YAML down -v (certificates in $WORK)"
    else compose --profile init --profile plot down -v --remove-orphans >/dev/null 2>&1 || true; rm -rf "$WORK"; fi
}
trap cleanup EXIT

# A classifier's answer through the public port (TLS), as the SDK's command line gives it: its JSON line.
infer() { academus infer --gateway "localhost:${GRPC_PORT}" --ca "$WORK/certs/ca.crt" --key "$1" --model "$MODEL" \
    "a wonderful, moving film" 2>&1 | tail -1; }
PY=$(dirname "$(command -v academus)")/python   # the interpreter with the SDK (the venv `make setup` made)
killed_and_served() {   # kill -9 of a service's process, then the seconds until the gateway answers again
    "$PY" deploy/docker/served_again.py "$(docker inspect -f '{{.State.Pid}}' "$(compose ps -q "$1")")" \
        "localhost:${GRPC_PORT}" "$WORK/certs/ca.crt" "$key" "$MODEL" "$2"
}
health() { docker inspect -f '{{.State.Health.Status}}' "$(compose ps -q "$1")"; }

start=$(now)
for target in gateway scheduler worker resource_manager adapter_store trainer; do
    # shellcheck disable=SC2086   # BUILD_ARGS is several words on purpose
    docker build -q -f deploy/docker/Dockerfile --target "$target" ${BUILD_ARGS:-} \
        -t "academus/${target//_/-}:dev" . >/dev/null || fail "docker build --target $target"
done
ok "six images built in $(since "$start") s"

academus certs "$WORK/certs" >/dev/null
compose --profile init run --rm artifacts-init >/dev/null 2>&1 || fail "artifacts-init"
compose --profile init run --rm certs-init >/dev/null 2>&1 || fail "certs-init"
start=$(now)
compose up -d >/dev/null 2>&1 || fail "compose up"
for _ in $(seq 1 180); do [ "$(health gateway)" = healthy ] && break; sleep 1; done
[ "$(health gateway)" = healthy ] || fail "the gateway is not healthy after 180 s"
for service in redis resource-manager scheduler worker adapter-store trainer; do
    [ "$(health "$service")" = healthy ] || fail "$service is $(health "$service")"
done
ok "every service healthy $(since "$start") s after compose up"

key=$(compose exec -T gateway academus keys create check | python3 -c "import json, sys; print(json.load(sys.stdin)['key'])")
answer=$(infer "$key")
case "$answer" in '{"text"'*'"label"'*) ok "a key made in the gateway's container is served over TLS: $answer" ;;
    *) fail "infer with the new key: $answer" ;; esac

compose exec -T gateway academus status > "$WORK/status.txt" \
    || fail "academus status in the gateway's container: $(cat "$WORK/status.txt")"
grep -q '^gateway .*SERVING' "$WORK/status.txt" \
    || fail "academus status lists no gateway SERVING: $(cat "$WORK/status.txt")"
ok "academus status in the gateway's container: Redis, the gateway (over its TLS, as a client reaches it) and \
$(($(grep -c SERVING "$WORK/status.txt") - 2)) registered services SERVING over the mesh's mutual TLS"

plane_connections() {   # a service's academus_local_plane_connections, read from its own metrics port
    compose exec -T "$1" python -c "import os, urllib.request as u; print(u.urlopen('http://127.0.0.1:%s/metrics' \
        % os.environ['ACADEMUS_METRICS_PORT']).read().decode())" | awk '/^academus_local_plane_connections /{print $2}'
}
for _ in 1 2 3; do infer "$key" >/dev/null; done
for service in scheduler worker; do
    connections=$(plane_connections "$service")
    python3 -c "import sys; assert float(sys.argv[1] or 0) >= 1" "$connections" \
        || fail "the $service's local plane has no connection ($connections): its hops ride gRPC"
done
ok "the hops between containers ride the node-local plane (scheduler and worker connections open)"

embedded=$(curl -sS --cacert "$WORK/certs/ca.crt" -H "Authorization: Bearer $key" -H 'content-type: application/json' \
    -d '{"inputs": "hello", "model": "minilm"}' "https://localhost:${HTTP_PORT}/embed")
python3 -c "import json, sys; v = json.loads(sys.argv[1]); assert len(v) == 1 and len(v[0]) == 384" "$embedded" \
    || fail "HTTP /embed over TLS: ${embedded:0:200}"
ok "HTTP /embed over TLS answers one 384-dimension vector"

plain=$(academus infer --gateway "127.0.0.1:${GRPC_PORT}" --key "$key" --model "$MODEL" hello 2>&1 | tail -1 || true)
case "$plain" in '{'*) fail "a plaintext client was served: $plain" ;; esac
ok "a plaintext client is refused: $plain"

denied=$(academus infer --gateway "localhost:${GRPC_PORT}" --ca "$WORK/certs/ca.crt" --key acd_check_wrong \
    --model "$MODEL" hello 2>&1 | tail -1 || true)
case "$denied" in UNAUTHENTICATED*) ok "a wrong key is refused: $denied" ;; *) fail "a wrong key: $denied" ;; esac

for service in worker scheduler gateway; do
    took=$(killed_and_served "$service" 120) || fail "not served within 120 s of a kill -9 of the $service"
    ok "kill -9 of the $service: restarted by Docker, served again after $took s"
done

start=$(now)
took=$(killed_and_served redis 60) || fail "not served within 60 s of a kill -9 of Redis"
sleep 1
for _ in $(seq 1 60); do [ "$(health redis)" = healthy ] && break; sleep 1; done
[ "$(health redis)" = healthy ] || fail "Redis is not healthy 60 s after a kill -9"
compose exec -T gateway academus keys list --tenant check | grep -q '"tenant": "check"' \
    || fail "the key made before Redis's kill -9 is gone"
ok "kill -9 of Redis: served again after $took s, Redis healthy again after $(since "$start") s, the key kept (AOF)"
