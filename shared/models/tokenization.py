"""Fast tokenization of the teacher's vocabulary, with the serving limits applied."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer


class TextTooLong(ValueError):
    """A text exceeds the token limit and the caller turned truncation off."""

    def __init__(self, index: int, num_tokens: int, limit: int) -> None:
        super().__init__(f"texts[{index}] has {num_tokens} tokens; the limit is {limit} (truncation is off)")
        self.index, self.num_tokens, self.limit = index, num_tokens, limit


@dataclass(frozen=True)
class Encoded:
    """Token ids of one text (or text pair), [CLS] ... [SEP] framed, unpadded."""

    input_ids: list[int]
    token_type_ids: list[int]
    truncated: bool = False   # tokens were cut at the limit (a text exactly at it is whole)


class TeacherTokenizer:
    """The model's own fast tokenizer; the file's fixed padding is switched off (workers pad)."""

    def __init__(self, model_dir: Path | None, max_tokens: int = 256, raw: str = "") -> None:
        self.max_tokens = max_tokens
        raw = raw or (Path(model_dir) / "tokenizer.json").read_text()
        self._full = Tokenizer.from_str(raw)
        self._full.no_padding()
        self._full.no_truncation()
        self._cut = Tokenizer.from_str(raw)
        self._cut.no_padding()
        self._cut.enable_truncation(max_length=max_tokens)

    @classmethod
    def from_json(cls, raw: str, max_tokens: int) -> TeacherTokenizer:
        """From tokenizer.json's text (a user's model's, as the gateway reads it from Redis)."""
        return cls(None, max_tokens, raw)

    def encode(
        self, texts: Sequence[str], pairs: Sequence[str] | None = None, truncate: bool = True
    ) -> list[Encoded]:
        """Encodes texts (or text pairs); raises TextTooLong when truncation is off."""
        inputs = list(zip(texts, pairs, strict=True)) if pairs else list(texts)
        if truncate:
            return [_encoded(e) for e in self._cut.encode_batch(inputs)]
        out = [_encoded(e) for e in self._full.encode_batch(inputs)]
        for i, e in enumerate(out):
            if len(e.input_ids) > self.max_tokens:
                raise TextTooLong(i, len(e.input_ids), self.max_tokens)
        return out


def _encoded(encoding) -> Encoded:
    return Encoded(list(encoding.ids), list(encoding.type_ids), bool(encoding.overflowing))
