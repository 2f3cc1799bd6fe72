"""CPU a call of TeacherTokenizer.encode on one text, the Python path against the tokenizers library, alternating,
and over every text of both tasks in one call.

    python tokenize_cpu.py [ROUNDS] [CALLS]"""

from __future__ import annotations

import json
import sys
import time

from academus.loadgen.overhead import text_of
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.training.data import load_task

TEXTS = {"stack_bench's text (16 tokens)": text_of(16),
         "a review sentence": "the movie was a delight from start to finish, funny and warm, though a little long",
         "words split into pieces": "Unbelievably overwrought melodramatics; thirty-seven minutes too long!!"}


def cpu_us(tokenizer: TeacherTokenizer, text: str, calls: int) -> float:
    for _ in range(200):
        tokenizer.encode([text])
    started = time.process_time()
    for _ in range(calls):
        tokenizer.encode([text])
    return (time.process_time() - started) / calls * 1e6


def main(rounds: int, calls: int) -> dict:
    arms = {"library": TeacherTokenizer(teacher_dir(), ascii_path=False), "python": TeacherTokenizer(teacher_dir())}
    out: dict = {name: {arm: [] for arm in arms} for name in TEXTS}
    for r in range(rounds):
        for arm in (list(arms) if r % 2 == 0 else list(reversed(arms))):
            for name, text in TEXTS.items():
                out[name][arm].append(round(cpu_us(arms[arm], text, calls), 1))
    texts = [e.text for task in ("sentiment", "spam") for split in load_task(task).splits().values() for e in split]
    whole = {}
    for arm, tokenizer in arms.items():
        started = time.process_time()
        tokenizer.encode(texts)
        whole[arm] = round(time.process_time() - started, 2)
    return {"us_a_call": out, f"all {len(texts)} task texts in one call, CPU s": whole}


if __name__ == "__main__":
    given = [int(a) for a in sys.argv[1:3]]
    print(json.dumps(main(*given), indent=1))
