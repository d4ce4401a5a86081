"""Level 3: domain tagging (code / prose / docs / other) and per-domain cleaning.

Tagging looks at the file name first (a `.py` file is code, a `.rst` or `.md` file docs), then at the
text: lines that look like code, reST/Markdown markup, sentences with common English words.

Cleaning:
    code    a leading comment block that names a licence or copyright is removed; trailing
            whitespace stripped; runs of blank lines cut to `max_blank_lines_code`
    docs, prose, other
            trailing whitespace stripped; runs of blank lines cut to `max_blank_lines_text`;
            prose also collapses runs of spaces inside lines
"""

from __future__ import annotations

import re

from glm5_jax.prepare.config import DomainSettings

CODE_EXTENSIONS = (
    ".py",
    ".pyi",
    ".pyx",
    ".c",
    ".h",
    ".cc",
    ".cpp",
    ".hpp",
    ".cu",
    ".js",
    ".ts",
    ".go",
    ".rs",
    ".java",
    ".kt",
    ".scala",
    ".swift",
    ".rb",
    ".pl",
    ".lua",
    ".sh",
    ".sql",
    ".r",
    ".jl",
    ".cs",
)
DOCS_EXTENSIONS = (".rst", ".rst.txt", ".md", ".markdown", ".adoc", ".tex")
_CODE_LINE = re.compile(
    r"^\s*(def |class |import |from \S+ import |#include|#define|function |var |let |const |return\b|"
    r"if\s*\(|for\s*\(|while\s*\(|\}|@\w+)|[;{]\s*$"
)
_DOCS_MARKUP = re.compile(
    r"^(\.\. [\w:-]+::|\.\. _|[=\-~^\"'`#*+]{4,}\s*$|#{1,6} |```|\s*:\w[\w ]*:)|:\w+:`|``\w"
)
_WORD = re.compile(r"[A-Za-z]+")
_COMMON_WORDS = frozenset(
    "the be to of and a in that have it for not on with as you do at this but by from".split()
)
_COMMENT_LINE = re.compile(r"^\s*(#|//|\*|/\*|\*/|--|;)")
_LICENCE = re.compile(r"licen[cs]e|copyright|\(c\)|all rights reserved", re.IGNORECASE)


def _path_of(doc_id: str) -> str:
    """The file part of a document id (`path`, `path:line` or `path#2`), lower-cased."""
    path = doc_id.lower().split("#", 1)[0]
    head, _, tail = path.rpartition(":")
    return head if head and tail.isdigit() else path


def tag_domain(doc_id: str, text: str) -> str:
    """The document's domain: "code", "docs", "prose" or "other".

    Args:
        doc_id: the document's id (its file name decides first).
        text: the normalised text.
    """
    path = _path_of(doc_id)
    if path.endswith(CODE_EXTENSIONS):
        return "code"
    if path.endswith(DOCS_EXTENSIONS):
        return "docs"
    lines = [line for line in text.split("\n") if line.strip()]
    if not lines:
        return "other"
    if sum(bool(_CODE_LINE.search(line)) for line in lines) / len(lines) >= 0.3:
        return "code"
    if sum(bool(_DOCS_MARKUP.search(line)) for line in lines) / len(lines) >= 0.1:
        return "docs"
    words = _WORD.findall(text.lower())
    if len(words) >= 20 and sum(word in _COMMON_WORDS for word in words) / len(words) >= 0.1:
        return "prose"
    return "other"


def _strip_licence_header(lines: list[str]) -> list[str]:
    """Removes a leading comment block (after a shebang or encoding line) that mentions a licence."""
    start = 0
    while start < len(lines) and (
        lines[start].startswith("#!") or "coding" in lines[start][:40] and lines[start].startswith("#")
    ):
        start += 1
    end = start
    while end < len(lines) and (_COMMENT_LINE.match(lines[end]) or (end > start and not lines[end].strip())):
        end += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    if end > start and _LICENCE.search("\n".join(lines[start:end])):
        rest = lines[end:]
        while rest and not rest[0].strip():
            rest.pop(0)
        return lines[:start] + rest
    return lines


def _limit_blank_runs(lines: list[str], limit: int) -> list[str]:
    kept, blank = [], 0
    for line in lines:
        blank = blank + 1 if not line else 0
        if blank <= limit:
            kept.append(line)
    return kept


def clean_text(text: str, domain: str, settings: DomainSettings) -> str:
    """The domain's cleaning of one document (see the module docstring); "" when nothing is left."""
    lines = [line.rstrip() for line in text.split("\n")]
    if domain == "code":
        if settings.strip_license_headers:
            lines = _strip_licence_header(lines)
        lines = _limit_blank_runs(lines, settings.max_blank_lines_code)
    else:
        if domain == "prose":
            lines = [re.sub(r"(?<=\S) {2,}", " ", line) for line in lines]
        lines = _limit_blank_runs(lines, settings.max_blank_lines_text)
    return "\n".join(lines).strip("\n")
