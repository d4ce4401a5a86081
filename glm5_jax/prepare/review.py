"""`--review N`: N kept and N dropped documents per stage, written to review.md for a person to check.

The sample is fixed by the seed and the document ids (the N smallest hashes of (seed, stage, id)),
so it does not depend on the executor or the worker count, and a rerun shows the same documents.
Each entry gives the id, source, domain, the reason (or the score) and the start of the text.
"""

from __future__ import annotations

import hashlib
import heapq
import os
from pathlib import Path

from glm5_jax.prepare.stats import STAGES

_MAX_CHARS = 1500  # of each shown text


class ReviewSampler:
    """Keeps the N lowest-hash kept and dropped documents of each stage."""

    def __init__(self, count: int, seed: int):
        self.count = count
        self.seed = seed
        self._heaps: dict[tuple[str, bool], list] = {}

    def offer(self, stage: str, kept: bool, doc_id: str, text: str, note: str) -> None:
        """One document's outcome at a stage; `note` is shown with it (reason, domain, score)."""
        if self.count <= 0:
            return
        key = hashlib.sha256(f"{self.seed}\x00{stage}\x00{doc_id}".encode()).digest()[:8]
        heap = self._heaps.setdefault((stage, kept), [])
        item = (-int.from_bytes(key, "big"), doc_id, text[: _MAX_CHARS + 1], note)  # max-heap on the hash
        if len(heap) < self.count:
            heapq.heappush(heap, item)
        elif item > heap[0]:
            heapq.heapreplace(heap, item)

    def write(self, output: str | os.PathLike) -> Path:
        lines = [
            "# Prepare review sample",
            "",
            f"{self.count} kept and {self.count} dropped documents per stage (seed {self.seed}). "
            "Check that each dropped one deserved it and each kept one is worth training on.",
            "",
        ]
        for stage in STAGES:
            lines += [f"## {stage}", ""]
            for kept in (False, True):
                chosen = sorted(self._heaps.get((stage, kept), []), key=lambda item: item[1])
                lines += [f"### {'kept' if kept else 'dropped'} ({len(chosen)})", ""]
                for _, doc_id, text, note in chosen:
                    fence = "`" * max(3, _longest_backtick_run(text) + 1)  # longer than any run inside
                    shown = text[:_MAX_CHARS] + ("\n[... cut]" if len(text) > _MAX_CHARS else "")
                    lines += [f"- `{doc_id}`: {note}", "", fence, shown, fence, ""]
        path = Path(output) / "review.md"
        path.write_text("\n".join(lines), encoding="utf-8")
        return path


def _longest_backtick_run(text: str) -> int:
    longest = run = 0
    for character in text:
        run = run + 1 if character == "`" else 0
        longest = max(longest, run)
    return longest
