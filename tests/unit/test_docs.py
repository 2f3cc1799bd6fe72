"""The README and docs/ name each measurement by its date and commit, never by an internal run number, and
every relative link in them resolves to a file or folder of the checkout."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# The lab notebook the benchmark pages came from numbered its runs ("sb" and a number, a student_bench run)
# and its working sessions ("stop" and a number, or "this stop"); a reader cannot look either up. Letters
# or digits on either side are other words, so they do not match.
RUN_ID = re.compile(r"(?<![A-Za-z0-9])(?:sb\d+|stop[ _]?\d+)(?![A-Za-z0-9])|\bthis stop\b", re.IGNORECASE)

# [text](target) and ![alt](target), with an optional "title"; code is removed first (a link inside
# backticks or a fenced block is text, not a link).
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def run_ids(text: str) -> list[str]:
    return [m.group(0) for m in RUN_ID.finditer(text)]


def broken_links(text: str, page_dir: Path) -> list[str]:
    """Relative link targets in markdown `text` (read from a page in `page_dir`) that name no existing path."""
    prose = INLINE_CODE.sub("", FENCE.sub("", text))
    broken = []
    for m in LINK.finditer(prose):
        target = m.group(1)
        if EXTERNAL.match(target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not (page_dir / path).exists():
            broken.append(target)
    return broken


# The ids are put together from a template, so that this file names no run itself.
@pytest.mark.parametrize("template,number", [
    ("the four runs sb{n} and on met all three targets", 45),
    ("(`summary_rounds_sb{n}.json`)", 45),
    ("On an H200 (stop {n})", 30),
    ("in stop{n}'s logs", 30),
    ("bursts_stop{n}/", 28),
    ("Stop {n}'s runs", 17),
    ("new this stop{n}", ""),
])
def test_a_run_id_is_found(template: str, number: int | str) -> None:
    text = template.format(n=number)
    assert run_ids(text), text


@pytest.mark.parametrize("text", [
    "2026-11-28, commit 24f92e6: narrow students",
    "(c) 3.29× inside the bursts (whole run 2.14×)",
    "each run 12 s of Poisson arrivals",
    "usb3 and nonstop 5 and sb45a are other words",
    "the scheduler stops 2 groups",
    "open-telemetry-python-contrib#3271",
])
def test_ordinary_text_is_not_a_run_id(text: str) -> None:
    assert not run_ids(text), run_ids(text)


def test_a_broken_relative_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "here.md").write_text("x")
    (tmp_path / "data").mkdir()
    text = ("[ok](here.md) [anchor](here.md#part) [folder](data/) [web](https://example.com) [top](#top)\n"
            "![gone](data/missing.png) [gone too](nowhere.md#part) `[in code](missing.md)`\n"
            "```\n[in a block](missing.md)\n```\n")
    assert broken_links(text, tmp_path) == ["data/missing.png", "nowhere.md#part"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_page_names_no_run_id(page: Path) -> None:
    found = [(n, line.strip()) for n, line in enumerate(page.read_text().splitlines(), 1) if run_ids(line)]
    assert not found, f"{page.relative_to(ROOT)}: name runs by date and commit: {found}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert not broken_links(page.read_text(), page.parent), page.relative_to(ROOT)


def test_the_pages_are_found() -> None:
    assert ROOT / "README.md" in PAGES and any(p.parent.name == "benchmarks" for p in PAGES)
