"""Templated chat data from code on this machine: the structured pairs the GLM-5.2 article
describes (code -> explanation, name -> what it does), as chat_jsonl conversations.

    python -m glm5_jax.data.templated --output stdlib_chat.jsonl [--max-conversations N] [--pairs P.jsonl]

For every public, documented function and class of the standard library's own modules (read with
`ast`, nothing is imported), up to three conversations:
    "What does `module.name` do?"                   -> the docstring's first paragraph
    "Explain this code: ```python <source>```"      -> "`name` ..." + the first paragraph
    "What are the parameters of `module.name`?"     -> the signature, with its defaults
Deterministic: the same Python installation gives the same file.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

SYSTEM_PROMPT = "You are a concise assistant that explains Python's standard library."
MAX_SOURCE_LINES = 40  # longer definitions are not shown as code (they would not fit a demo row)
# A small, fixed set of well-documented modules keeps the demo set small and the answers clean.
DEFAULT_MODULES = ("textwrap", "string", "bisect", "heapq", "colorsys", "fnmatch", "glob", "shlex",
                   "json/encoder", "json/decoder", "json/__init__", "base64", "calendar", "difflib",
                   "statistics", "fractions", "functools", "itertools", "operator", "random", "csv",
                   "copy", "pprint", "reprlib", "graphlib", "dataclasses", "enum", "contextlib",
                   "shutil", "tempfile", "posixpath", "zipfile/__init__", "gzip", "html/__init__",
                   "ipaddress", "uuid", "secrets", "hashlib", "hmac", "datetime", "locale", "gettext",
                   "argparse", "optparse", "configparser", "tokenize", "keyword", "linecache")


def _first_paragraph(docstring: str) -> str:
    return " ".join(docstring.strip().split("\n\n")[0].split())


def _signature(node: ast.FunctionDef) -> str:
    return f"{node.name}({ast.unparse(node.args)})"


def _definitions(path: Path) -> Iterator[tuple[ast.AST, str]]:
    """Public documented top-level functions and classes of one file, with their source."""
    text = path.read_text(encoding="utf-8", errors="replace")
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
            docstring = ast.get_docstring(node)
            if docstring and len(_first_paragraph(docstring)) >= 20:
                yield node, ast.get_source_segment(text, node) or ""


def _conversation(user: str, answer: str) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user},
                         {"role": "assistant", "content": answer}]}


def conversations(module_path: Path, module: str) -> Iterator[dict]:
    """The templated conversations of one module file."""
    for node, source in _definitions(module_path):
        name, summary = f"{module}.{node.name}", _first_paragraph(ast.get_docstring(node))
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        yield _conversation(f"What does `{name}` do?", f"`{name}` is a {kind}: {summary}")
        if len(source.splitlines()) <= MAX_SOURCE_LINES:
            yield _conversation(f"Explain this code:\n```python\n{source}\n```",
                                f"This defines the {kind} `{node.name}` from `{module}`. {summary}")
        if isinstance(node, ast.FunctionDef):
            yield _conversation(f"What is the signature of `{name}`?",
                                f"`{name}` is called as `{_signature(node)}`.")


def stdlib_conversations(modules: Sequence[str] = DEFAULT_MODULES) -> list[dict]:
    """Conversations from the named stdlib modules (paths relative to the stdlib, no `.py`)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for module in modules:
        path = root / f"{module}.py"
        if path.is_file():
            found.extend(conversations(path, module.removesuffix("/__init__").replace("/", ".")))
    if not found:
        raise FileNotFoundError(f"no documented definitions found in the standard library at {root}")
    return found


def wrong_answer_pairs(conversations: Sequence[dict], seed: int = 0) -> list[dict]:
    """Synthetic preference pairs (the preference_jsonl format): each conversation's answer is
    chosen, the answer of another conversation with the same question template rejected, the
    kind of mistake (a right-sounding answer about the wrong thing) DPO should learn to avoid."""
    import random

    rng = random.Random(seed)
    by_template: dict[str, list[dict]] = {}
    for conversation in conversations:
        by_template.setdefault(conversation["messages"][1]["content"].split("`")[0], []).append(conversation)
    pairs = []
    for group in by_template.values():
        for index, conversation in enumerate(group):
            if len(group) > 1:
                other = group[(index + rng.randrange(1, len(group))) % len(group)]
                pairs.append({"messages": conversation["messages"][:-1],
                              "chosen": conversation["messages"][-1], "rejected": other["messages"][-1]})
    return pairs


def _write_lines(output: str | os.PathLike, records: Sequence[dict]) -> int:
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_suffix(output.suffix + ".partial")
    partial.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    partial.replace(output)
    return len(records)


def write_chat_set(output: str | os.PathLike, max_conversations: int | None = None) -> int:
    """Writes the templated stdlib conversations as chat_jsonl (atomically); returns how many."""
    return _write_lines(output, stdlib_conversations()[:max_conversations])


def ensure_chat_set(output: str | os.PathLike, pairs: bool = False) -> str:
    """The chat set (or its preference pairs) at `output`, written first if it does not exist yet
    (used by configs/sft_demo.py and configs/dpo_demo.py)."""
    if not Path(output).expanduser().is_file():
        records = stdlib_conversations()
        _write_lines(Path(output).expanduser(), wrong_answer_pairs(records) if pairs else records)
    return str(output)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="chat_jsonl file to write")
    parser.add_argument("--max-conversations", type=int, default=None, help="keep the first N (default all)")
    parser.add_argument("--pairs", default=None, help="also write preference pairs (preference_jsonl) here")
    args = parser.parse_args(argv)
    print(f"wrote {write_chat_set(args.output, args.max_conversations)} conversations to {args.output}")
    if args.pairs:
        count = _write_lines(args.pairs, wrong_answer_pairs(stdlib_conversations()[:args.max_conversations]))
        print(f"wrote {count} preference pairs to {args.pairs}")


if __name__ == "__main__":
    main()
