"""Fast tokenization of the teacher's vocabulary, with the serving limits applied."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Encoding, Tokenizer


class TextTooLong(ValueError):
    """A text exceeds the token limit and the caller turned truncation off. `counted`: whether `num_tokens` is the
    whole text's count; a long text's count stops at its first characters (TeacherTokenizer.cut_chars), already past
    the limit."""

    def __init__(self, index: int, num_tokens: int, limit: int, counted: bool = True) -> None:
        self.index, self.num_tokens, self.limit, self.counted = index, num_tokens, limit, counted
        super().__init__(f"texts[{index}] has {self.count} tokens; the limit is {limit} (truncation is off)")

    @property
    def count(self) -> str:
        return str(self.num_tokens) if self.counted else f"at least {self.num_tokens}"


class TooManyTokens(ValueError):
    """Texts whose tokens, in all, are more than one answer may hold: counted over the first `texts` of them."""

    def __init__(self, total: int, limit: int, texts: int, of: int) -> None:
        held = "the texts hold" if texts == of else f"the first {texts} texts hold"
        super().__init__(f"{held} {total} tokens; an answer holds at most {limit}")
        self.total, self.limit = total, limit


@dataclass(frozen=True)
class Token:
    """One token of a text as its tokenizer cut it: the id, the text it covers, and its character offsets in the
    text (None for a special token the template added, whose text is the token's own)."""

    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


@dataclass(frozen=True)
class Encoded:
    """Token ids of one text (or text pair), [CLS] ... [SEP] framed, unpadded."""

    input_ids: list[int]
    token_type_ids: list[int]
    truncated: bool = False   # tokens were cut at the limit (a text exactly at it is whole)


# A text longer than this many characters a token is tokenized from its start, cut before a space (`_before_space`):
# English takes 4-5 characters a token, so its first max_tokens tokens lie well inside, and the rest would cost the
# gateway its tokenizing for nothing (a 100,000-character text: 58 ms, against 2 ms for its first 4,096 characters).
CHARS_A_TOKEN_CUT = 16
# TEI's /tokenize answers untruncated: texts go to the library this many characters at a time, so a request past the
# answer's limit stops being tokenized soon after it passes it.
TOKENS_CHUNK_CHARS = 1 << 16
# Pipelines that tokenize the text before a space alike whatever follows it (each step acts on a character, or on
# the words a space ends). Others (Replace, Precompiled, a Metaspace that does not split) are tokenized whole.
_LOCAL_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "StripAccents", "Strip", "Prepend"}
_SPLITTING_PRE_TOKENIZERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit", "Punctuation", "Digits",
                             "ByteLevel", "Metaspace"}

# BERT's pre-tokenizer on ASCII: runs of letters and digits, and each punctuation mark alone (whitespace splits).
_ASCII_WORDS = re.compile(r"[A-Za-z0-9]+|[!-/:-@\[-`{-~]")
# BertNormalizer's clean_text drops control characters; tab, newline and return count as whitespace.
_ASCII_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


