"""The resource manager's student groups for a model, as `groups:<model>` holds them in Redis:
`{"students": S, "groups": [[[worker_id, [student, ...]], ...], ...]}`. The resource manager writes them; each
scheduler dispatches to them; each worker holding students within a budget holds the ones placed on it."""

from __future__ import annotations

import json

Groups = list[list[tuple[str, list[int]]]]   # group -> its members (worker_id, student indices)


def groups_to_json(students: int, groups: Groups) -> str:
    return json.dumps({"students": students, "groups": groups})


def groups_from_json(raw: str) -> tuple[int, Groups]:
    """The student number and the groups."""
    data = json.loads(raw)
    return int(data["students"]), [[(worker, list(indices)) for worker, indices in members]
                                   for members in data["groups"]]


def placed_on(groups: Groups, worker_id: str) -> set[int]:
    """The student indices of every group placed on `worker_id`."""
    return {i for members in groups for worker, indices in members if worker == worker_id for i in indices}
