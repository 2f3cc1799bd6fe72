"""The Python path for ASCII texts (AsciiWordPiece) gives the tokenizers library's ids, on real and generated texts."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import Encoded, TeacherTokenizer, TextTooLong, Token, TooManyTokens
from academus.shared.training.data import load_task
from tests.models import permute_vocabulary, roberta_specials

# Words that reach each branch: known whole, split into pieces, unknown pieces, over 100 characters, added
# tokens in both cases, control characters the normalizer drops, whitespace it keeps, punctuation alone, and a word of
# 100 letters that falls into single-letter pieces (the longest pieces the vocabulary holds bound the search).
AWKWARD = ["[CLS]", "[mask]", "[MASK]", "unbelievably", "x" * 101, "a" * 100, "##ing", "Hello", "WORLD", "\t", "\n",
           "\x0b", "\x1f", "\x7f", "\x00", "don't", "3.14", "e-mail", "[", "]", "~", "", "qzxjv", "naïve", "日本",
           "qzxjvwkpfb" * 10]


@functools.cache
def teachers(limit: int) -> tuple[TeacherTokenizer, TeacherTokenizer]:
    """The teacher's tokenizer at `limit`, with and without the Python path, made once a limit."""
    return both(teacher_dir(), limit)


def both(directory: Path, limit: int) -> tuple[TeacherTokenizer, TeacherTokenizer]:
    raw = (directory / "tokenizer.json").read_text()
    return TeacherTokenizer.from_json(raw, limit), TeacherTokenizer.from_json(raw, limit, ascii_path=False)


def outcome(tokenizer: TeacherTokenizer, texts: list[str], truncate: bool) -> list[Encoded] | tuple[int, int]:
    try:
        return tokenizer.encode(texts, truncate=truncate)
    except TextTooLong as e:
        return e.index, e.num_tokens


@pytest.fixture(scope="module")
def task_texts() -> list[str]:
    texts = []
    for task in ("sentiment", "spam"):
        data = load_task(task)
        texts += [e.text for split in (data.train, data.validation, data.test) for e in split]
    return texts


def test_the_teachers_tokenizer_takes_the_ascii_path() -> None:
    fast, library = both(teacher_dir(), 256)
    assert fast.ascii is not None and library.ascii is None
    assert fast.encode(["a fine film"])[0].input_ids == [101, 1037, 2986, 2143, 102]


@pytest.mark.parametrize("limit", [16, 256, 100_000])
def test_every_text_of_both_tasks_gets_the_librarys_ids(task_texts: list[str], limit: int) -> None:
    """Cut at 16 tokens and at the serving limit; whole, untruncated, where no text reaches the limit."""
    fast, library = both(teacher_dir(), limit)
    assert sum(t.isascii() for t in task_texts) > 0.9 * len(task_texts)   # the path is really taken
    for start in range(0, len(task_texts), 512):
        chunk = task_texts[start:start + 512]
        assert fast.encode(chunk, truncate=limit < 100_000) == library.encode(chunk, truncate=limit < 100_000)


@settings(max_examples=600, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(AWKWARD), st.text(st.characters(max_codepoint=127), max_size=30)),
                max_size=40),
       st.sampled_from([2, 3, 8, 256]), st.booleans())
def test_generated_texts_get_the_librarys_ids(words: list[str], limit: int, truncate: bool) -> None:
    fast, library = teachers(limit)
    texts = [" ".join(words), "".join(words)]
    assert outcome(fast, texts, truncate) == outcome(library, texts, truncate)


def test_added_tokens_and_other_characters_go_to_the_library() -> None:
    fast, _ = both(teacher_dir(), 256)
    assert fast.ascii.encode("a [MASK] here", 256) is None
    assert fast.ascii.encode("naïve", 256) is None
    texts = ["a [MASK] here", "naïve", "plain"]
    assert [e.input_ids for e in fast.encode(texts)] == [[101, 1037, 103, 2182, 102], [101, 15743, 102],
                                                         [101, 5810, 102]]


@pytest.mark.parametrize("renumber", [permute_vocabulary, roberta_specials])
def test_a_users_bert_tokenizer_keeps_its_own_ids(tmp_path: Path, renumber, task_texts: list[str]) -> None:
    (tmp_path / "tokenizer.json").write_text((teacher_dir() / "tokenizer.json").read_text())
    renumber(tmp_path)
    fast, library = both(tmp_path, 64)
    assert fast.ascii is not None
    chunk = task_texts[:300] + AWKWARD
    assert fast.encode(chunk) == library.encode(chunk)


@pytest.mark.parametrize("change", [
    lambda raw: raw.update(normalizer={"type": "Lowercase"}),
    lambda raw: raw.update(pre_tokenizer={"type": "Whitespace"}),
    lambda raw: raw.update(model={"type": "WordLevel", "vocab": raw["model"]["vocab"], "unk_token": "[UNK]"}),
    lambda raw: raw.update(post_processor={"type": "RobertaProcessing", "sep": ["[SEP]", 102], "cls": ["[CLS]", 101]}),
    lambda raw: raw["post_processor"]["single"].pop(),
])
def test_another_pipeline_stays_with_the_library(change) -> None:
    raw = json.loads((teacher_dir() / "tokenizer.json").read_text())
    change(raw)
    assert TeacherTokenizer.from_json(json.dumps(raw), 256).ascii is None


def test_an_added_token_the_normalizer_sees_is_found_in_any_case() -> None:
    """An added token marked `normalized` is matched on the lowercased text: "[mAsK]" is it, and goes to the library."""
    raw = json.loads((teacher_dir() / "tokenizer.json").read_text())
    for token in raw["added_tokens"]:
        token["normalized"] = token["content"] == "[MASK]"
    fast = TeacherTokenizer.from_json(json.dumps(raw), 64)
    library = TeacherTokenizer.from_json(json.dumps(raw), 64, ascii_path=False)
    texts = ["a [mAsK] here", "a [MASK] here", "a [mask] here", "a [CLS] here", "a [cls] here", "plain words"]
    assert fast.ascii is not None and fast.ascii.encode("a [mAsK] here", 64) is None
    assert fast.encode(texts) == library.encode(texts)


def test_tokens_give_each_tokens_text_and_offsets_and_decode_gives_the_text_back() -> None:
    tokenizer = TeacherTokenizer(teacher_dir(), max_tokens=8)
    text = "Héllo, worlds tokenizing!"
    tokens = tokenizer.tokens([text, "a " * 20])
    assert [t.id for t in tokens[0]] == tokenizer.encode([text], truncate=False)[0].input_ids
    assert (tokens[0][0], tokens[0][-1]) == (Token(101, "[CLS]", True, None, None),
                                             Token(102, "[SEP]", True, None, None))
    assert [(t.text, t.start, t.stop) for t in tokens[0][1:4]] == [("Héllo", 0, 5), (",", 5, 6), ("worlds", 7, 13)]
    assert len(tokens[1]) == 22   # untruncated: past max_tokens
    assert [t.text for t in tokenizer.tokens(["Hi there"], add_special_tokens=False)[0]] == ["Hi", "there"]
    assert tokenizer.decode([[t.id for t in tokens[0]]]) == ["hello, worlds tokenizing!"]
    assert tokenizer.decode([[101, 7632, 102]], skip_special_tokens=False) == ["[CLS] hi [SEP]"]
    with pytest.raises(TooManyTokens, match="the texts hold 25 tokens; an answer holds at most 23"):
        tokenizer.tokens(["a " * 20, "b"], limit=23)   # 22 and 3
