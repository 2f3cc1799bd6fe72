"""The project's shared code is layered: runtime < state < models < training < cli, and the client SDK
stands apart on the runtime. Every import (a function's own included) points down or sideways within a
layer, and no modules import each other in a circle."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"
LAYERS = ["runtime", "state", "models", "training", "cli"]
# The light client: modules that import with grpcio and protobuf alone, and tracing only when OpenTelemetry is
# installed (tests/e2e/test_light_client.py installs it alone).
CLIENT_MAY_IMPORT = {"runtime.errors", "runtime.multiplex", "runtime.tls", "runtime.tracing"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SHARED).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """The shared modules a file imports anywhere in it, as names relative to `academus.shared`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("academus.shared"):
            base = node.module.removeprefix("academus.shared").lstrip(".")
            for alias in node.names:  # `from academus.shared.runtime import config` names a module
                candidate = f"{base}.{alias.name}" if base else alias.name
                found.add(candidate if _exists(candidate) else base)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("academus.shared."):
                    found.add(alias.name.removeprefix("academus.shared."))
    return {name for name in found if name}


def _exists(name: str) -> bool:
    path = SHARED.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) - {module_name(p)} for p in sorted(SHARED.rglob("*.py"))}


def layer(name: str) -> str:
    return name.split(".")[0]


def test_every_module_lives_in_a_layer_or_the_client():
    stray = [m for m in graph() if m and layer(m) not in {*LAYERS, "client"}]
    assert not stray, f"modules outside the layers {LAYERS}: {stray}"


def test_imports_point_down_the_layers():
    upward = []
    for module, targets in graph().items():
        if not module or layer(module) == "client":
            continue
        for target in targets:
            if layer(target) == "client" or LAYERS.index(layer(target)) > LAYERS.index(layer(module)):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports pointing up a layer:\n" + "\n".join(sorted(upward))


def test_the_client_imports_only_what_it_needs_from_the_runtime():
    extra = [f"{m} -> {t}" for m, ts in graph().items() if layer(m) == "client"
             for t in ts if layer(t) != "client" and t not in CLIENT_MAY_IMPORT]
    assert not extra, "the client SDK imports server code:\n" + "\n".join(extra)


# Imports see only the standard library, grpcio (with its typing_extensions) and protobuf, as a client-only
# install has them; the installed check is tests/e2e/test_light_client.py's.
LIGHT_INSTALL = """
import asyncio, sys
ALLOWED = set(sys.stdlib_module_names) | {"grpc", "google", "typing_extensions", "academus"}

class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in ALLOWED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Missing())
from academus.client import AsyncClient, Client

async def streams() -> None:
    await AsyncClient("127.0.0.1:1", streams=True).close()

Client("127.0.0.1:1").close()
asyncio.run(streams())
"""


def test_the_client_imports_and_opens_its_channels_with_grpcio_and_protobuf_alone():
    result = subprocess.run([sys.executable, "-c", LIGHT_INSTALL], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_no_modules_import_each_other_in_a_circle():
    assert cycles(graph()) == []


@pytest.mark.parametrize("edges,expected", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
])
def test_the_circle_finder_finds_circles(edges, expected):
    assert cycles(edges) == expected
