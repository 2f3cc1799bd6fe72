"""docs/configuration.md is generated from the config classes and current; the environment is read in
shared/runtime/config.py only."""
from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest

from academus.shared.cli.main import main as academus
from academus.shared.runtime import config
from academus.shared.runtime.config_docs import COMMAND, DOC, config_classes, loaded_classes, readers, render

ROOT = Path(__file__).resolve().parents[2]
ENVIRONMENT_HOME = "shared/runtime/config.py"
ALLOWED: set[str] = set()
ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def test_the_reference_is_current():
    assert DOC.read_text(encoding="utf-8") == render(), f"{DOC} is stale: run `{COMMAND}`"


def test_every_setting_of_every_config_class_is_documented():
    text = render()
    for cls in config_classes():
        for f in fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} has no description: give it setting(..., doc)"
            assert f"| `{config.env_name(f.name)}` | {f.type} |" in text, f"{cls.__name__}.{f.name} is missing"


def test_every_config_class_is_read_by_a_service():
    loaded = loaded_classes()
    assert {name for names in loaded.values() for name in names} >= {c.__name__ for c in config_classes()[1:]}
    services = sorted(p.parent.name for p in (ROOT / "services").glob("*/server.py"))
    assert readers(config.CommonConfig, loaded) == services
    assert readers(config.WorkerConfig, loaded) == ["worker"]


def test_the_error_states_the_documented_range():
    row = next(line for line in render().splitlines() if line.startswith("| `ACADEMUS_MAX_GET_MANY` |"))
    with pytest.raises(config.ConfigError, match=r"ACADEMUS_MAX_GET_MANY=0 must be in 1\.\.256") as refused:
        config.load(config.AdapterStoreConfig, {"ACADEMUS_MAX_GET_MANY": "0"})
    assert "| 1..256 |" in row and str(refused.value).endswith("1..256")


def test_check_fails_on_a_stale_file_and_names_the_command(tmp_path, capsys):
    out = tmp_path / "configuration.md"
    out.write_text("# Configuration reference\n", encoding="utf-8")
    assert academus(["config", "docs", "--check", "--out", str(out)]) == 1
    assert f"run `{COMMAND}`" in capsys.readouterr().err
    assert academus(["config", "docs", "--out", str(out)]) == 0
    assert academus(["config", "docs", "--check", "--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == render()


def test_the_variables_outside_the_classes_are_read_through_config(monkeypatch, tmp_path):
    monkeypatch.delenv("ACADEMUS_TRACE_FILE", raising=False)
    assert config.trace_file(tmp_path / "t.jsonl") == str(tmp_path / "t.jsonl")
    monkeypatch.setenv("ACADEMUS_TRACE_FILE", "")
    assert config.trace_file(tmp_path / "t.jsonl") == ""   # set empty: no trace file, as before
    monkeypatch.setenv("ACADEMUS_TRACING", "off")
    monkeypatch.setenv("ACADEMUS_DATA_DIR", str(tmp_path))
    assert (config.tracing_enabled(), config.data_dir()) == (False, tmp_path)
    assert config.child_env({"ACADEMUS_PORT": "7"})["ACADEMUS_PORT"] == "7"


def environment_reads(path: Path) -> list[str]:
    """Each use of os.environ / os.getenv (or their names imported from os) in a file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    os_names = {"os"} | {a.asname for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
                         if a.name == "os" and a.asname}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ENV_NAMES and isinstance(node.value, ast.Name) \
                and node.value.id in os_names:
            found.append(f"{node.lineno}: os.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"{node.lineno}: from os import {a.name}" for a in node.names if a.name in ENV_NAMES]
    return found


def test_the_environment_is_read_in_config_only():
    reads = {str(p.relative_to(ROOT)): environment_reads(p)
             for folder in ("shared", "services") for p in sorted((ROOT / folder).rglob("*.py"))}
    assert reads[ENVIRONMENT_HOME], "the checker finds no read even in config.py"
    stray = [f"{path}:{hit}" for path, hits in reads.items() for hit in hits
             if path != ENVIRONMENT_HOME and path not in ALLOWED]
    assert not stray, "read the environment through a function of shared/runtime/config.py:\n" + "\n".join(stray)
    done = sorted(path for path in ALLOWED if not reads.get(path))
    assert not done, f"no longer read the environment, drop them from ALLOWED: {done}"
