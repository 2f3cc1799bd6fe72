"""The Python path for ASCII texts (AsciiWordPiece) gives the tokenizers library's ids, on real and generated texts."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import (
    CHARS_A_TOKEN_CUT,
    Encoded,
    TeacherTokenizer,
    TextTooLong,
    Token,
    TooManyTokens,
)
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


def test_tokens_stop_once_the_texts_so_far_pass_the_limit() -> None:
    """Texts go to the library 65,536 characters at a time: the third is never tokenized."""
    tokenizer = TeacherTokenizer(teacher_dir())
    with pytest.raises(TooManyTokens, match="the first 2 texts hold 80004 tokens; an answer holds at most 50000"):
        tokenizer.tokens(["a " * 40_000, "b " * 40_000, "c " * 40_000], limit=50_000)


# -- a long text tokenized from its start -------------------------------------------------------------------------


@functools.cache
def trained(kind: str) -> str:
    """tokenizer.json of a byte-level BPE (RoBERTa's pipeline) or a Metaspace Unigram (SentencePiece's, as XLM-R's
    without its Precompiled normalizer), trained on the tasks' training texts: user models' other pipelines."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    texts = [e.text for task in ("sentiment", "spam") for e in load_task(task).train[:500]]
    if kind == "byte-level-bpe":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
    else:
        tokenizer = Tokenizer(models.Unigram())
        tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=2000, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                          unk_token="<unk>")
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
                                                             special_tokens=[("<s>", 0), ("</s>", 2)])
    return tokenizer.to_str()


def pipeline(kind: str) -> tuple[str, bool]:
    """(tokenizer.json, whether the teacher's Python path is on) for each pipeline a long text is cut in."""
    if kind.startswith("teacher"):
        return (teacher_dir() / "tokenizer.json").read_text(), kind == "teacher"
    return trained(kind), False


@functools.cache
def cut_and_whole(kind: str, limit: int) -> tuple[TeacherTokenizer, TeacherTokenizer]:
    raw, ascii_path = pipeline(kind)
    return (TeacherTokenizer.from_json(raw, limit, ascii_path),
            TeacherTokenizer.from_json(raw, limit, ascii_path, cut_long=False))


def each_refused(tokenizer: TeacherTokenizer, texts: list[str]) -> list[bool]:
    """Whether each text alone is refused untruncated."""
    refused = []
    for text in texts:
        try:
            tokenizer.encode([text], truncate=False)
            refused.append(False)
        except TextTooLong:
            refused.append(True)
    return refused


PIPELINES = ["teacher", "teacher-library", "byte-level-bpe", "metaspace-unigram"]
PAIRS = 128   # of the task texts past a pair test's cut, and of those under it
LONG_TEXTS = 1024   # of the tasks' texts past the cut, the first: every kind of text, in a test's time


@pytest.mark.parametrize("kind", PIPELINES)
@pytest.mark.parametrize("limit", [8, 64])
def test_a_long_texts_start_gives_the_whole_texts_first_tokens(task_texts: list[str], kind: str, limit: int) -> None:
    """Every task text past the cut: the same ids truncated, and refused untruncated exactly when the whole is."""
    cut, whole = cut_and_whole(kind, limit)
    assert cut.cut_chars == limit * CHARS_A_TOKEN_CUT and whole.cut_chars == 0
    long = [t for t in task_texts if len(t) > cut.cut_chars][:LONG_TEXTS]
    assert len(long) > 300   # the cut is really taken
    for start in range(0, len(long), 512):
        chunk = long[start:start + 512]
        assert cut.encode(chunk) == whole.encode(chunk)
    assert each_refused(cut, long[:200]) == each_refused(whole, long[:200])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.sampled_from([*AWKWARD, " ", "  ", " \t", "\n ", "\xa0", "\u3000", "'s", "é"]),
                          st.text(max_size=12)), min_size=1, max_size=80),
       st.sampled_from(PIPELINES[:3]), st.sampled_from([2, 3, 4]), st.booleans())
