"""CPU a call of TeacherTokenizer.encode on texts of words the vocabulary does not hold, the Python path against the
tokenizers library (both search each such word piece by piece), cut at 256 tokens. Medians of 20 calls, ms.

    python hostile_words.py"""

from __future__ import annotations

import random
import string
import time

from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer

WORD = "".join(random.Random(0).choice(string.ascii_lowercase) for _ in range(100))
TEXTS = {"one word of 100 random letters": WORD, "20 such words": " ".join([WORD] * 20),
         "2,000 x's (one word past 100 characters)": "x" * 2000, "2,000 characters of common words":
         "the movie was fine " * 105}


def main() -> None:
    arms = {"python": TeacherTokenizer(teacher_dir()), "library": TeacherTokenizer(teacher_dir(), ascii_path=False)}
    for name, text in TEXTS.items():
        row = []
        for arm, tokenizer in arms.items():
            times = []
            for _ in range(20):
                started = time.process_time()
                tokenizer.encode([text])
                times.append((time.process_time() - started) * 1e3)
            row.append(f"{arm} {sorted(times)[10]:.3f}")
        print(f"{name}: " + ", ".join(row))


if __name__ == "__main__":
    main()
