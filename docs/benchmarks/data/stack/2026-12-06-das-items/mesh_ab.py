"""The scheduler's code against an older copy, on fresh meshes serving `null`: closed loops deep enough to fill its
queue, the order alternating (depth_ab.py's mesh and figures, with several files swapped at once).

    python mesh_ab.py ROUNDS CALLERS OUT.json REFERENCE_DIR

REFERENCE_DIR holds older copies of files of services/scheduler/ (each *.py in it, by name); the arm `reference`
puts them in place before its mesh starts, the arm `new` runs the checkout's own. The checkout's files are put
back at the end.
"""

from __future__ import annotations

import json
import shutil
import sys
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "2026-12-05-depth-tally"))
from depth_ab import CHECKOUT, one_mesh

from academus.loadgen.code_arms import checkout_file


def main() -> None:
    rounds, callers, out, reference = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    targets = [CHECKOUT / "services/scheduler" / path.name for path in sorted(reference.glob("*.py"))]
    own = {t: t.read_bytes() for t in targets}
    rows = []
    with ExitStack() as stack:
        for t in targets:
            stack.enter_context(checkout_file(t))
        for r in range(rounds):
            order = ["reference", "new"] if r % 2 == 0 else ["new", "reference"]
            row: dict = {"order": order}
            for name in order:
                for t in targets:
                    if name == "reference":
                        shutil.copyfile(reference / t.name, t)
                    else:
                        t.write_bytes(own[t])
                row[name] = one_mesh(callers)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "files": [t.name for t in targets], "callers": callers,
                               "rounds": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