def test_generated_long_texts_get_the_whole_texts_ids(words: list[str], kind: str, limit: int, truncate: bool) -> None:
    """Texts of any characters and spaces, cut at 32-64 characters: the same ids, or the same text refused."""
    cut, whole = cut_and_whole(kind, limit)
    texts = [" ".join(words), "".join(words), "  ".join(words)]
    assert outcome(cut, texts, truncate) == outcome(whole, texts, truncate) or (
        not truncate and outcome(cut, texts, truncate)[0] == outcome(whole, texts, truncate)[0])


def test_a_refusal_counts_a_long_texts_start_and_says_so() -> None:
    """Refused untruncated: "at least" the tokens its start holds. A start of few tokens (words past 100 characters
    are one [UNK] each) is no evidence: the whole text is counted."""
    tokenizer = TeacherTokenizer(teacher_dir(), max_tokens=32)
    with pytest.raises(TextTooLong, match=r"texts\[1\] has at least \d+ tokens; the limit is 32") as refused:
        tokenizer.encode(["fine", "word " * 2000], truncate=False)
    assert not refused.value.counted and 32 < refused.value.num_tokens < 2002
    unknown = ("x" * 101 + " ") * 40   # 4,080 characters, 40 tokens; its first 512 hold 5
    with pytest.raises(TextTooLong, match=r"texts\[0\] has 42 tokens; the limit is 32"):
        tokenizer.encode([unknown], truncate=False)
    assert tokenizer.encode([unknown])[0] == Encoded([101] + [100] * 30 + [102], [0] * 32, True)


@pytest.mark.parametrize("kind", PIPELINES)
def test_a_word_across_the_cut_is_tokenized_whole(kind: str) -> None:
    """The cut falls before a space, never inside a word: at a limit of 8, five words and a word of 120 letters
    that crosses the 128th character. Its start alone would be letters; whole, it is one [UNK] past 100 letters."""
    cut, whole = cut_and_whole(kind, 8)
    texts = ["because " * 5 + "y" * 120 + " b" * 50, "because " * 4 + "ab" * 60 + " b" * 50]
    assert cut.encode(texts) == whole.encode(texts)
    if kind.startswith("teacher"):
        assert cut.encode(texts[:1])[0].input_ids == [101] + [2138] * 5 + [100, 102]


@pytest.mark.parametrize("change", [
    lambda raw: raw.update(normalizer={"type": "Replace", "pattern": {"String": "a b"}, "content": "ab"}),
    lambda raw: raw.update(pre_tokenizer=None),
    lambda raw: raw.update(pre_tokenizer={"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always",
                                          "split": False}),
    lambda raw: raw.update(pre_tokenizer={"type": "Split", "pattern": {"String": "x"}, "behavior": "Removed",
                                          "invert": False}),
    lambda raw: raw["added_tokens"].append({**raw["added_tokens"][0], "id": 30522, "content": "new york"}),
])
def test_a_pipeline_that_may_join_across_a_space_tokenizes_long_texts_whole(change) -> None:
    raw = json.loads((teacher_dir() / "tokenizer.json").read_text())
    assert TeacherTokenizer.from_json(json.dumps(raw), 256).cut_chars == 256 * CHARS_A_TOKEN_CUT
    change(raw)
    assert TeacherTokenizer.from_json(json.dumps(raw), 256, ascii_path=False).cut_chars == 0


def pair_outcome(tokenizer: TeacherTokenizer, texts: list[str], pairs: list[str], truncate: bool
                 ) -> list[Encoded] | int:
    """The pairs' encodings, or the index of the pair refused untruncated."""
    try:
        return tokenizer.encode(texts, pairs, truncate=truncate)
    except TextTooLong as e:
        return e.index


