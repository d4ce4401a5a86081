"""The chat output parsers on their own (pure Python, no server): the thinking block
(reasoning.py), GLM-5 tool-call markup (tool_calls.py), both together as OpenAI deltas
(chat_output.py), and the forced-tool-call regex and response_format constraints
(chat_constraints.py)."""

from __future__ import annotations

import json
import re

import pytest

from glm5_jax.api.chat_constraints import (
    TEXT,
    InvalidFieldError,
    call_regex,
    output_constraint,
    plan_tools,
    response_format_constraint,
    tool_call_regex,
    value_regex,
)
from glm5_jax.api.chat_output import ChatOutput, message
from glm5_jax.chat.reasoning import ReasoningParser, starts_in_reasoning
from glm5_jax.chat.template import render_glm5
from glm5_jax.chat.tool_calls import ToolCall, ToolCallParser, function_schemas, parse_call
from glm5_jax.engine.types import Constraint

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "hours": {"type": "array"},
                                     "unit": {"enum": ["C", "F"]}},
    "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "clock"}}
TOOLS = [WEATHER, CLOCK]
CALL = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo 42</arg_value><arg_key>days</arg_key>"
        "<arg_value>3</arg_value><arg_key>metric</arg_key><arg_value>true</arg_value><arg_key>hours"
        "</arg_key><arg_value>[1, 2]</arg_value></tool_call>")
CALL_ARGUMENTS = {"city": "Oslo 42", "days": 3, "metric": True, "hours": [1, 2]}


def splits(text: str):
    """The text cut into pieces in many ways: one character at a time, and in two at every position."""
    yield list(text)
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]


def run_reasoning(pieces, in_reasoning):
    parser = ReasoningParser(in_reasoning)
    parts = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize("text,in_reasoning,expected", [
    ("I should add.</think>The sum is 4.", True, ("I should add.", "The sum is 4.")),
    ("<think>I should add.</think>The sum is 4.", True, ("I should add.", "The sum is 4.")),
    ("\n<think>hmm</think>4", False, ("hmm", "4")),
    ("</think>4", True, ("", "4")),
    ("The sum is 4.", False, ("", "The sum is 4.")),
    ("cut by max_tokens </thi", True, ("cut by max_tokens </thi", "")),  # never closed: all reasoning
    ("a <think> in the answer", False, ("", "a <think> in the answer")),
    ("x</think>y</think>z", True, ("x", "y</think>z")),
    ("<thi", False, ("", "<thi")),
    ("", True, ("", "")),
])
def test_reasoning_split_whatever_the_pieces(text, in_reasoning, expected):
    for pieces in splits(text):
        assert run_reasoning(pieces, in_reasoning) == expected, pieces


def test_thinking_state_from_the_prompt():
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>a</think>b"},
                    {"role": "user", "content": "again"}]
    assert starts_in_reasoning(render_glm5(conversation))  # ends "<|assistant|><think>"
    assert not starts_in_reasoning(render_glm5(conversation, enable_thinking=False))  # "</think>"
    assert not starts_in_reasoning("plain completion prompt")


@pytest.mark.parametrize("body,expected", [
    ("get_weather<arg_key>city</arg_key><arg_value>Oslo 42</arg_value><arg_key>days</arg_key>"
     "<arg_value>3</arg_value><arg_key>metric</arg_key><arg_value>true</arg_value><arg_key>hours</arg_key>"
     "<arg_value>[1, 2]</arg_value>", ("get_weather", CALL_ARGUMENTS)),
    ("clock", ("clock", {})),
    # GLM-4.5 wrote newlines between the parts; undeclared arguments are read as JSON when they parse.
    ("\nclock\n<arg_key>tz</arg_key>\n<arg_value>UTC</arg_value>\n<arg_key>n</arg_key><arg_value>7"
     "</arg_value>\n", ("clock", {"tz": "UTC", "n": 7})),
    ("get_weather<arg_key>city</arg_key><arg_value>42</arg_value><arg_key>unit</arg_key>"
     "<arg_value>C</arg_value><arg_key>days</arg_key><arg_value>soon</arg_value>",
     ("get_weather", {"city": "42", "unit": "C", "days": "soon"})),  # schema strings stay strings
    ("get_weather<arg_key>city</arg_key><arg_value>a < b</arg_value>", ("get_weather", {"city": "a < b"})),
    ("", None),  # no name
    ("<arg_key>city</arg_key><arg_value>x</arg_value>", None),
    ("get_weather<arg_key>city</arg_key>stray<arg_value>x</arg_value>", None),
    ("get_weather<arg_key>city</arg_key><arg_value>x</arg_value>trailing", None),
    ("get weather", None),
    ("x<arg_key>a</arg_key><arg_value>1</arg_value>", None),  # a function the request did not declare
])
def test_parse_call(body, expected):
    schemas = {"get_weather": WEATHER["function"]["parameters"], "clock": {}}
    call = parse_call(body, schemas)
    assert (call if call is None else (call.name, json.loads(call.arguments))) == expected


