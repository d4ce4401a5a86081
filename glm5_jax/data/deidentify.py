"""Best-effort de-identification of text: e-mail addresses, phone numbers, IP addresses, API keys and
long secret-looking tokens are replaced by placeholders, and each replacement is counted by kind.

    deidentifier = Deidentifier()
    deidentifier.text("mail bob@example.com")           # -> "mail <EMAIL>"
    deidentifier.value({"role": "user", "content": ...})  # every string in a JSON value
    deidentifier.counts                                  # {"email": 1, ...}

Kinds, in the order they are applied (an earlier kind's placeholder is never matched by a later one):

    email         name@domain.tld                                          -> <EMAIL>
    api_key       sk-/pk-/rk-..., GitHub (ghp_..., github_pat_...), AWS (AKIA...), Slack (xox?-...),
                  Google (AIza...), JWTs (eyJ...x.y), the token after "Bearer "  -> <API_KEY>
    secret_token  32+ characters of [A-Za-z0-9+/_=-] that are hex (letters and digits) or look
                  random (the character class changes at >= 45% of positions, as in base64;
                  identifiers and paths change far less often)                -> <TOKEN>
    ipv6          checked by the ipaddress module, with at least one digit    -> <IP_ADDRESS>
    ipv4          dotted quads, each part 0-255                               -> <IP_ADDRESS>
    phone         +CC international numbers (8-15 digits), (555) 123-4567, 555-123-4567 / 555.123.4567
                  / 555 123 4567                                               -> <PHONE>

This is regex work: it misses what it has no pattern for (names, street addresses, local phone
formats such as "020 7946 0958", secrets shorter than 32 characters without a known prefix) and
replaces some harmless strings (commit hashes, version strings shaped like IPv4 addresses).
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter
from typing import Any

KINDS = ("email", "api_key", "secret_token", "ipv6", "ipv4", "phone")
PLACEHOLDERS = {"email": "<EMAIL>", "api_key": "<API_KEY>", "secret_token": "<TOKEN>", "ipv6": "<IP_ADDRESS>",
                "ipv4": "<IP_ADDRESS>", "phone": "<PHONE>"}
# Keys whose values are structure, not text: roles, content-part types, tool-call ids (which must
# keep matching the tool results that quote them).
STRUCTURAL_KEYS = frozenset({"role", "type", "id", "tool_call_id"})
MIN_TOKEN_LENGTH = 32
RANDOM_CLASS_CHANGES = 0.45  # random base64 ~0.65, CamelCase identifiers ~0.4, paths and words far less

_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_PATTERNS = {
    "email": re.compile(r"(?<![\w.+%-])[A-Za-z0-9._%+-]+@(?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,}\b"),
    "api_key": re.compile(
        r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{16,}"
        r"|\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{30,}|\bgithub_pat_[A-Za-z0-9_]{20,}"
        r"|\bAKIA[0-9A-Z]{16}\b|\bxox[abprs]-[A-Za-z0-9-]{10,}|\bAIza[0-9A-Za-z_-]{35}"
        r"|\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"
        r"|(?<=[Bb]earer )[A-Za-z0-9._~+/-]{16,}=*"),
    "secret_token": re.compile(rf"(?<![A-Za-z0-9+/_=-])[A-Za-z0-9+/_-]{{{MIN_TOKEN_LENGTH},}}={{0,2}}"
                               r"(?![A-Za-z0-9+/_=-])"),
    "ipv6": re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{1,4}|:)(?::[0-9A-Fa-f]{0,4}){2,7}(?![\w:])"),
    "ipv4": re.compile(rf"(?<![\d.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\d|\.\d)"),
    "phone": re.compile(r"(?<![\w+])\+\d[\d ().-]{6,}\d(?!\w)"
                        r"|(?<![\w(])\(\d{2,4}\)[ .-]?\d{3,4}[ .-]?\d{3,4}(?!\w)"
                        r"|(?<![\w.-])\d{3}([ .-])\d{3}\1\d{4}(?!\w|[.-]\d)"),
}


def _character_class(char: str) -> int:
    return 0 if char.islower() else 1 if char.isupper() else 2 if char.isdigit() else 3


def looks_random(token: str) -> bool:
    """Whether a long [A-Za-z0-9+/_=-] string is a secret rather than a word, identifier or path:
    hex with letters and digits, or a character class (lower, upper, digit, other) that changes at
    RANDOM_CLASS_CHANGES of its positions or more."""
    body = token.rstrip("=")
    if re.fullmatch(r"[0-9a-fA-F]+", body):
        return any(c.isdigit() for c in body) and any(c.isalpha() for c in body)
    classes = [_character_class(c) for c in body]
    changes = sum(a != b for a, b in zip(classes, classes[1:], strict=False))
    return changes >= RANDOM_CLASS_CHANGES * (len(body) - 1)


def _accepts(kind: str, found: str) -> bool:
    """The checks a regex cannot make."""
    if kind == "secret_token":
        return looks_random(found)
    if kind == "ipv6":
        try:
            ipaddress.IPv6Address(found)
        except ValueError:
            return False
        return any(c.isdigit() for c in found)  # "Abc::Def" is C++ more often than an address
    if kind == "phone":
        return 8 <= sum(c.isdigit() for c in found) <= 15
    return True


class Deidentifier:
    """Replaces what KINDS describe with placeholders; `counts` adds up the replacements by kind."""

    def __init__(self):
        self.counts: Counter[str] = Counter({kind: 0 for kind in KINDS})

    def text(self, text: str) -> str:
        for kind in KINDS:
            def replace(match: re.Match, kind=kind) -> str:
                if not _accepts(kind, match.group(0)):
                    return match.group(0)
                self.counts[kind] += 1
                return PLACEHOLDERS[kind]

            text = _PATTERNS[kind].sub(replace, text)
        return text

    def value(self, value: Any) -> Any:
        """A JSON value with every string de-identified, except under STRUCTURAL_KEYS (and keys)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.value(item) for item in value]
        if isinstance(value, dict):
            return {key: item if key in STRUCTURAL_KEYS else self.value(item) for key, item in value.items()}
        return value
