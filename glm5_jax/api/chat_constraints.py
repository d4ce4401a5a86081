"""What a chat request asks of its output's form -> the engine's `Constraint` and the tool plan.

`response_format` {"type": "json_object"} / {"type": "json_schema", "json_schema": {"schema": ...}}
become Constraint(kind="json_object") / Constraint(kind="json_schema", spec=<the schema as JSON>).
`tool_choice` decides whether the tools are rendered into the prompt and parsed out of the output
("auto", the default with tools; "none": neither) and whether a call is forced ("required", or
{"type": "function", "function": {"name": ...}}): a forced call is a Constraint(kind="regex")
whose regex only admits the GLM-5 tool-call markup (tool_calls.py) of the allowed functions.
With thinking on (the prompt opens a `<think>` block) every constraint starts after `</think>`,
so the reasoning stays free.

The regex keeps to what grammar engines (xgrammar, llguidance, outlines-core) accept: literals,
classes, `(?:...)`, `?`, `*`, `+`, `{m,n}` and `|`, no look-arounds. Per function: its parameters
in the schema's order, each at most once, the `required` ones always; values typed by the schema
(integer and number with bounded digits, boolean, null, enum); strings within minLength /
maxLength when the schema gives them, and string and other values are text without `</` (so a
value can never swallow its closing tag). A function without declared properties takes any
arguments.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from glm5_jax.chat.reasoning import THINK_END
from glm5_jax.chat.tool_calls import CALL_END, CALL_START
from glm5_jax.engine.types import Constraint, InvalidRequestError, shown

_META = frozenset("\\.^$|?*+()[]{}")
# OpenAI's rule (letters, digits, "_", "-"; at most 64) plus "." and ":" (MCP-style names): no
# markup can hide in a name, so a name can never close its call and open another.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_TEXT_UNIT = "(?:[^<]|<[^/<])"  # a character, or "<" and the one after it: never "</"
TEXT = _TEXT_UNIT + "*"  # any text without "</" (nor a "<" just before the closing tag)
# Numbers as JSON writes them, bounded (an int64 has at most 19 digits, a double's exponent 3),
# so that a weak model cannot write digits for ever inside a forced call.
_TYPES = {
    "integer": "-?(?:0|[1-9][0-9]{0,18})",
    "number": "-?(?:0|[1-9][0-9]{0,18})(?:\\.[0-9]{1,17})?(?:[eE][+-]?[0-9]{1,3})?",
    "boolean": "(?:true|false)",
    "null": "null",
}


class InvalidFieldError(InvalidRequestError):
    """A bad request field; `param` names it (the API answers 400 with it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """tools: given to the chat template (None: no tools). parse: tool calls are parsed out of the
    output. max_calls: None, or 1 for `parallel_tool_calls: false`. forced: the functions the
    output must call (empty: the model chooses)."""

    tools: list[dict] | None = None
    parse: bool = False
    max_calls: int | None = None
    forced: tuple[str, ...] = ()


def plan_tools(tools: Sequence[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan:
    """The ToolPlan of a request; raises InvalidFieldError for a bad `tools` or `tool_choice`."""
    names = []
    for index, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not (isinstance(tool, Mapping) and tool.get("type", "function") == "function"
                and isinstance(function, Mapping) and isinstance(function.get("name"), str)):
            raise InvalidFieldError("tools", f"tools[{index}] must be {{'type': 'function', 'function': "
                                             "{'name': ..., 'parameters': {...}}}")
        if not _FUNCTION_NAME.fullmatch(function["name"]):
            raise InvalidFieldError("tools", f"tools[{index}].function.name must be 1 to 64 letters, digits, "
                                             f"'_', '-', '.' or ':', got {shown(function['name'])}")
        names.append(function["name"])
    choice = tool_choice if tool_choice is not None else ("auto" if names else "none")
    if isinstance(choice, Mapping):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidFieldError("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                                   "{'type': 'function', 'function': {'name': ...}}")
        if name not in names:
            raise InvalidFieldError("tool_choice", f"tool_choice names the function {shown(name)}, which is "
                                                   f"not in tools ({', '.join(names) or 'none given'})")
        forced = (name,)
    elif choice in ("none", "auto", "required"):
        if choice == "required" and not names:
            raise InvalidFieldError("tool_choice", "tool_choice 'required' needs tools")
        forced = tuple(names) if choice == "required" else ()
    else:
        raise InvalidFieldError("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a "
                                               f"function, got {shown(choice)}")
    if choice == "none" or not names:
        return ToolPlan()
    max_calls = 1 if parallel_tool_calls is False or isinstance(choice, Mapping) else None
    return ToolPlan([dict(tool) for tool in tools], True, max_calls, forced)


def _literal(text: str) -> str:
    return "".join("\\" + c if c in _META else c for c in text)


def value_regex(schema: Any) -> str:
    """The regex of one argument value as the GLM-5 template writes it (strings raw, else JSON)."""
    if not isinstance(schema, Mapping):
        return TEXT
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        values = (v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for v in schema["enum"])
        return "(?:" + "|".join(_literal(v) for v in values) + ")"
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or ())
    if kinds == ["string"]:
        return _string_regex(schema.get("minLength"), schema.get("maxLength"))
    if not kinds or any(kind not in _TYPES for kind in kinds):
        return TEXT
    return "(?:" + "|".join(_TYPES[kind] for kind in kinds) + ")"


def _string_regex(min_length: Any, max_length: Any) -> str:
    """A raw string value within the schema's minLength / maxLength (a "<" and the character
    after it count as one); any length when the schema gives no maximum."""
    least = min_length if isinstance(min_length, int) and not isinstance(min_length, bool) else 0
    most = max_length if isinstance(max_length, int) and not isinstance(max_length, bool) else None
    if most is None:
        return TEXT if least <= 0 else f"{_TEXT_UNIT}{{{least},}}"
    if most < max(least, 0):
        raise InvalidFieldError("tools", f"a string parameter has maxLength {most} < minLength {least}")
    return f"{_TEXT_UNIT}{{{max(least, 0)},{most}}}"


def call_regex(name: str, parameters: Any) -> str:
    """The regex of one call of function `name` whose parameters have the JSON schema `parameters`."""
    properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
    if not isinstance(properties, Mapping) or not properties:
        arguments = f"(?:<arg_key>[^<]+</arg_key><arg_value>{TEXT}</arg_value>)*"
    else:
        required = set(parameters.get("required") or ())
        pairs = []
        for key, schema in properties.items():
            pair = f"<arg_key>{_literal(key)}</arg_key><arg_value>{value_regex(schema)}</arg_value>"
            pairs.append(pair if key in required else f"(?:{pair})?")
        arguments = "".join(pairs)
    return f"{CALL_START}{_literal(name)}{arguments}{CALL_END}"


def tool_call_regex(tools: Sequence[Mapping[str, Any]], names: Sequence[str], parallel: bool) -> str:
    """The regex of the output of a forced call: one call of one of `names` (several calls in a
    row when `parallel`), nothing else."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in tools}
    one = "(?:" + "|".join(call_regex(name, schemas[name]) for name in names) + ")"
    return one + "+" if parallel else one


def response_format_constraint(response_format: Mapping[str, Any] | None,
                               after: str | None) -> Constraint | None:
    """The Constraint of an OpenAI `response_format` (None for text); InvalidFieldError when unusable."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", after=after)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise InvalidFieldError("response_format", "response_format: json_schema.schema must be a JSON "
                                                       "schema object")
        return Constraint("json_schema", json.dumps(schema, ensure_ascii=False), after)
    raise InvalidFieldError("response_format", "response_format: type must be 'text', 'json_object' or "
                                               f"'json_schema', got {shown(kind)}")


def output_constraint(plan: ToolPlan, response_format: Mapping[str, Any] | None,
                      thinking: bool) -> Constraint | None:
    """The request's one Constraint (a forced tool call or a response format), starting after the
    thinking block when `thinking`."""
    after = THINK_END if thinking else None
    formatted = response_format_constraint(response_format, after)
    if not plan.forced:
        return formatted
    if formatted is not None:
        raise InvalidFieldError("response_format", "response_format cannot be combined with a forced tool "
                                                   "call (tool_choice 'required' or a named function)")
    regex = tool_call_regex(plan.tools, plan.forced, parallel=plan.max_calls is None)
    return Constraint("regex", regex, after)