def run_tools(pieces, tools=TOOLS, max_calls=None):
    parser = ToolCallParser(tools, max_calls)
    items = [item for piece in pieces for item in parser.feed(piece)] + parser.finish()
    text = "".join(item for item in items if isinstance(item, str))
    return text, [(c.name, json.loads(c.arguments)) for c in items if isinstance(c, ToolCall)], parser


@pytest.mark.parametrize("text,content,calls", [
    ("Let me check. " + CALL, "Let me check. ", [("get_weather", CALL_ARGUMENTS)]),
    (CALL + "<tool_call>clock</tool_call>", "", [("get_weather", CALL_ARGUMENTS), ("clock", {})]),
    ("no calls < here", "no calls < here", []),
    # Malformed markup stays content as written, and a good call after it still counts.
    ("<tool_call>clock<arg_key>x</arg_key></tool_call><tool_call>clock</tool_call>",
     "<tool_call>clock<arg_key>x</arg_key></tool_call>", [("clock", {})]),
    ("<tool_call>clock<arg_key>tz", "<tool_call>clock<arg_key>tz", []),  # cut short: never closed
    ("<tool_", "<tool_", []),
])
def test_tool_calls_from_streamed_text(text, content, calls):
    for pieces in splits(text):
        assert run_tools(pieces)[:2] == (content, calls), pieces


def test_parallel_tool_calls_false_keeps_the_first_call():
    _, calls, parser = run_tools([CALL + "<tool_call>clock</tool_call>"], max_calls=1)
    assert calls == [("get_weather", CALL_ARGUMENTS)] and len(parser.calls) == 1


def test_chat_output_deltas_and_message():
    pieces = ["Weather in", " Oslo?</th", "ink>Checking.\n", "\n<tool_", "call>clock</tool_call>\n", "\n"]
    output = ChatOutput(ReasoningParser(in_reasoning=True), ToolCallParser(TOOLS))
    deltas = [d for piece in pieces for d in output.feed(piece)] + output.finish()
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Weather in Oslo?"
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    # The newlines around the call are not content; the call comes as name first, then arguments.
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "clock", "arguments": ""} and calls[0]["id"].startswith("call_")
    assert calls[1] == {"index": 0, "function": {"arguments": "{}"}}
    assert output.finish_reason("stop") == "tool_calls" and output.finish_reason("length") == "length"
    whole = message(deltas, output.tool_calls)
    assert whole["content"] == "Checking." and whole["reasoning_content"] == "Weather in Oslo?"
    assert whole["tool_calls"] == [{"id": calls[0]["id"], "type": "function",
                                    "function": {"name": "clock", "arguments": "{}"}}]
    only_call = ChatOutput(None, ToolCallParser(TOOLS))
    deltas = only_call.feed("\n<tool_call>clock</tool_call>") + only_call.finish()
    assert message(deltas, only_call.tool_calls)["content"] is None
    plain = ChatOutput(None, None)  # --reasoning-parser none, no tools: the text as it is
    deltas = plain.feed("<think>x</think> \n") + plain.finish()
    assert message(deltas, []) == {"role": "assistant", "content": "<think>x</think> \n",
                                   "reasoning_content": None, "reasoning": None}
    assert plain.finish_reason("stop") == "stop"


