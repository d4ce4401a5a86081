"""Structured pairs from code and documentation, as training sequences or chat conversations.

    python -m glm5_jax.data.structured_pairs --output pairs.jsonl [--format chat|text]
        [--code GLOB ...] [--docs GLOB ...] [--kinds function_docstring,...] [--max-pairs N]

Kinds (every answer is text a person wrote, never a template's guess):
    function_docstring   a function with its docstring removed -> the docstring
    docstring_function   the function's signature and docstring -> the function
    section_summary      a section's body -> its summary line: a docstring's body -> its first line
                         (PEP 257's summary line), a reST or Markdown section's body -> its title
Formats:
    chat   {"messages": [user, assistant]} lines for a `chat_jsonl` source (loss on the answer)
    text   {"text": prompt + answer} lines for a `jsonl` source (field "text"): whole sequences
Code is read with `ast` (nothing is imported or run); public functions and methods of at most
MAX_FUNCTION_LINES lines. Without --code/--docs the inputs are the standard library and, when
installed, python3-doc (the `python_stdlib` source). The output is deterministic: same inputs,
same file. (glm5_jax/data/templated.py makes the demo SFT set's stdlib questions; this is the
general generator.)
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import os
import re
import textwrap
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from glm5_jax.data.sources import Document, SourceSpec, load_documents

KINDS = ("function_docstring", "docstring_function", "section_summary")
FORMATS = ("chat", "text")
MAX_FUNCTION_LINES = 60  # longer functions would not fit a demo row
MIN_BODY_WORDS = 20  # a section or docstring body shorter than this has little to summarise
MAX_BODY_WORDS = 400
GENERIC_TITLES = frozenset(
    {
        "example",
        "examples",
        "notes",
        "note",
        "see also",
        "footnotes",
        "contents",
        "table of contents",
        "references",
        "index",
        "introduction",
        "overview",
        "usage",
    }
)
_RST_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+])\1{2,}\s*$")
_MARKDOWN_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
_PROMPTS = {
    "function_docstring": "Write the docstring of this function:\n\n```python\n{prompt}\n```",
    "docstring_function": "Implement this function:\n\n```python\n{prompt}\n```",
    "section_summary": "Summarise this in one line:\n\n{prompt}",
}


class Pair(NamedTuple):
    """One structured pair: `prompt` (the input) and `answer` (the human-written target)."""

    kind: str
    source_id: str  # `path:line` of the function or section
    prompt: str
    answer: str


def _words(text: str) -> int:
    return len(text.split())


def _summary_pair(source_id: str, docstring: str) -> Pair | None:
    """A docstring's body -> its summary line, when it has both (PEP 257 layout)."""
    summary, _, body = docstring.partition("\n\n")
    if "\n" in summary.strip() or not MIN_BODY_WORDS <= _words(body) <= MAX_BODY_WORDS:
        return None
    return Pair("section_summary", source_id, body.strip(), summary.strip())


def _function_source(text_lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, str]:
    """(the function without its docstring, its signature + docstring), both dedented."""
    first = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list]) - 1
    lines = text_lines[first : node.end_lineno]
    docstring = node.body[0]
    start, end = docstring.lineno - 1 - first, docstring.end_lineno - first
    without = textwrap.dedent("\n".join(lines[:start] + lines[end:]))
    header = textwrap.dedent("\n".join(lines[:end]))
    return without.rstrip(), header.rstrip()


