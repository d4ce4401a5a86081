"""One chat choice's output text -> OpenAI chat deltas and the final message.

The text (after stop strings, from textstream.py) goes through the reasoning parser
(reasoning.py: `reasoning_content`, also sent as `reasoning` as newer vLLM does) and then the
tool-call parser (tool_calls.py: `tool_calls`); what is left is `content`. Streaming and
non-streaming answers come from the same deltas, so they always agree. With tool calls parsed,
trailing whitespace of the content is held until more text follows, and dropped when a call
follows it or the output ends with calls (the "\\n" a model may write around its calls is not
content).
"""

from __future__ import annotations

from glm5_jax.chat.reasoning import ReasoningParser
from glm5_jax.chat.tool_calls import ToolCall, ToolCallParser


class ChatOutput:
    """reasoning: None leaves thinking markup in the content (serve.py --reasoning-parser none).
    tools: None when the request's tools are not parsed (no tools, or tool_choice "none")."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None):
        self._reasoning, self._tools = reasoning, tools
        self._blank = ""  # held whitespace-only content

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self._tools.calls if self._tools is not None else []

    def feed(self, text: str) -> list[dict]:
        """The deltas (one per chunk) that `text` completes; [] while everything is held."""
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        return self._deltas(reasoning, self._tools.feed(content) if self._tools else [content])

    def finish(self) -> list[dict]:
        """The deltas still held at the end of the output."""
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        items = self._tools.feed(content) + self._tools.finish() if self._tools else [content]
        deltas = self._deltas(reasoning, items)
        if self._blank and not self.tool_calls:
            deltas.append({"content": self._blank})
        self._blank = ""
        return deltas

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.tool_calls else reason

    def _deltas(self, reasoning: str, items: list[str | ToolCall]) -> list[dict]:
        deltas, text = [], {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}
        content = ""
        for item in items:
            if isinstance(item, str):
                body = item.rstrip() if self._tools is not None else item
                if body:  # trailing whitespace waits: a call may come next
                    content, self._blank = content + self._blank + body, item[len(body):]
                else:
                    self._blank += item
                continue
            self._blank = ""
            if content or text:
                deltas.append({**text, **({"content": content} if content else {})})
                text, content = {}, ""
            index = self.tool_calls.index(item)
            deltas.append({"tool_calls": [{"index": index, "id": item.id, "type": "function",
                                           "function": {"name": item.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": item.arguments}}]})
        if content or text:
            deltas.append({**text, **({"content": content} if content else {})})
        return deltas


def message(deltas: list[dict], tool_calls: list[ToolCall]) -> dict:
    """The non-streaming `message` the deltas of a whole output add up to."""
    reasoning = "".join(delta.get("reasoning_content", "") for delta in deltas) or None
    content = "".join(delta.get("content", "") for delta in deltas)
    result = {"role": "assistant", "content": content or (None if reasoning or tool_calls else ""),
              "reasoning_content": reasoning, "reasoning": reasoning}
    if tool_calls:
        result["tool_calls"] = [call.as_openai() for call in tool_calls]
    return result
