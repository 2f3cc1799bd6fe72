"""The client SDK installed alone (`pip install academus`: grpcio and protobuf, no torch) in a fresh virtual
environment, calling the mesh through the real gateway; and `list_models` through it from this environment."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from academus.client import AsyncClient, Client
from academus.shared.cli.mesh import MeshState

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SERVER_ONLY = {"torch", "numpy", "transformers", "redis", "opentelemetry-api", "prometheus-client"}
SPAM = "Congratulations! You have won a free cruise, click here to claim your prize now!!!"
HAM = "Hi Tom, the meeting moved to 3pm tomorrow, see you in room 204."
# Run by the light environment's python: what a user of the client alone writes.
SCRIPT = f"""
import asyncio, json, sys
from academus.client import AsyncClient, Client

target, key = sys.argv[1:3]
with Client(target, api_key=key, timeout=30) as client:
    models = {{m.name: m.kind for m in client.list_models()}}
    label = client.infer("spam", [{SPAM!r}]).predictions[0].label

async def streamed() -> str:
    async with AsyncClient(target, api_key=key, timeout=30, streams=True) as client:
        return (await client.infer("spam", [{HAM!r}])).predictions[0].label

print(json.dumps({{"models": models, "label": label, "streamed": asyncio.run(streamed())}}))
"""


def run(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300, cwd=cwd)


def source_copy(to: Path) -> Path:
    """What the wheel is built from, copied: a build in the checkout would leave build/ there, whose stale
    modules the next wheel would carry."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = {Path(d).parts[0] for d in pyproject["tool"]["setuptools"]["package-dir"].values()}
    for folder in folders:
        shutil.copytree(ROOT / folder, to / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for file in ("pyproject.toml", pyproject["project"]["readme"]):
        shutil.copy(ROOT / file, to / file)
    return to


@pytest.fixture(scope="module")
def light_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The python of a new virtual environment holding the project's wheel and its own dependencies only."""
    tmp = tmp_path_factory.mktemp("light")
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist",
                source_copy(tmp / "src"))
    assert built.returncode == 0, built.stderr
    wheel = next((tmp / "dist").glob("academus-*.whl"))
    made = run(sys.executable, "-m", "venv", tmp / "venv")
    assert made.returncode == 0, made.stderr
    python = tmp / "venv" / "bin" / "python"
    installed = run(python, "-m", "pip", "install", "-q", wheel)
    if installed.returncode != 0:
        # told apart from a bad install by asking the index for one small package, bypassing pip's cache
        probe = run(python, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir", "-d", tmp / "probe",
                    "protobuf")
        if probe.returncode != 0:
            pytest.skip(f"the package index is unreachable: {probe.stderr.strip().splitlines()[-1:]}")
        pytest.fail(f"installing {wheel.name} failed:\n{installed.stderr}")
    yield python


def test_the_client_alone_installs_without_torch_and_serves_through_the_gateway(light_python, mesh, admin_key):
    listed = run(light_python, "-m", "pip", "list", "--format=json")
    names = {p["name"].lower().replace("_", "-") for p in json.loads(listed.stdout)}
    assert {"academus", "grpcio", "protobuf"} <= names and not names & SERVER_ONLY, sorted(names)
    torch = run(light_python, "-c", "import torch")
    assert torch.returncode != 0 and "No module named 'torch'" in torch.stderr
    out = run(light_python, "-c", SCRIPT, mesh.gateway, admin_key, cwd=light_python.parent)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["models"]["spam"] == "classification" and answer["models"]["minilm"] == "embedding"
    assert (answer["label"], answer["streamed"]) == ("spam", "ham")
    command = run(light_python.parent / "academus", "up")   # the server's command: what to install, no traceback
    assert command.returncode == 2 and "pip install 'academus[server]'" in command.stderr
    assert len(command.stderr.strip().splitlines()) == 1, command.stderr


async def test_list_models_gives_each_served_models_kind_labels_and_limits(mesh: MeshState, admin_key):
    with Client(mesh.gateway, api_key=admin_key) as client:
        models = {m.name: m for m in client.list_models()}
    spam = models["spam"]
    assert (spam.kind, spam.labels, spam.base, spam.status) == ("classification", ["ham", "spam"], "", "ready")
    assert models["minilm"].kind == "embedding" and models["minilm"].dim == 384 and spam.max_tokens > 0
    async with AsyncClient(mesh.gateway, api_key=admin_key, streams=True) as streamed:
        assert [m.name for m in await streamed.list_models()] == sorted(models)
