"""same_decisions.py with DEADLINE_ORDER_AFTER set: 1 reads every deadline-aware set off the decision's order, a
large value sorts every one on its own; prints how many rows read the order.

    python same_decisions_at.py AFTER REFERENCE.py SEEDS CASES
"""

import runpy
import sys
from pathlib import Path

from academus.services.scheduler import das

SAME_DECISIONS = Path(__file__).parent.parent / "2026-12-05-das-once" / "same_decisions.py"


def main() -> None:
    das.DEADLINE_ORDER_AFTER = int(sys.argv[1])
    read_off = [0]
    of = das._DeadlineOrder.of

    def counted(self, ranked, p, end, least):
        read_off[0] += end - p >= das.DEADLINE_ORDER_AFTER
        return of(self, ranked, p, end, least)

    das._DeadlineOrder.of = counted
    sys.argv = [str(SAME_DECISIONS), *sys.argv[2:]]
    try:
        runpy.run_path(str(SAME_DECISIONS), run_name="__main__")
    finally:
        print("rows that read the decision's order:", read_off[0])


if __name__ == "__main__":
    main()
