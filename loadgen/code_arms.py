"""Arms that are versions of one file of the checkout: each arm's copy is put in place before its mesh starts (the
services import the checkout), and the checkout's own file is put back after, whatever happened. For comparing two
versions of a service's code on fresh meshes within one run, the order alternating between rounds."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
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


def alternating(rounds: int, arms: dict[str, Path], target: Path,
                one_arm: Callable[[str], dict[str, Any]]) -> list[dict[str, Any]]:
    """`rounds` rounds of `one_arm(name)` for every arm, with that arm's copy of `target` in place; the arms in
    their given order in even rounds, reversed in odd ones. Each round's row (its order, then each arm's figures)
    is printed as a JSON line as it ends."""
    rows = []
    with checkout_file(target) as use:
        for r in range(rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            row: dict[str, Any] = {"order": order}
            for name in order:
                use(arms[name])
                row[name] = one_arm(name)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows
