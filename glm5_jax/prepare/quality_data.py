"""Training data for the level-2 quality classifier: curated passages (positive) and synthetic junk
made from them (negative).

Positives: passages of curated text: the docstrings of Python files (module, class and function
docstrings of at least `min_words` words) and paragraphs of documentation (reST, Markdown, plain
text), grouped into passages of about 60-300 words.

Negatives, one per positive, the kinds of low-quality text a web crawl is full of, each built from
its positive's words so the classifier cannot win on vocabulary alone:
    word_salad    the passage's words shuffled (separable only by word order: bigrams)
    keyword_spam  a few of its words repeated between search-engine filler
    boilerplate   navigation, cookie, share and footer lines around a few of its words
    fragments     its sentences cut to two-to-four-word captions, one per line
    token_soup    its words mixed with numbers, symbols and markup debris
The held-out split is by a hash of the positive's id; a negative follows its positive, so no
held-out text has a near copy in training.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import random
import re
from collections.abc import Iterator, Sequence

from glm5_jax.data.sources import Document

NEGATIVE_KINDS = ("word_salad", "keyword_spam", "boilerplate", "fragments", "token_soup")
_FILLER = (
    "best",
    "free",
    "cheap",
    "online",
    "top 10",
    "buy now",
    "click here",
    "2024",
    "review",
    "deals",
    "download",
    "official",
    "guide",
    "near me",
    "discount",
    "vs",
)
_BOILERPLATE = (
    "Home | About | Blog | Contact",
    "Skip to main content",
    "Accept all cookies",
    "This website uses cookies to improve your experience.",
    "Share on Facebook",
    "Tweet",
    "Pin it",
    "Subscribe to our newsletter!",
    "Sign in / Register",
    "Posted by admin",
    "Related posts:",
    "Leave a comment",
    "Copyright © 2021. All rights reserved.",
    "Privacy Policy | Terms of Use",
    "Read more »",
    "Next page →",
    "Tags:",
    "Menu",
    "Search this site",
    "Powered by WordPress",
    "Back to top ↑",
    "Categories",
    "Archives",
)
_DEBRIS = ("|", "||", "--", "&nbsp;", "<br>", "{{", "}}", "[1]", "%", "$", "@", "#", ">>", "0x3f", "404", "=")


def _docstrings(text: str) -> Iterator[str]:
    """Module, class and function docstrings of a Python source, cleaned of indentation."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                yield inspect.cleandoc(docstring)


def _passages(text: str, min_words: int, max_words: int) -> Iterator[str]:
    """Consecutive paragraphs grouped into passages of min_words..max_words words (longer ones cut)."""
    current: list[str] = []
    count = 0
    for paragraph in re.split(r"\n\s*\n", text):
        words = len(paragraph.split())
        if not words:
            continue
        current.append(paragraph.strip("\n"))
        count += words
        if count >= min_words:
            passage = "\n\n".join(current)
            yield passage if count <= max_words else " ".join(passage.split()[:max_words])
            current, count = [], 0
    if count >= min_words:
        yield "\n\n".join(current)


def positive_passages(
    documents: Sequence[Document], min_words: int = 60, max_words: int = 300
) -> list[Document]:
    """Curated passages of the documents (see the module docstring), ids `doc_id@k`."""
    passages = []
    for document in documents:
        if document.doc_id.endswith(".py"):
            pieces = [
                piece
                for docstring in _docstrings(document.text)
                for piece in _passages(docstring, min_words, max_words)
            ]
        else:
            pieces = list(_passages(document.text, min_words, max_words))
        passages.extend(Document(f"{document.doc_id}@{k}", piece) for k, piece in enumerate(pieces))
    return passages


def _rng(seed: int, doc_id: str) -> random.Random:
    return random.Random(int.from_bytes(hashlib.sha256(f"{seed}\x00{doc_id}".encode()).digest()[:8], "big"))


def negative_text(kind: str, text: str, rng: random.Random) -> str:
    """One synthetic junk text of `kind` made from `text`'s words."""
    words = text.split()
    content = [word for word in words if len(word) > 3 and word.isalpha()] or words
    if kind == "word_salad":
        shuffled = list(words)
        rng.shuffle(shuffled)
        return " ".join(shuffled)
    if kind == "keyword_spam":
        keywords = rng.sample(content, min(4, len(content)))
        return " ".join(
            rng.choice(keywords) if rng.random() < 0.6 else rng.choice(_FILLER) for _ in range(len(words))
        )
    if kind == "boilerplate":
        lines = [rng.choice(_BOILERPLATE) for _ in range(max(6, len(words) // 8))]
        for _ in range(len(lines) // 3):
            lines.insert(rng.randrange(len(lines)), " ".join(rng.sample(content, min(3, len(content)))))
        return "\n".join(lines)
    if kind == "fragments":
        sentences = re.split(r"(?<=[.!?:])\s+", " ".join(words))
        return "\n".join(
            " ".join(sentence.split()[: rng.randint(2, 4)]) for sentence in sentences for _ in range(2)
        )
    if kind == "token_soup":
        return " ".join(
            rng.choice(content)
            if rng.random() < 0.5
            else (str(rng.randrange(10_000)) if rng.random() < 0.5 else rng.choice(_DEBRIS))
            for _ in range(len(words))
        )
    raise ValueError(f"unknown negative kind {kind!r}; expected one of {NEGATIVE_KINDS}")


def labelled_examples(
    positives: Sequence[Document], seed: int, holdout_fraction: float
) -> tuple[list[tuple[str, int, str]], list[tuple[str, int, str]]]:
    """(train, held_out) lists of (text, label 1 = good / 0 = junk, kind), one negative per positive.

    Args:
        positives: curated passages (positive_passages).
        seed: fixes the negatives and the split.
        holdout_fraction: expected share of positives (with their negatives) held out.
    """
    train, held_out = [], []
    for index, passage in enumerate(positives):
        rng = _rng(seed, passage.doc_id)
        side = held_out if rng.random() < holdout_fraction else train
        kind = NEGATIVE_KINDS[index % len(NEGATIVE_KINDS)]
        side.append((passage.text, 1, "curated"))
        side.append((negative_text(kind, passage.text, rng), 0, kind))
    return train, held_out