@pytest.mark.parametrize("kind", PIPELINES)
@pytest.mark.parametrize("limit", [8, 9])   # a pair's budget of either parity, whatever the frame
def test_a_pairs_long_texts_start_gives_the_whole_pairs_tokens(task_texts: list[str], kind: str, limit: int) -> None:
    """Task texts past the cut paired with short and with long ones, each way round: the same ids and type ids,
    truncated, and refused untruncated exactly when whole; the cut is taken where it is exact."""
    cut, whole = cut_and_whole(kind, limit)
    long = [t for t in task_texts if len(t) > cut.cut_chars][:PAIRS]
    short = [t for t in task_texts if len(t) <= cut.cut_chars][:PAIRS]
    half = PAIRS // 2
    firsts, seconds = long[:half] + short[:half] + long[half:], short[half:] + long[:half] + long[::-1][:half]
    assert cut.encode(firsts, seconds) == whole.encode(firsts, seconds)
    for i in range(0, 40, 8):   # refused untruncated alike, pair by pair
        for first, second in ((firsts[i], seconds[i]), (seconds[i], firsts[i])):
            assert pair_outcome(cut, [first], [second], False) == pair_outcome(whole, [first], [second], False)
    taken = cut._encode_pairs(firsts, seconds, True)[1]
    assert len(taken & set(range(PAIRS))) > PAIRS // 2   # one long text a pair: cut
    both = len(taken & set(range(PAIRS, PAIRS + half)))
    assert (both > half // 2) == (cut.pair_budget % 2 == 0) and (both == 0 or cut.pair_budget % 2 == 0), both


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.sampled_from([*AWKWARD, " ", "  ", " \t", "\n ", "\xa0", "'s", "é"]),
                          st.text(max_size=12)), min_size=1, max_size=80),
       st.lists(st.sampled_from(["word", "x" * 101, "a b c", " ", "é", "[SEP]"]), max_size=60),
       st.sampled_from(PIPELINES[:3]), st.sampled_from([2, 3, 4, 5]), st.booleans())
def test_generated_pairs_get_the_whole_pairs_ids(words: list[str], other: list[str], kind: str, limit: int,
                                                 truncate: bool) -> None:
    """Pairs of generated texts, short and long, either way round, cut at 32-80 characters: the same ids, or the
    same pair refused."""
    cut, whole = cut_and_whole(kind, limit)
    texts, partner = [" ".join(words), "".join(words), "  ".join(words)], " ".join(other)
    for firsts, seconds in ((texts, [partner] * 3), ([partner] * 3, texts), (texts, texts[::-1])):
        assert pair_outcome(cut, firsts, seconds, truncate) == pair_outcome(whole, firsts, seconds, truncate)


def test_a_pair_is_cut_only_where_the_budgets_share_is_known() -> None:
    """BERT's pair frame takes 3 tokens: at a limit of 32 the budget is 29, odd, so two long texts are tokenized
    whole (the longer one keeps the odd token); at 33 both are cut. A short text holding more tokens than the long
    text's start keeps the pair whole."""
    odd, even = (TeacherTokenizer(teacher_dir(), max_tokens=limit) for limit in (32, 33))
    long_a, long_b, query = "word " * 2000, "other " * 3000, "is it?"
    assert odd.pair_budget == 29 and even.pair_budget == 30
    assert odd._encode_pairs([long_a, query], [long_b, long_a], True)[1] == {1}
    assert even._encode_pairs([long_a, query], [long_b, long_a], True)[1] == {0, 1}
    dense = "a" * 500 + "?" * 10   # 511 characters, 11 tokens; a long text's first 512 characters hold 102
    assert odd._encode_pairs(["ab " * 1000, "ab " * 1000], [dense, "?" * 500], True)[1] == {0}
    for tokenizer in (odd, even):
        whole = TeacherTokenizer(teacher_dir(), max_tokens=tokenizer.max_tokens, cut_long=False)
        pairs = ([long_a, query, long_b], [long_b, long_a, "?" * 500])
        assert tokenizer.encode(*pairs) == whole.encode(*pairs)
        with pytest.raises(TextTooLong, match=r"texts\[0\] has at least \d+ tokens") as refused:
            tokenizer.encode([query], [long_a], truncate=False)
        assert not refused.value.counted