class AsciiWordPiece:
    """A BERT tokenizer's ids for one ASCII text, computed in Python: BertNormalizer (clean_text, lowercase),
    BertPreTokenizer, greedy WordPiece and the [CLS] A [SEP] template, exactly as the tokenizers library gives
    them. A call on a 14-word text takes the library about 28 us of CPU and this path about 5.4: the library
    builds every token's string, offsets and masks, and its normalizer tracks each character's alignment. The gateway
    tokenizes every request's texts, and the library was the largest part of its CPU at capacity
    (docs/benchmarks/stack.md). Other characters, and the added tokens' text ([MASK]), go to the library."""

    def __init__(self, vocab: dict[str, int], unk: int, first: int, last: int, prefix: str, max_word_chars: int,
                 lowercase: bool, added: Sequence[str], normalized: Sequence[str] = ()) -> None:
        """`added`: the added tokens' text, found in the raw text; `normalized`: those found in the normalized
        text (their text normalized too)."""
        self.vocab, self.unk, self.first, self.last = vocab, unk, first, last
        self.prefix, self.max_word_chars, self.lowercase = prefix, max_word_chars, lowercase
        self.added, self.normalized = tuple(added), tuple(normalized)
        # no piece is longer than the vocabulary's longest entry: longer candidates need no lookup
        self.longest = max(len(t[len(prefix):] if t.startswith(prefix) else t) for t in vocab)

    @classmethod
    def of(cls, spec: dict[str, Any]) -> AsciiWordPiece | None:
        """From tokenizer.json's content; None unless its pipeline is BERT's, the one this class reproduces."""
        normalizer, model = spec.get("normalizer") or {}, spec.get("model") or {}
        if (normalizer.get("type") != "BertNormalizer" or not normalizer.get("clean_text")
                or (spec.get("pre_tokenizer") or {}).get("type") != "BertPreTokenizer"
                or model.get("type") != "WordPiece" or model.get("unk_token") not in model.get("vocab", {})):
            return None
        frame = _single_frame(spec.get("post_processor") or {})
        if frame is None:
            return None
        vocab, lowercase = model["vocab"], bool(normalizer.get("lowercase", True))
        tokens = spec.get("added_tokens", [])
        normalized = [t["content"].lower() if lowercase else t["content"] for t in tokens if t.get("normalized")]
        return cls(vocab, vocab[model["unk_token"]], *frame, model.get("continuing_subword_prefix", "##"),
                   int(model.get("max_input_chars_per_word", 100)), lowercase,
                   [t["content"] for t in tokens if not t.get("normalized")], normalized)

    def encode(self, text: str, limit: int | None) -> tuple[list[int], bool] | None:
        """(ids, truncated) with at most `limit` ids (None: all of them); None for a text the library must take."""
        if not text.isascii() or any(a in text for a in self.added):
            return None
        if not text.isprintable():
            text = _ASCII_CONTROL.sub("", text)
        if self.lowercase:
            text = text.lower()
        if any(a in text for a in self.normalized):
            return None
        ids, get = [self.first], self.vocab.get
        room = limit - 1 if limit is not None else float("inf")
        for word in _ASCII_WORDS.findall(text):
            found = get(word)
            if found is None:
                self._pieces(word, ids)
            else:
                ids.append(found)
            if len(ids) > room:   # cut: the words after it need not be looked up
                break
        truncated = len(ids) > room
        if truncated:
            del ids[int(room):]
        ids.append(self.last)
        return ids, truncated

    def _pieces(self, word: str, ids: list[int]) -> None:
        """WordPiece: the longest known prefix, then the longest known continuation, and so on; a word with an
        unknown remainder, or longer than max_word_chars, is one [UNK]."""
        if len(word) > self.max_word_chars:
            ids.append(self.unk)
            return
        pieces, start = [], 0
        while start < len(word):
            for end in range(min(len(word), start + self.longest), start, -1):
                found = self.vocab.get(word[start:end] if start == 0 else self.prefix + word[start:end])
                if found is not None:
                    pieces.append(found)
                    start = end
                    break
            else:
                ids.append(self.unk)
                return
        ids.extend(pieces)


def _single_frame(processor: dict[str, Any]) -> tuple[int, int] | None:
    """The ids a single text is framed with ([CLS], [SEP]) by BERT's post-processor; None for another frame."""
    if processor.get("type") == "BertProcessing":
        return processor["cls"][1], processor["sep"][1]
    if processor.get("type") != "TemplateProcessing":
        return None
    single = processor.get("single", [])
    shape = [next(iter(piece)) for piece in single]
    if shape != ["SpecialToken", "Sequence", "SpecialToken"] or single[1]["Sequence"]["id"] != "A":
        return None
    specials = processor.get("special_tokens", {})
    framed = [specials.get(single[k]["SpecialToken"]["id"], {}).get("ids", []) for k in (0, 2)]
    if any(len(ids) != 1 for ids in framed) or any(single[k]["SpecialToken"].get("type_id", 0) for k in (0, 2)):
        return None
    return framed[0][0], framed[1][0]


