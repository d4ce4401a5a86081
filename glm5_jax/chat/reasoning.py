"""The thinking block of GLM-5 output (`<think>...</think>`), split off as `reasoning_content`.

GLM-5 writes its reasoning between `<think>` and `</think>`, then the answer. Its chat template
usually opens the block itself (the generation prompt ends `<|assistant|><think>`; with
`enable_thinking: false` it ends `<|assistant|></think>` instead), so the output starts inside the
block and only the closing tag is generated: `starts_in_reasoning(prompt)` tells which case a
prompt is. The parser follows vLLM's `glm45` reasoning parser: reasoning up to `</think>`, content
after it; output that never closes the block (cut by max_tokens) is all reasoning. It works on the
text stream: a tag cut across tokens ("</th" + "ink>") is held back until it is complete or cannot
be one any more.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("glm45", "none")  # serve.py --reasoning-parser; "none" leaves the text as it is


def starts_in_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt leaves a thinking block open, so the output starts inside it."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag` (a tag possibly cut)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    """Splits streamed output text into (reasoning, content) deltas.

    in_reasoning: the prompt opened the thinking block (`starts_in_reasoning`). Otherwise the
    output is content unless it starts (after whitespace) with `<think>`. A `<think>` that starts
    the output is dropped in both cases (a model may repeat the one its prompt ends with).
    """

    def __init__(self, in_reasoning: bool):
        self._state = "start"  # start -> reasoning -> content, or start -> content
        self._after_start = "reasoning" if in_reasoning else "content"
        self._held = ""  # text not yet given out: a possible tag, or the output's leading whitespace

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) text that `text` completes."""
        reasoning, content = [], []
        text, self._held = self._held + text, ""
        while text:
            if self._state == "start":
                stripped = text.lstrip()
                if stripped.startswith(THINK_START):
                    text, self._state = stripped[len(THINK_START):], "reasoning"
                elif THINK_START.startswith(stripped):  # "", "<", "<thi", ...: wait for more
                    self._held = text
                    break
                else:
                    self._state = self._after_start
            elif self._state == "reasoning":
                end = text.find(THINK_END)
                if end >= 0:
                    reasoning.append(text[:end])
                    text, self._state = text[end + len(THINK_END):], "content"
                else:
                    keep = partial_tag(text, THINK_END)
                    reasoning.append(text[:len(text) - keep])
                    self._held = text[len(text) - keep:]
                    break
            else:
                content.append(text)
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held at the end of the output: a tag that never completed is text."""
        held, self._held = self._held, ""
        if self._state == "start":
            self._state = self._after_start
        return (held, "") if self._state == "reasoning" else ("", held)