def library_pairs(kind: str, limit: int, firsts: list[str], seconds: list[str]) -> list[Encoded]:
    """The library's own longest-first truncation of each pair (its windows kept: short pairs only)."""
    from tokenizers import Tokenizer

    library = Tokenizer.from_str(pipeline(kind)[0])
    library.no_padding()
    library.enable_truncation(max_length=limit)
    return [Encoded(list(e.ids), list(e.type_ids), bool(e.overflowing))
            for e in library.encode_batch(list(zip(firsts, seconds, strict=True)))]


@pytest.mark.parametrize("kind", ["teacher", "byte-level-bpe"])   # frames of 3 and 4 special tokens
def test_a_pairs_lengths_are_the_librarys_longest_first_ones(kind: str) -> None:
    """Texts of 0-12 tokens each, at limits 2-14 (budgets of either parity, none at all, ties, empty texts): the
    same ids, type ids and truncation as the library's."""
    words = [" ".join(["house"] * n) for n in range(13)]
    others = [" ".join(["tree"] * n) for n in range(13)]
    firsts, seconds = zip(*[(a, b) for a in words for b in others], strict=True)
    for limit in range(2, 15):
        tokenizer = TeacherTokenizer.from_json(pipeline(kind)[0], limit, ascii_path=False)
        assert tokenizer.encode(firsts, seconds) == library_pairs(kind, limit, firsts, seconds), limit


@pytest.mark.parametrize("kind", PIPELINES)
@pytest.mark.parametrize("limit", [64, 65])
def test_task_pairs_are_truncated_as_the_library_truncates_them(task_texts: list[str], kind: str, limit: int) -> None:
    """Task texts of up to 600 characters paired every way: the library's answer, windows and all, in its frame."""
    texts = [t[:600] for t in task_texts[:400]]
    firsts, seconds = texts[:200], texts[200:]
    tokenizer = TeacherTokenizer.from_json(pipeline(kind)[0], limit, ascii_path=False)
    expected = library_pairs(kind, limit, firsts, seconds)
    assert sum(e.truncated for e in expected) > 20
    assert tokenizer.encode(firsts, seconds) == expected


def test_two_long_texts_of_a_pair_never_reach_the_librarys_truncation() -> None:
    """The library's truncation of a pair keeps every combination of its texts' windows: two texts of 20,000 tokens
    would be 25,000 windows and gigabytes. Pairs are tokenized untruncated and cut here: 126 tokens of the first (a
    tie gives the second the odd one) and 127 of the second."""
    tokenizer = TeacherTokenizer(teacher_dir(), max_tokens=256)
    truncating = tokenizer._cut
    asked: list = []

    class Spy:
        def encode_batch(self, inputs, *args, **kwargs):
            asked.extend(inputs)
            return truncating.encode_batch(inputs, *args, **kwargs)

    tokenizer._cut = Spy()
    (encoded,) = tokenizer.encode(["word " * 20_000], ["other " * 20_000])
    assert encoded.input_ids == [101] + [2773] * 126 + [102] + [2060] * 127 + [102] and encoded.truncated
    assert encoded.token_type_ids == [0] * 128 + [1] * 128
    tokenizer.encode(["a question"], ["its answer " * 3_000])
    tokenizer.encode(["un café"] * 2)   # accented: past the ASCII path, to the library
    assert asked == ["un café"] * 2   # single texts only


def test_a_frame_that_interleaves_its_texts_keeps_each_texts_first_tokens() -> None:
    """`_pair_kept`, for a frame whose texts would not lie each in one run, keeps what the runs' cut keeps."""
    tokenizer = TeacherTokenizer(teacher_dir(), max_tokens=16)
    (encoding,) = tokenizer._full.encode_batch([("a b c d e f g h i j", "k l m n o p q r s t u v")])
    kept = TeacherTokenizer._pair_kept(encoding, (6, 7))
    assert kept == tokenizer._pair_truncated(encoding, encoding.sequence_ids) == tokenizer.encode(
        ["a b c d e f g h i j"], ["k l m n o p q r s t u v"])[0]
    assert kept.input_ids[1:7] == encoding.ids[1:7] and len(kept.input_ids) == 16
