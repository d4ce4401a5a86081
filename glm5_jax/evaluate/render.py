"""The evaluation reports' two renderings of one content: markdown (report.md, compare.md) and a
self-contained HTML page (report.html, compare.html: plots embedded as base64 PNG, so the file can
be mailed or attached to a CI run on its own).

A report is a list of blocks (`Heading`, `Paragraph`, `Table`, `Image`); report.py builds them
from results documents. Text is plain except for `code spans` in backticks, which both
renderings keep (markdown as is, HTML as <code>); everything else is escaped for HTML.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import re
from collections.abc import Sequence
from pathlib import Path

_CODE_SPAN = re.compile(r"`([^`]+)`")
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 75em; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
tr:nth-child(even) td { background: #fafafa; }
code { background: #f2f2f2; padding: 0 0.2em; }
img { max-width: 100%; }
"""


@dataclasses.dataclass(frozen=True)
class Heading:
    """A section title; level 1 is the report's own."""

    level: int
    text: str


@dataclasses.dataclass(frozen=True)
class Paragraph:
    """Plain text (markdown inline code and links pass through)."""

    text: str


@dataclasses.dataclass(frozen=True)
class Table:
    """header: column titles (all empty: a key-value table, no header row in HTML)."""

    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclasses.dataclass(frozen=True)
class Image:
    """A plot saved next to the report: linked by file name in markdown, embedded in HTML."""

    alt: str
    file: Path


Block = Heading | Paragraph | Table | Image


# ---------------------------------------------------------------- markdown
def _markdown_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _markdown_block(block: Block) -> str:
    if isinstance(block, Heading):
        return f"{'#' * block.level} {block.text}"
    if isinstance(block, Paragraph):
        return block.text
    if isinstance(block, Image):
        return f"![{block.alt}]({block.file.name})"
    header = "|" + "|".join(f" {_markdown_cell(c)} " if c else " " for c in block.header) + "|"
    lines = [header, "|" + "---|" * len(block.header)]
    lines += ["| " + " | ".join(_markdown_cell(c) for c in row) + " |" for row in block.rows]
    return "\n".join(lines)


def to_markdown(blocks: Sequence[Block]) -> str:
    """The blocks separated by blank lines."""
    return "\n\n".join(_markdown_block(block) for block in blocks) + "\n"


# ---------------------------------------------------------------- HTML
def inline_html(text: str) -> str:
    """Escaped text, `code spans` as <code>."""
    return _CODE_SPAN.sub(r"<code>\1</code>", html.escape(text))


def _image_html(block: Image) -> str:
    alt = html.escape(block.alt, quote=True)
    if block.file.is_file():
        data = base64.b64encode(block.file.read_bytes()).decode("ascii")
        return f'<p><img alt="{alt}" src="data:image/png;base64,{data}"></p>'
    return f'<p><img alt="{alt}" src="{html.escape(block.file.name, quote=True)}"></p>'


def _html_block(block: Block) -> str:
    if isinstance(block, Heading):
        return f"<h{block.level}>{inline_html(block.text)}</h{block.level}>"
    if isinstance(block, Paragraph):
        return f"<p>{inline_html(block.text)}</p>"
    if isinstance(block, Image):
        return _image_html(block)
    header = "".join(f"<th>{inline_html(c)}</th>" for c in block.header)
    lines = ["<table>", f"<thead><tr>{header}</tr></thead>" if any(block.header) else "", "<tbody>"]
    lines += ["<tr>" + "".join(f"<td>{inline_html(c)}</td>" for c in row) + "</tr>" for row in block.rows]
    lines.append("</tbody></table>")
    return "\n".join(lines)


def to_html(blocks: Sequence[Block], title: str) -> str:
    """A whole HTML page; `title` is plain text (backticks dropped)."""
    head = (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title.replace('`', ''))}</title>\n<style>{STYLE}</style>\n</head>\n<body>"
    )
    return "\n".join([head, *(_html_block(block) for block in blocks), "</body>\n</html>"]) + "\n"
