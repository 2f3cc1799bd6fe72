"""docs/configuration.md, generated from the config classes: `academus config docs [--check]`, or
`python -m academus.shared.runtime.config_docs [--check]`.

Which services read a class comes from their code: every `load(<Class>)` call under services/<service>/."""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import MISSING, Field, fields
from pathlib import Path

from academus.shared.runtime import config

# services/ sits beside shared/ both in the checkout and installed (academus/services)
SERVICES = Path(config.__file__).resolve().parents[2] / "services"
DOC = Path(config.__file__).resolve().parents[2] / "docs" / "configuration.md"
COMMAND = "academus config docs"


def config_classes() -> list[type[config.CommonConfig]]:
    """CommonConfig and each service's config, in the order config.py defines them."""
    return [config.CommonConfig, *config.CommonConfig.__subclasses__()]


def loaded_classes(services: Path = SERVICES) -> dict[str, set[str]]:
    """Service folder name -> the config classes its code builds with `load(...)`."""
    found: dict[str, set[str]] = {}
    for path in sorted(services.glob("*/*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and _name(node.func) == "load" and node.args:
                cls = _name(node.args[0])
                if cls.endswith("Config"):
                    found.setdefault(path.parent.name, set()).add(cls)
    return found


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def readers(cls: type, loaded: dict[str, set[str]]) -> list[str]:
    """The services whose config is `cls` or extends it."""
    return sorted(s for s, names in loaded.items() if any(issubclass(getattr(config, n), cls) for n in names))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(f: Field) -> str:
    if f.metadata.get("shown"):
        return f.metadata["shown"]
    value = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    if isinstance(value, bool):
        return f"`{'true' if value else 'false'}`"
    for shift, unit in ((30, "GiB"), (20, "MiB")):
        if isinstance(value, int) and value >= 1 << shift and value % (1 << shift) == 0:
            return f"`{value}` ({value >> shift} {unit})"
    return f"`{value}`" if value != "" else "empty"


def _rows(own: list[Field]) -> list[str]:
    rows = ["| Variable | Type | Default | Valid | Description |", "|---|---|---|---|---|"]
    for f in own:
        rule = f.metadata.get("rule")
        rows.append(f"| `{config.env_name(f.name)}` | {f.type} | {_cell(_default(f))} | "
                    f"{_cell(rule.text) if rule else ''} | {_cell(f.metadata['doc'])} |")
    return rows


def _own_fields(cls: type) -> list[Field]:
    """The fields `cls` adds to CommonConfig's, or sets anew."""
    if cls is config.CommonConfig:
        return list(fields(cls))
    inherited = set(config.CommonConfig.__dataclass_fields__)
    return [f for f in fields(cls) if f.name not in inherited]


def _index(loaded: dict[str, set[str]]) -> list[str]:
    by_variable: dict[str, set[str]] = {}
    for cls in config_classes():
        for f in _own_fields(cls):
            by_variable.setdefault(config.env_name(f.name), set()).update(readers(cls, loaded))
    rows = ["| Variable | Read by |", "|---|---|"]
    rows += [f"| `{name}` | {', '.join(sorted(services))} |" for name, services in sorted(by_variable.items())]
    return rows


def render(services: Path = SERVICES) -> str:
    loaded = loaded_classes(services)
    lines = [
        "# Configuration reference",
        "",
        f"Generated from `shared/runtime/config.py` by `{COMMAND}`; do not edit it by hand (a unit test fails "
        "when it is stale).",
        "",
        "Every service reads its settings from `ACADEMUS_<SETTING>` environment variables once, at start; a value "
        "outside its range stops the service with an error naming the variable and the value. Booleans take "
        f"{'/'.join(config.TRUE)} or {'/'.join(config.FALSE)}.",
    ]
    for cls in config_classes():
        services = readers(cls, loaded)
        title = "Every service" if cls is config.CommonConfig else ", ".join(services)
        lines += ["", f"## {title} (`{cls.__name__}`)", "", f"Read by: {', '.join(services)}.", "",
                  *_rows(_own_fields(cls))]
    lines += ["", "## Which services read each setting", "", *_index(loaded)]
    lines += ["", "## Other environment variables", "",
              "Read outside the config classes, each by one function of `shared/runtime/config.py`: by the command "
              "line, training, tracing and the workers.", "",
              "| Variable | Unset | What it does |", "|---|---|---|"]
    lines += [f"| `{v.name}` | {_cell(v.unset)} | {_cell(v.doc)} |" for v in config.VARIABLES]
    return "\n".join(lines) + "\n"


def write_or_check(path: Path = DOC, check: bool = False) -> int:
    """Writes the reference, or with `check` only says whether `path` is current (exit status 1: stale)."""
    text = render()
    if check:
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            return 0
        print(f"{path} is stale: run `{COMMAND}`", file=sys.stderr)
        return 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description="write docs/configuration.md from the config classes")
    add_arguments(p)
    args = p.parse_args(argv)
    return write_or_check(args.out, args.check)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", action="store_true", help="only check that the file is current (exit 1: stale)")
    p.add_argument("--out", type=Path, default=DOC, help=f"default: {DOC}")


if __name__ == "__main__":
    sys.exit(main())
