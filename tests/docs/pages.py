"""The project's Markdown pages as the docs checks read them: code, links, headings, tables.

A page is split into fenced code blocks (```` ``` ````) and the rest; in the rest,
code spans (`` `...` ``) are told apart from prose. Links are read from the prose
only (a link in code is an example), headings give the anchors GitHub makes
(:func:`slug`), and a table is a run of lines that start with ``|``.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")
_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)


def _closes(line: str, fence: str) -> bool:
    """Whether ``line`` ends a block opened by ``fence``: the same character, at least as many, nothing else."""
    mark = line.strip()
    return len(mark) >= len(fence) and set(mark) == {fence[0]}


def pages() -> list[Path]:
    """The pages a reader is sent to: the README, BENCHMARKS.md and everything under docs/."""
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]


@dataclass(frozen=True)
class Block:
    """A fenced code block: its info string (``yaml``, ``python``, or empty) and its text."""

    info: str
    text: str
    line: int  # of its first line of code, 1-based


@dataclass(frozen=True)
class Span:
    """A code span, with the line it starts on and the table row's first cell it sits in (if any)."""

    text: str
    line: int
    table_header: str | None  # the first header cell of the table the span is in


class Page:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.text = path.read_text()

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))

    @cached_property
    def _split(self) -> tuple[list[Block], list[tuple[int, str]]]:
        """The fenced blocks, and every other line as (number, text)."""
        blocks: list[Block] = []
        rest: list[tuple[int, str]] = []
        fence: str | None = None
        info, start, body = "", 0, []
        for number, line in enumerate(self.text.splitlines(), 1):
            opening = _FENCE.match(line)
            if fence is None and opening:
                fence, info, start, body = opening.group(1), opening.group(2), number + 1, []
            elif fence is not None and _closes(line, fence):
                blocks.append(Block(info, "\n".join(body), start))
                fence = None
            elif fence is not None:
                body.append(line)
            else:
                rest.append((number, line))
        return blocks, rest

    @property
    def blocks(self) -> list[Block]:
        return self._split[0]

    @property
    def lines(self) -> list[tuple[int, str]]:
        """The lines outside fenced blocks, numbered."""
        return self._split[1]

    @cached_property
    def spans(self) -> list[Span]:
        """Every code span outside fenced blocks (a span does not cross a blank line)."""
        found: list[Span] = []
        header: str | None = None
        paragraph: list[tuple[int, str]] = []

        def flush() -> None:
            text = "\n".join(line for _, line in paragraph)
            starts = [number for number, _ in paragraph]
            offsets = [m.start() for m in re.finditer(r"^", text, re.MULTILINE)]
            for match in _SPAN.finditer(text):
                row = sum(1 for offset in offsets if offset <= match.start()) - 1
                in_table = paragraph[row][1].lstrip().startswith("|")
                text = " ".join(match.group(2).split())  # a span wrapped over lines reads as one line
                found.append(Span(text, starts[row], header if in_table else None))
            paragraph.clear()

        previous = ""
        for number, line in self.lines:
            if not line.strip():
                flush()
            else:
                if line.lstrip().startswith("|") and not previous.lstrip().startswith("|"):
                    header = line.strip().strip("|").split("|")[0].strip()
                paragraph.append((number, line))
            previous = line
        flush()
        return found

    @cached_property
    def prose(self) -> list[tuple[int, str]]:
        """The lines outside fenced blocks with their code spans blanked out."""
        return [(number, _SPAN.sub(lambda m: " " * len(m.group(0)), line)) for number, line in self.lines]

    @cached_property
    def links(self) -> list[tuple[int, str]]:
        """(line, target) of every inline link, image and reference definition in the prose."""
        found: list[tuple[int, str]] = []
        for number, line in self.prose:
            found += [(number, m.group(2)) for m in _INLINE_LINK.finditer(line)]
            reference = _REFERENCE.match(line)
            if reference:
                found.append((number, reference.group(2)))
        return found

    @cached_property
    def anchors(self) -> set[str]:
        """The anchors GitHub gives this page: a slug per heading (repeats numbered), and HTML anchors."""
        seen: Counter[str] = Counter()
        anchors: set[str] = set()
        for _, line in self.lines:
            heading = _HEADING.match(line)
            if heading:
                base = slug(heading.group(2))
                anchors.add(f"{base}-{seen[base]}" if seen[base] else base)
                seen[base] += 1
            anchors.update(_HTML_ANCHOR.findall(line))
        return anchors


def slug(heading: str) -> str:
    """The anchor GitHub makes of a heading's text (github-slugger's rule).

    The rendered text (code spans, links and emphasis marks gone, their words kept)
    in lower case; every character that is not a letter, a digit, a mark, ``_``,
    ``-`` or a space removed; each space a ``-``.
    """
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # HTML tags
    text = re.sub(r"(`+)(.+?)\1", r"\2", text)  # code spans: their text
    text = re.sub(r"(\*{1,3}|(?<!\w)_{1,3}|_{1,3}(?!\w))", "", text)  # emphasis marks
    kept = "".join(ch for ch in text.lower() if ch in "-_ " or unicodedata.category(ch)[0] in "LNM")
    return kept.replace(" ", "-")