def _splits_at_spaces(spec: dict[str, Any]) -> bool:
    """Whether tokenizer.json's pipeline gives a text's tokens before a space whatever follows it: then a long text's
    first tokens are those of its start, cut before a space."""
    def steps(part: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
        return [] if part is None else part.get(key, []) if part.get("type") == "Sequence" else [part]

    normalizers = steps(spec.get("normalizer"), "normalizers")
    pre_tokenizers = steps(spec.get("pre_tokenizer"), "pretokenizers")
    model = spec.get("model") or {}
    return (bool(pre_tokenizers) and all(n.get("type") in _LOCAL_NORMALIZERS for n in normalizers)
            and all(p.get("type") in _SPLITTING_PRE_TOKENIZERS for p in pre_tokenizers)
            and all(p.get("use_regex", True) for p in pre_tokenizers if p.get("type") == "ByteLevel")
            and all(p.get("split") is True for p in pre_tokenizers if p.get("type") == "Metaspace")
            and not model.get("dropout")
            and not any(" " in t.get("content", " ") for t in spec.get("added_tokens", [])))


def _before_space(text: str, chars: int) -> str:
    """`text` up to the run of spaces that starts at or before `chars`, or all of it when it is no longer or has no
    space there. The start of the run, so that the last word is whole and no whitespace token ends the start."""
    if len(text) <= chars:
        return text
    at = text.rfind(" ", 0, chars + 1)
    while at > 0 and text[at - 1] == " ":
        at -= 1
    return text[:at] if at > 0 else text


class TeacherTokenizer:
    """The model's own fast tokenizer; the file's fixed padding is switched off (workers pad). A single ASCII
    text of a BERT tokenizer takes the Python path (`AsciiWordPiece`, the same ids) unless `ascii_path` is off."""

    def __init__(self, model_dir: Path | None, max_tokens: int = 256, raw: str = "", ascii_path: bool = True,
                 cut_long: bool = True) -> None:
        """`cut_long`: a text past `cut_chars` characters is tokenized from its start (see `encode`)."""
        self.max_tokens, self.ascii_path = max_tokens, ascii_path
        raw = raw or (Path(model_dir) / "tokenizer.json").read_text()
        spec = json.loads(raw)
        self.cut_chars = max_tokens * CHARS_A_TOKEN_CUT if cut_long and _splits_at_spaces(spec) else 0
        self._full = Tokenizer.from_str(raw)
        self._full.no_padding()
        self._full.no_truncation()
        self._cut = Tokenizer.from_str(raw)
        self._cut.no_padding()
        self._cut.enable_truncation(max_length=max_tokens)
        # a pair's tokens past its frame, shared longest first (the library's truncation)
        self.pair_budget = max_tokens - self._cut.num_special_tokens_to_add(True)
        # the frame needs two places: below that the library decides
        self.ascii = AsciiWordPiece.of(spec) if ascii_path and max_tokens >= 2 else None

    @classmethod
    def from_json(cls, raw: str, max_tokens: int, ascii_path: bool = True, cut_long: bool = True) -> TeacherTokenizer:
        """From tokenizer.json's text (a user's model's, as the gateway reads it from Redis)."""
        return cls(None, max_tokens, raw, ascii_path, cut_long)

    def encode(
        self, texts: Sequence[str], pairs: Sequence[str] | None = None, truncate: bool = True
    ) -> list[Encoded]:
        """Encodes texts (or text pairs); raises TextTooLong when truncation is off. A single text past `cut_chars`
        is tokenized from its start, cut before a space: its tokens there are the whole text's first ones, so when
        they pass the limit they are the answer (truncated), or the refusal (not). Else the whole text is
        tokenized. A pair's long text is cut where that gives the same tokens (`_encode_pairs`)."""
        if pairs:
            return self._refused_past_limit(*self._encode_pairs(texts, pairs, truncate), truncate)
        long = [] if not self.cut_chars else [i for i, t in enumerate(texts) if len(t) > self.cut_chars]
        starts = list(texts) if long else texts
        for i in long:
            starts[i] = _before_space(texts[i], self.cut_chars)
        cut = [i for i in long if starts[i] is not texts[i]]   # tokenized from their start
        out = self._encode(starts, truncate)
        # a start that holds fewer tokens than the limit says nothing of the rest: those texts are taken whole
        short = [i for i in cut if not self._past_limit(out[i], truncate)]
        if short:
            for i, whole in zip(short, self._encode([texts[i] for i in short], truncate), strict=True):
                out[i] = whole
        return self._refused_past_limit(out, set(cut).difference(short), truncate)

    def _encode_pairs(self, texts: Sequence[str], pairs: Sequence[str], truncate: bool
                      ) -> tuple[list[Encoded], set[int]]:
        """Each pair's encoding, and which pairs were tokenized from a text's start. The library's truncation is not
        used: for a pair it keeps every combination of the two texts' overflowing windows, quadratic in their
        lengths (two texts of 10,000 tokens: 6,319 windows, 1.2 GiB). Each pair is tokenized whole, then its texts
        cut to the lengths the library would keep (`_longest_first`)."""
        firsts, seconds, sides = self._pair_starts(texts, pairs)
        encodings = self._full.encode_batch(list(zip(firsts, seconds, strict=True)))
        sequences = [e.sequence_ids for e in encodings]   # built anew at each read: read once
        whole = [i for i, (a_cut, b_cut) in sides.items()
                 if not self._start_stands(a_cut, b_cut, sequences[i].count(0), sequences[i].count(1))]
        if whole:
            for i, e in zip(whole, self._full.encode_batch([(texts[i], pairs[i]) for i in whole]), strict=True):
                encodings[i], sequences[i] = e, e.sequence_ids
        out = [self._pair_truncated(e, s) if truncate else _encoded(e)
               for e, s in zip(encodings, sequences, strict=True)]
        return out, set(sides).difference(whole)

    def _pair_starts(self, texts: Sequence[str], pairs: Sequence[str]
                     ) -> tuple[list[str], list[str], dict[int, tuple[bool, bool]]]:
        """Each pair's two texts with a long one's start in its place, where its start may stand for it, and for
        those pairs which text was cut. Truncation shares the pair's budget longest first: each text keeps at most
        the budget, and when both pass it the longer (the second, on a tie) gets an odd budget's last token. So a
        start stands for its text when it holds more tokens than the limit and more than the other text
        (`_start_stands`); two long texts are both cut only when the budget is even. A long text with no space
        before the cut is tokenized whole."""
        firsts, seconds = list(texts), list(pairs)
        if not self.cut_chars or self.pair_budget < 0:   # below none: the library leaves pairs whole
            return firsts, seconds, {}
        sides = {}
        for i, (a, b) in enumerate(zip(texts, pairs, strict=True)):
            if len(a) <= self.cut_chars and len(b) <= self.cut_chars:
                continue
            start_a, start_b = _before_space(a, self.cut_chars), _before_space(b, self.cut_chars)
            a_cut, b_cut = start_a is not a, start_b is not b
            if (a_cut or len(a) <= self.cut_chars) and (b_cut or len(b) <= self.cut_chars) and not (
                    a_cut and b_cut and self.pair_budget % 2):
                firsts[i], seconds[i], sides[i] = start_a, start_b, (a_cut, b_cut)
        return firsts, seconds, sides

    def _start_stands(self, a_cut: bool, b_cut: bool, na: int, nb: int) -> bool:
        """Whether a pair's cut texts, of `na` and `nb` tokens, give the whole pair's tokens (`_pair_starts`)."""
        return (not a_cut or na > max(self.max_tokens, 0 if b_cut else nb)) and (
            not b_cut or nb > max(self.max_tokens, 0 if a_cut else na))

    def _pair_truncated(self, encoding: Encoding, sequences: list[int | None]) -> Encoded:
        """The untruncated pair's encoding (`sequences`: its sequence ids) with each text's tokens past what
        `_longest_first` keeps taken out."""
        ids, types = encoding.ids, encoding.type_ids   # fresh lists, the binding's copies
        na, nb = sequences.count(0), sequences.count(1)
        if self.pair_budget < 0 or na + nb <= self.pair_budget:   # below none: the library leaves it whole
            return Encoded(ids, types, False)
        kept = _longest_first(na, nb, self.pair_budget)
        cuts = [(sequences.index(side), side, keep, n)
                for side, keep, n in ((0, kept[0], na), (1, kept[1], nb)) if keep < n]
        for first, side, keep, n in sorted(cuts, reverse=True):   # the later text first: indices stay put
            if sequences[first + n - 1] == side:   # a frame's texts lie each in one run
                del ids[first + keep:first + n], types[first + keep:first + n]
            else:
                return self._pair_kept(encoding, kept)
        return Encoded(ids, types, True)

    @staticmethod
    def _pair_kept(encoding: Encoding, kept: tuple[int, int]) -> Encoded:
        """Each text's first `kept` tokens and the frame's, in a frame that interleaves them."""
        seen, keep = [0, 0], []
        for i, side in enumerate(encoding.sequence_ids):
            if side is not None:
                seen[side] += 1
            if side is None or seen[side] <= kept[side]:
                keep.append(i)
        return Encoded([encoding.ids[i] for i in keep], [encoding.type_ids[i] for i in keep], True)

    def _refused_past_limit(self, out: list[Encoded], counted_from_start: set[int], truncate: bool) -> list[Encoded]:
        """`out`, unless truncation is off and one is past the limit: TextTooLong, "at least" for a cut one's."""
        if not truncate:
            for i, e in enumerate(out):
                if len(e.input_ids) > self.max_tokens:
                    raise TextTooLong(i, len(e.input_ids), self.max_tokens, i not in counted_from_start)
        return out

    def _past_limit(self, encoded: Encoded, truncate: bool) -> bool:
        return encoded.truncated if truncate else len(encoded.input_ids) > self.max_tokens

    @property
    def vocab_size(self) -> int:
        """Ids below this are the tokenizer's (its added tokens counted)."""
        return self._full.get_vocab_size(with_added_tokens=True)

    def tokens(self, texts: Sequence[str], add_special_tokens: bool = True, limit: int | None = None
               ) -> list[list[Token]]:
        """Each text's tokens, untruncated, with the text each covers: what a caller checks before it sends. Raises
        TooManyTokens past `limit` tokens in all, before a Token is made, and once the texts tokenized so far pass
        it (TOKENS_CHUNK_CHARS at a time)."""
        encodings, total = [], 0
        for chunk in _chunks(texts, TOKENS_CHUNK_CHARS):
            encodings += self._full.encode_batch(chunk, add_special_tokens=add_special_tokens)
            total += sum(len(e.ids) for e in encodings[-len(chunk):])
            if limit is not None and total > limit:
                raise TooManyTokens(total, limit, len(encodings), len(texts))
        return [[Token(i, token, True, None, None) if special else Token(i, text[a:b], False, a, b)
                 for i, token, special, (a, b) in zip(e.ids, e.tokens, e.special_tokens_mask, e.offsets, strict=True)]
                for text, e in zip(texts, encodings, strict=True)]

    def decode(self, ids: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """The text of each list of ids (below `vocab_size`)."""
        return self._full.decode_batch([list(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def _encode(self, texts: Sequence[str], truncate: bool) -> list[Encoded]:
        library = self._cut if truncate else self._full
        if self.ascii is None:
            return [_encoded(e) for e in library.encode_batch(list(texts))]
        limit = self.max_tokens if truncate else None
        fast = [self.ascii.encode(text, limit) for text in texts]
        rest = [text for text, f in zip(texts, fast, strict=True) if f is None]
        taken = iter([_encoded(e) for e in library.encode_batch(rest)] if rest else [])
        return [Encoded(f[0], [0] * len(f[0]), f[1]) if f is not None else next(taken) for f in fast]


def _longest_first(na: int, nb: int, budget: int) -> tuple[int, int]:
    """The tokens each text of a pair keeps under the library's longest-first truncation to `budget`: the longer
    text gives up tokens until the pair fits or both are as long; then each keeps half, and an odd budget's last
    token stays with the longer text (the second, on a tie)."""
    if na + nb <= budget:
        return na, nb
    swap = na > nb
    shorter, longer = (nb, na) if swap else (na, nb)
    longer = shorter if shorter > budget else max(shorter, budget - shorter)
    if shorter + longer > budget:
        shorter, longer = budget // 2, budget // 2 + budget % 2
    return (longer, shorter) if swap else (shorter, longer)


def _chunks(texts: Sequence[str], chars: int) -> list[list[str]]:
    """The texts in order, in lists of at least `chars` characters (the last, what is left)."""
    chunks, chunk, size = [], [], 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= chars:
            chunks.append(chunk)
            chunk, size = [], 0
    return [*chunks, chunk] if chunk else chunks


def _encoded(encoding) -> Encoded:
    return Encoded(list(encoding.ids), list(encoding.type_ids), bool(encoding.overflowing))