def test_forced_tool_call_regex_admits_only_the_markup_of_allowed_functions():
    regex = tool_call_regex(TOOLS, ["get_weather"], parallel=False)
    good = ["<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>",
            CALL.replace("[1, 2]", "{\"a\": [1]}"),
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>a<b>c</arg_value><arg_key>unit"
            "</arg_key><arg_value>F</arg_value></tool_call>"]
    bad = ["", "Sure! " + good[0], good[0] + good[0],  # one call only (parallel off)
           "<tool_call>clock</tool_call>",  # not the named function
           "<tool_call>get_weather</tool_call>",  # city is required
           good[0].replace("Oslo", "Oslo</b>"),  # a value never holds "</"
           CALL.replace("<arg_value>3</arg_value>", "<arg_value>three</arg_value>"),  # days: integer
           CALL.replace("true", "yes"),  # metric: boolean
           good[2].replace(">F<", ">K<"),  # unit: enum
           "<tool_call>get_weather<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>city</arg_key>"
           "<arg_value>x</arg_value></tool_call>",  # the schema's order
           good[0][:-3]]
    for text in good:
        assert re.fullmatch(regex, text), text
        assert parse_call(text[len("<tool_call>"):-len("</tool_call>")], function_schemas(TOOLS)) is not None
    for text in bad:
        assert not re.fullmatch(regex, text), text
    either = tool_call_regex(TOOLS, ["get_weather", "clock"], parallel=True)
    assert re.fullmatch(either, "<tool_call>clock</tool_call>" + good[0] + "<tool_call>clock<arg_key>tz"
                                "</arg_key><arg_value>UTC</arg_value></tool_call>")
    assert not re.fullmatch(either, "<tool_call>clock</tool_call>\n<tool_call>clock</tool_call>")
    # Metacharacters in names are literals.
    assert re.fullmatch(call_regex("a.b+", {}), "<tool_call>a.b+</tool_call>")
    assert not re.fullmatch(call_regex("a.b+", {}), "<tool_call>axbb</tool_call>")
    assert re.fullmatch(TEXT, "x <- y; if a<b") and not re.fullmatch(TEXT, "a</b")


def test_tool_choice_plans_and_constraints():
    assert plan_tools(None, None, None).tools is None
    assert plan_tools(TOOLS, "none", None).tools is None and not plan_tools(TOOLS, "none", None).parse
    auto = plan_tools(TOOLS, None, None)
    assert auto.parse and auto.forced == () and auto.max_calls is None and len(auto.tools) == 2
    assert output_constraint(auto, None, thinking=True) is None
    required = plan_tools(TOOLS, "required", False)
    assert required.forced == ("get_weather", "clock") and required.max_calls == 1
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "clock"}}, None)
    constraint = output_constraint(named, None, thinking=True)
    assert constraint == Constraint("regex", tool_call_regex(TOOLS, ["clock"], False), "</think>")
    assert output_constraint(named, None, thinking=False).after is None
    for tools, choice, param in [(None, "required", "tool_choice"), (TOOLS, "sometimes", "tool_choice"),
                                 (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
                                 ([{"type": "function"}], None, "tools"),
                                 # markup in a name would close its call and open another
                                 ([{"type": "function", "function": {"name": "x</tool_call><tool_call>y"}}],
                                  None, "tools"),
                                 ([{"type": "function", "function": {"name": "a" * 65}}], None, "tools")]:
        with pytest.raises(InvalidFieldError) as caught:
            plan_tools(tools, choice, None)
        assert caught.value.param == param
    with pytest.raises(InvalidFieldError):
        output_constraint(named, {"type": "json_object"}, thinking=False)


def test_response_format_constraints():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert response_format_constraint(None, None) is None
    assert response_format_constraint({"type": "text"}, "</think>") is None
    assert response_format_constraint({"type": "json_object"}, "</think>") == Constraint(
        "json_object", "", "</think>")
    spec = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    constraint = response_format_constraint(spec, None)
    assert constraint.kind == "json_schema" and json.loads(constraint.spec) == schema
    for bad in ({"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 3}},
                {"type": "yaml"}):
        with pytest.raises(InvalidFieldError):
            response_format_constraint(bad, None)


def test_forced_call_values_are_bounded_and_a_cut_call_is_no_content():
    """Forced tool calls end on a weak model: strings within maxLength, numbers of bounded digits;
    an output cut off mid-call (finish_reason "length") shows no raw markup as content."""
    bounded = value_regex({"type": "string", "minLength": 2, "maxLength": 5})
    assert re.fullmatch(bounded, "Oslo") and re.fullmatch(bounded, "a<b")
    assert not re.fullmatch(bounded, "Oslo, Norway") and not re.fullmatch(bounded, "x")
    assert re.fullmatch(value_regex({"type": "string"}), "any length " * 50)
    integer, number = value_regex({"type": "integer"}), value_regex({"type": "number"})
    assert re.fullmatch(integer, "-" + "9" * 19) and not re.fullmatch(integer, "1" * 20)
    assert re.fullmatch(number, "3.25e-10") and not re.fullmatch(number, "1." + "0" * 18)
    with pytest.raises(InvalidFieldError):
        value_regex({"type": "string", "minLength": 3, "maxLength": 2})

    cut = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Osl"
    for forced, content in ((True, ""), (False, cut)):
        output = ChatOutput(None, ToolCallParser(TOOLS, forced=forced))
        answer = message(output.feed(cut) + output.finish(), output.tool_calls)
        assert (answer["content"], answer.get("tool_calls")) == (content, None)
        assert output.finish_reason("length") == "length"
