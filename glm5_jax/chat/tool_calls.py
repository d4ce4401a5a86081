"""GLM-4.7 / GLM-5 tool-call markup in model output -> OpenAI `tool_calls`.

The GLM-5 chat template teaches the model this format (no whitespace between the parts):

    <tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key>
    <arg_value>3</arg_value></tool_call>

String arguments are written raw, all others as JSON (the template's `tojson`), so an argument
is parsed back as JSON unless the tool's JSON schema declares it a string (as vLLM's `glm47`
parser does): "3" becomes 3 for an integer, "true" true for a boolean, "[1, 2]" a list. Markup
that does not parse (an unclosed call, text between the argument tags, no function name or one
the request did not declare) is left in the content as the model wrote it, never an error. Calls
are parsed from the streamed text: each is held back until its `</tool_call>` and then given out
whole, so a call that turns out malformed was never half sent.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from glm5_jax.chat.reasoning import partial_tag

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
_ARGUMENT = re.compile(r"<arg_key>([^<]*)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)
_NAME = re.compile(r"\s*([^<\s]+)\s*")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


def function_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    """{function name: its parameters' JSON schema} of a request's `tools`."""
    schemas = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            schemas[function["name"]] = parameters if isinstance(parameters, Mapping) else {}
    return schemas


def _is_string(schema: Any) -> bool:
    """Whether the JSON schema of an argument says its value is a string (so it is written raw)."""
    if not isinstance(schema, Mapping):
        return False
    kind = schema.get("type")
    if kind is None and isinstance(schema.get("enum"), list) and schema["enum"]:
        return all(isinstance(value, str) for value in schema["enum"])
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def typed_value(text: str, schema: Any) -> Any:
    """An argument's value: the raw text for a string, else its JSON value (the raw text if none)."""
    if _is_string(schema):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_call(body: str, schemas: Mapping[str, Mapping[str, Any]]) -> ToolCall | None:
    """The call whose markup between `<tool_call>` and `</tool_call>` is `body`, or None if malformed."""
    name = _NAME.match(body)
    if name is None or name.group(1) not in schemas:  # never a call to a function not declared
        return None
    properties = schemas.get(name.group(1), {}).get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    arguments, position = {}, name.end()
    for match in _ARGUMENT.finditer(body, position):
        if match.start() != position:
            return None
        key = match.group(1).strip()
        arguments[key] = typed_value(match.group(2), properties.get(key))
        position = match.end()
    if position != len(body):
        return None
    return ToolCall(name.group(1), json.dumps(arguments, ensure_ascii=False))


class ToolCallParser:
    """Splits streamed content text into plain text and tool calls.

    tools: the request's `tools` (their schemas type the arguments). max_calls: None for any
    number; 1 when the request set `parallel_tool_calls: false` (later calls are dropped).
    forced: tool_choice forced a call, so the output is only calls.
    `feed` and `finish` return a list of items, each a str (content) or a ToolCall, in order.
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None, max_calls: int | None = None,
                 forced: bool = False):
        self._schemas = function_schemas(tools)
        self._max_calls = max_calls
        self._forced = forced  # the output is nothing but calls: an unclosed one is dropped
        self.calls: list[ToolCall] = []
        self._inside = False
        self._held = ""

    def feed(self, text: str) -> list[str | ToolCall]:
        items: list[str | ToolCall] = []
        text, self._held = self._held + text, ""
        while text:
            if not self._inside:
                start = text.find(CALL_START)
                if start < 0:
                    keep = partial_tag(text, CALL_START)
                    items.append(text[:len(text) - keep])
                    self._held = text[len(text) - keep:]
                    break
                items.append(text[:start])
                text, self._inside = text[start + len(CALL_START):], True
            else:
                end = text.find(CALL_END)
                if end < 0:
                    self._held = text
                    break
                items.extend(self._call(text[:end]))
                text, self._inside = text[end + len(CALL_END):], False
        return [item for item in items if item != ""]

    def _call(self, body: str) -> list[str | ToolCall]:
        call = parse_call(body, self._schemas)
        if call is None:  # malformed: the markup stays in the content as written
            return [CALL_START + body + CALL_END]
        if self._max_calls is not None and len(self.calls) >= self._max_calls:
            return []
        self.calls.append(call)
        return [call]

    def finish(self) -> list[str | ToolCall]:
        """The held tail: an unclosed call is content as written, or nothing when calls were
        forced (the output was cut off mid-call: its finish_reason says "length")."""
        held, self._held = self._held, ""
        if self._inside:
            self._inside, held = False, "" if self._forced else CALL_START + held
        return [held] if held else []