def code_pairs(doc_id: str, text: str, kinds: Sequence[str] = KINDS) -> Iterator[Pair]:
    """The pairs of one Python source file (public functions and methods with docstrings)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    text_lines = text.split("\n")
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef | ast.Module) and "section_summary" in kinds:
            docstring = ast.get_docstring(node)
            pair = docstring and _summary_pair(f"{doc_id}:{getattr(node, 'lineno', 1)}", docstring)
            if pair:
                yield pair
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name.startswith("_"):
            continue
        docstring = ast.get_docstring(node)
        if not docstring or len(node.body) < 2 or node.end_lineno - node.lineno >= MAX_FUNCTION_LINES:
            continue  # no docstring, nothing but a docstring, or too long
        source_id = f"{doc_id}:{node.lineno}"
        without, header = _function_source(text_lines, node)
        docstring = inspect.cleandoc(docstring)
        if "function_docstring" in kinds:
            yield Pair("function_docstring", source_id, without, docstring)
        if "docstring_function" in kinds:
            yield Pair("docstring_function", source_id, header, without)
        if "section_summary" in kinds:
            pair = _summary_pair(source_id, docstring)
            if pair:
                yield pair


def _sections(text: str) -> Iterator[tuple[int, str, list[str]]]:
    """(line number, title, body lines) of each reST or Markdown section."""
    lines = text.split("\n")
    headings = []  # (index of the title line, title, index of the first body line)
    for index, line in enumerate(lines):
        match = _MARKDOWN_HEADING.match(line)
        if match:
            headings.append((index, match.group(1), index + 1))
        elif (
            index > 0
            and _RST_UNDERLINE.match(line)
            and lines[index - 1].strip()
            and not _RST_UNDERLINE.match(lines[index - 1])
            and len(line.rstrip()) >= len(lines[index - 1].rstrip())
        ):
            headings.append((index - 1, lines[index - 1].strip(), index + 1))
    for position, (title_index, title, body_start) in enumerate(headings):
        end = headings[position + 1][0] if position + 1 < len(headings) else len(lines)
        if end > body_start and _RST_UNDERLINE.match(lines[end - 1]):  # the next title's overline
            end -= 1
        yield title_index + 1, title, lines[body_start:end]


def doc_pairs(doc_id: str, text: str, kinds: Sequence[str] = KINDS) -> Iterator[Pair]:
    """Section body -> title pairs of one reST or Markdown document."""
    if "section_summary" not in kinds:
        return
    for line_number, title, body_lines in _sections(text):
        body = "\n".join(body_lines).strip()
        title = title.strip("*_` ")
        if (
            title.lower().rstrip(":") in GENERIC_TITLES
            or not MIN_BODY_WORDS <= _words(body) <= MAX_BODY_WORDS
        ):
            continue
        yield Pair("section_summary", f"{doc_id}:{line_number}", body, title)


def document_pairs(documents: Iterable[Document], kinds: Sequence[str] = KINDS) -> list[Pair]:
    """All pairs of the documents: `.py` files as code, everything else as documentation."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown pair kind(s) {unknown}; expected some of {KINDS}")
    pairs = []
    for document in documents:
        reader = code_pairs if document.doc_id.endswith(".py") else doc_pairs
        pairs.extend(reader(document.doc_id, document.text, kinds))
    return pairs


def render(pair: Pair, output_format: str) -> dict:
    """One JSONL record: {"messages": [...]} (chat) or {"text": ...} (text)."""
    user = _PROMPTS[pair.kind].format(prompt=pair.prompt)
    answer = f"```python\n{pair.answer}\n```" if pair.kind == "docstring_function" else pair.answer
    if output_format == "chat":
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
    if output_format == "text":
        return {"text": f"{user}\n\n{answer}"}
    raise ValueError(f"format {output_format!r} is not one of {FORMATS}")


def sample_pairs(pairs: Sequence[Pair], max_pairs: int | None, seed: int = 0) -> list[Pair]:
    """At most max_pairs of the pairs, a sample fixed by (seed, kind, source id), in input order."""
    if max_pairs is None or len(pairs) <= max_pairs:
        return list(pairs)
    rank = lambda item: hashlib.sha256(f"{seed}\x00{item[1].kind}\x00{item[1].source_id}".encode()).digest()
    chosen = sorted(sorted(enumerate(pairs), key=rank)[:max_pairs])
    return [pair for _, pair in chosen]


def write_pairs(output: str | os.PathLike, pairs: Sequence[Pair], output_format: str) -> int:
    """Writes the pairs as JSONL (atomically); returns how many."""
    output = Path(output).expanduser()
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".partial")
    partial.write_text(
        "".join(json.dumps(render(pair, output_format), ensure_ascii=False) + "\n" for pair in pairs),
        encoding="utf-8",
    )
    partial.replace(output)
    return len(pairs)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="chat",
        help="chat: conversations for chat_jsonl; text: {'text'} sequences for jsonl",
    )
    parser.add_argument("--code", action="append", default=[], help="glob of Python files (repeatable)")
    parser.add_argument(
        "--docs", action="append", default=[], help="glob of reST/Markdown files (repeatable)"
    )
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, among {', '.join(KINDS)}")
    parser.add_argument("--max-pairs", type=int, default=None, help="keep a fixed sample of at most N pairs")
    parser.add_argument("--seed", type=int, default=0, help="fixes the --max-pairs sample")
    args = parser.parse_args(argv)
    globs = args.code + args.docs
    spec = SourceSpec(kind="files", paths=tuple(globs)) if globs else SourceSpec(kind="python_stdlib")
    pairs = document_pairs(load_documents(spec), [kind for kind in args.kinds.split(",") if kind])
    pairs = sample_pairs(pairs, args.max_pairs, args.seed)
    counts = {kind: sum(pair.kind == kind for pair in pairs) for kind in KINDS}
    print(f"wrote {write_pairs(args.output, pairs, args.format)} pairs ({counts}) to {args.output}")


if __name__ == "__main__":
    main()
