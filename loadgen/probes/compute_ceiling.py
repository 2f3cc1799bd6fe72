"""The compute ceiling behind student_bench's capacity ratio (issue 4 (c)): samples/s of the teacher and of
a student group on one worker's device, in process, no serving, at each merge size.

    python -m academus.loadgen.probes.compute_ceiling [--task sentiment] [--students 1] [--merges 1,4,8,32]

Each point is the worker's start-up profile (`profile_model`, one instance, 32-token samples). The ratio
students/teacher at a merge size is the most any deployment can gain from compute alone on this device;
serving costs (gateway, scheduler, hops) only lower it. The last line printed is the JSON summary.
"""

from __future__ import annotations

import argparse
import json

import torch

from academus.services.worker.core import ModelRunner
from academus.services.worker.profiling import profile_model
from academus.shared.runtime.config import artifacts_dir


def ceiling(task: str, students: int, merges: list[int], threads: int) -> dict:
    torch.set_num_threads(threads)
    group = f"{task}-students"
    runner = ModelRunner(artifacts_dir(), [task, group])
    runner.models[group].default_students = runner.models[group].students(students)  # run at S = students
    rates = {model: {p.merge: round(p.throughput, 1) for p in profile_model(runner, model, (1,), merges)}
             for model in (task, group)}
    return {"threads": threads, "students": students, "samples_per_s": rates,
            "students_vs_teacher": {m: round(rates[group][m] / rates[task][m], 3) for m in merges}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.probes.compute_ceiling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=["sentiment", "spam"], default="sentiment")
    p.add_argument("--students", type=int, default=1, help="the group size S (1: the most groups a device holds)")
    p.add_argument("--merges", default="1,4,8,32", help="samples a batch (the teacher's padded batch reaches 32)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (student_bench's workers use 1)")
    args = p.parse_args(argv)
    print(json.dumps(ceiling(args.task, args.students, [int(m) for m in args.merges.split(",")], args.threads)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
