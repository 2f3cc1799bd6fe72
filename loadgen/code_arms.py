"""Arms that are versions of the checkout's code, for comparing them on fresh meshes within one run, the order
alternating between rounds: versions of one file (`alternating`: each arm's copy is put in place before its mesh
starts, and the checkout's own file is put back after, whatever happened), or whole trees (`trees_alternating`: each
arm a process with the tree on PYTHONPATH)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def checkout_file(target: Path) -> Iterator[Callable[[Path], None]]:
    """Yields `use(source)`, which copies `source` over `target`; `target`'s own bytes are back on exit."""
    own = target.read_bytes()
    try:
        yield lambda source: shutil.copyfile(source, target)
    finally:
        target.write_bytes(own)


def round_orders(rounds: int, arms: Sequence[str]) -> Iterator[list[str]]:
    """Each round's order of the arms: as given in even rounds, reversed in odd ones."""
    for r in range(rounds):
        yield list(arms) if r % 2 == 0 else list(reversed(arms))


def alternating(rounds: int, arms: dict[str, Path], target: Path,
                one_arm: Callable[[str], dict[str, Any]]) -> list[dict[str, Any]]:
    """`rounds` rounds of `one_arm(name)` for every arm, with that arm's copy of `target` in place; the arms in
    their given order in even rounds, reversed in odd ones. Each round's row (its order, then each arm's figures)
    is printed as a JSON line as it ends."""
    rows = []
    with checkout_file(target) as use:
        for order in round_orders(rounds, list(arms)):
            row: dict[str, Any] = {"order": order}
            for name in order:
                use(arms[name])
                row[name] = one_arm(name)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def trees_alternating(rounds: int, arms: dict[str, str], script: str, out: Path) -> list[dict[str, Any]]:
    """`rounds` rounds of `python script --one` for every arm, each a process of its own with PYTHONPATH the arm's
    (an earlier commit's tree laid out as the `academus` package; empty: the checkout), so that the mesh it starts
    (its launcher, and the services forked from it) runs that code. Each run's last stdout line is its JSON; the
    order alternates as `alternating`'s. Each round's row is printed as it ends; all of them, and the command, go to
    `out`."""
    rows = []
    for order in round_orders(rounds, list(arms)):
        row: dict[str, Any] = {"order": order}
        for name in order:
            done = subprocess.run([sys.executable, script, "--one"], env={**os.environ, "PYTHONPATH": arms[name]},
                                  capture_output=True, text=True, check=True)
            row[name] = json.loads(done.stdout.splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
    out.write_text(json.dumps({"command": sys.argv, "rounds": rows}, indent=1))
    return rows
