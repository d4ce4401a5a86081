"""Level 1, first stage: Unicode and whitespace normalisation, applied to every document.

- Unicode NFC, so one visible string has one encoding (and one content hash);
- line endings to "\\n", a leading byte-order mark removed;
- exotic spaces (no-break, en/em, ideographic, ...) to " "; zero-width spaces removed;
- control characters other than tab and newline removed;
- trailing whitespace of every line, and blank lines at the start and end of the document, removed.
Indentation and runs of blank lines stay: they are the per-domain cleaning's business (level 3).
"""

from __future__ import annotations

import re
import unicodedata

_SPACES = re.compile("[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
_REMOVED = re.compile("[\u0000-\u0008\u000b\u000c\u000e-\u001f\u007f\u200b\ufeff]")
_LINE_ENDINGS = re.compile("\r\n?")


def normalise_text(text: str) -> str:
    """The document's text, normalised as the module docstring says ("" when nothing is left)."""
    text = unicodedata.normalize("NFC", text)
    text = _LINE_ENDINGS.sub("\n", text)
    text = _REMOVED.sub("", _SPACES.sub(" ", text))
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    return "\n".join(lines)
