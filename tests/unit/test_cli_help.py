"""`academus --help` names every action of the commands it hands to their own parsers (distill, plot, shard):
the top-level line is what a user reads first, and those parsers change apart from it."""

from __future__ import annotations

import argparse

import pytest

from academus.shared.cli.main import parser


def subcommands(p: argparse.ArgumentParser) -> set[str]:
    """The names a parser's sub-parsers or its positional `action` take."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
        if action.dest == "action" and action.choices:
            return set(action.choices)
    raise AssertionError(f"{p.prog} takes no subcommand")


def top_level_help(command: str) -> str:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return next(c.help for c in sub._choices_actions if c.dest == command)


@pytest.mark.parametrize(("command", "module", "own"), [
    ("distill", "academus.shared.training.distill_cli", set()),
    ("plot", "academus.shared.training.plot_build", set()),
    ("shard", "academus.shared.training.shard_plans", {"budget"}),   # `budget` is parsed by the CLI itself
])
def test_the_top_level_help_names_every_action(command: str, module: str, own: set[str]) -> None:
    import importlib

    actions = subcommands(importlib.import_module(module)._parser()) | own
    named = {word.strip("()") for word in top_level_help(command).replace(",", " ").split()}
    assert actions <= named, f"`academus --help` omits {sorted(actions - named)} of `{command}`"
