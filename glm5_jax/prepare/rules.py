"""Level 1 rules for text (prose, docs, other): Gopher's quality and repetition filters (Rae et al.
2021, "Scaling Language Models", appendix A) and C4's page filters (Raffel et al. 2020).

Each rule is a named check that returns True when the document fails; `failed_rule` returns the
first failing rule in RULES order (the name counted in stats.json), or None. A rule applies only to
the domains listed with it: docs (reST, Markdown) carry code samples, symbols and repeated table
borders that prose rules would wrongly punish. A threshold of None in the config turns a rule off.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple

from glm5_jax.prepare.code_rules import CODE_RULES
from glm5_jax.prepare.config import CodeRuleSettings, TextRuleSettings

STOP_WORDS = frozenset(("the", "be", "to", "of", "and", "that", "have", "with"))  # Gopher's list
_BULLETS = ("•", "-", "*", "‣", "●", "◦", "–", "·")
_ELLIPSES = ("...", "…")
_JAVASCRIPT = re.compile(
    r"\b(enable|turn on|requires?|needs?|activate)\b.{0,40}\bjavascript\b|"
    r"\bjavascript\b.{0,40}\b(enabled|disabled|required)\b",
    re.IGNORECASE,
)
_PUNCTUATION = re.compile(r"^\W+|\W+$")


class TextView(NamedTuple):
    """The pieces of a document the rules look at, computed once."""

    text: str
    words: list[str]  # whitespace-separated
    lines: list[str]  # non-blank lines, stripped
    paragraphs: list[str]  # blank-line separated, stripped


def text_view(text: str) -> TextView:
    return TextView(
        text,
        text.split(),
        [line.strip() for line in text.split("\n") if line.strip()],
        [part.strip() for part in re.split(r"\n\s*\n", text) if part.strip()],
    )


def _duplicates(items: Sequence[str]) -> tuple[int, int]:
    """(items that repeat an earlier item, their characters)."""
    seen, count, chars = set(), 0, 0
    for item in items:
        if item in seen:
            count, chars = count + 1, chars + len(item)
        seen.add(item)
    return count, chars


def _top_ngram_char_fraction(words: Sequence[str], n: int) -> float:
    """Characters of the most frequent word n-gram, times its count, over all word characters."""
    grams = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    if not grams:
        return 0.0
    gram, count = grams.most_common(1)[0]
    return 0.0 if count < 2 else sum(map(len, gram)) * count / max(1, sum(map(len, words)))


def _duplicate_ngram_char_fraction(words: Sequence[str], n: int) -> float:
    """Characters of words inside word n-grams that occur more than once, over all word characters."""
    seen: set[tuple[str, ...]] = set()
    covered = [False] * len(words)
    for i in range(len(words) - n + 1):
        gram = tuple(words[i : i + n])
        if gram in seen:
            covered[i : i + n] = [True] * n
        seen.add(gram)
    return sum(len(w) for w, c in zip(words, covered, strict=True) if c) / max(1, sum(map(len, words)))


def _word_count(view: TextView, s: TextRuleSettings) -> bool:
    return (s.min_words is not None and len(view.words) < s.min_words) or (
        s.max_words is not None and len(view.words) > s.max_words
    )


def _mean_word_length(view: TextView, s: TextRuleSettings) -> bool:
    stripped = [_PUNCTUATION.sub("", word) for word in view.words]
    stripped = [word for word in stripped if word]
    mean = sum(map(len, stripped)) / max(1, len(stripped))
    return (s.min_mean_word_length is not None and mean < s.min_mean_word_length) or (
        s.max_mean_word_length is not None and mean > s.max_mean_word_length
    )


def _symbol_ratio(view: TextView, s: TextRuleSettings) -> bool:
    if s.max_symbol_word_ratio is None:
        return False
    symbols = view.text.count("#") + sum(view.text.count(e) for e in _ELLIPSES)
    return symbols / max(1, len(view.words)) > s.max_symbol_word_ratio


def _bullet_lines(view: TextView, s: TextRuleSettings) -> bool:
    if s.max_bullet_line_fraction is None or not view.lines:
        return False
    bullets = sum(line.startswith(_BULLETS) for line in view.lines)
    return bullets / len(view.lines) > s.max_bullet_line_fraction


def _ellipsis_lines(view: TextView, s: TextRuleSettings) -> bool:
    if s.max_ellipsis_line_fraction is None or not view.lines:
        return False
    return (
        sum(line.endswith(_ELLIPSES) for line in view.lines) / len(view.lines) > s.max_ellipsis_line_fraction
    )


def _alpha_words(view: TextView, s: TextRuleSettings) -> bool:
    if s.min_alpha_word_fraction is None or not view.words:
        return False
    alpha = sum(any(c.isalpha() for c in word) for word in view.words)
    return alpha / len(view.words) < s.min_alpha_word_fraction


def _stop_words(view: TextView, s: TextRuleSettings) -> bool:
    if s.min_stop_words is None:
        return False
    found = sum(_PUNCTUATION.sub("", word.lower()) in STOP_WORDS for word in view.words)
    return found < s.min_stop_words


def _line_repetition(view: TextView, s: TextRuleSettings) -> bool:
    lines, chars = _duplicates(view.lines)
    paragraphs, paragraph_chars = _duplicates(view.paragraphs)
    total = max(1, len(view.text))
    limits = (
        (s.max_duplicate_line_fraction, lines / max(1, len(view.lines))),
        (s.max_duplicate_paragraph_fraction, paragraphs / max(1, len(view.paragraphs))),
        (s.max_duplicate_line_char_fraction, chars / total),
        (s.max_duplicate_paragraph_char_fraction, paragraph_chars / total),
    )
    return any(limit is not None and value > limit for limit, value in limits)


def _ngram_repetition(view: TextView, s: TextRuleSettings) -> bool:
    words = [word.lower() for word in view.words]
    for n, limit in zip(range(2, 5), s.max_top_ngram_char_fraction or (), strict=False):
        if _top_ngram_char_fraction(words, n) > limit:
            return True
    for n, limit in zip(range(5, 11), s.max_duplicate_ngram_char_fraction or (), strict=False):
        if _duplicate_ngram_char_fraction(words, n) > limit:
            return True
    return False


def _lorem_ipsum(view: TextView, s: TextRuleSettings) -> bool:
    return s.lorem_ipsum and "lorem ipsum" in view.text.lower()


def _curly_braces(view: TextView, s: TextRuleSettings) -> bool:
    return s.curly_braces and "{" in view.text


def _javascript_notice(view: TextView, s: TextRuleSettings) -> bool:
    return s.javascript_notice and bool(_JAVASCRIPT.search(view.text))


class Rule(NamedTuple):
    name: str
    domains: tuple[str, ...]
    fails: Callable[[TextView, TextRuleSettings], bool]


_TEXT = ("prose", "docs", "other")
_WEB = ("prose", "other")
RULES = (
    Rule("gopher_word_count", _TEXT, _word_count),
    Rule("gopher_mean_word_length", _WEB, _mean_word_length),
    Rule("gopher_symbol_ratio", _WEB, _symbol_ratio),
    Rule("gopher_bullet_lines", _WEB, _bullet_lines),
    Rule("gopher_ellipsis_lines", _TEXT, _ellipsis_lines),
    Rule("gopher_alpha_words", _WEB, _alpha_words),
    Rule("gopher_stop_words", ("prose",), _stop_words),
    Rule("gopher_line_repetition", _WEB, _line_repetition),
    Rule("gopher_ngram_repetition", _WEB, _ngram_repetition),
    Rule("c4_lorem_ipsum", _TEXT, _lorem_ipsum),
    Rule("c4_curly_braces", ("prose",), _curly_braces),
    Rule("c4_javascript_notice", ("prose",), _javascript_notice),
)
RULE_NAMES = tuple(rule.name for rule in RULES) + tuple(name for name, _ in CODE_RULES)


def failed_rule(
    text: str, domain: str, text_settings: TextRuleSettings, code_settings: CodeRuleSettings
) -> str | None:
    """The first rule the document fails (its name), or None when it passes every rule of its domain.

    Args:
        text: the normalised text.
        domain: its domain ("code" runs the code rules, others the text rules listed for them).
        text_settings, code_settings: the thresholds.
    """
    if domain == "code":
        return next((name for name, fails in CODE_RULES if fails(text, code_settings)), None)
    view = text_view(text)
    return next(
        (rule.name for rule in RULES if domain in rule.domains and rule.fails(view, text_settings)), None
    )
