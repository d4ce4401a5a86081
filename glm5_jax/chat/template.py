"""Chat messages -> prompt text: the checkpoint's Jinja chat template, or the built-in GLM-5 format.

Templates are rendered the way transformers' `apply_chat_template` renders them (an immutable
sandboxed Jinja environment with trim_blocks and lstrip_blocks, `raise_exception`, `strftime_now`
and a `tojson` that does not HTML-escape), so a checkpoint's template gives the same prompt here as
in transformers. Templates come from downloaded checkpoints, i.e. they are untrusted code: the
sandbox is what keeps them from reaching Python internals.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from glm5_jax.errors import InvalidRequestError, shown

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# The special-token variables transformers hands to templates (bos_token, eos_token, ...).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                      "mask_token")


def load_chat_template(checkpoint_dir: str | os.PathLike) -> str | None:
    """The checkpoint's chat template, or None when it has none.

    Looks where transformers saves it: `chat_template.jinja`, then the `chat_template` field of
    `tokenizer_config.json` (a string, or a list of named templates of which "default" is used),
    then `chat_template.json` (processor checkpoints).
    """
    directory = Path(checkpoint_dir)
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        return (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    for name in (TOKENIZER_CONFIG_FILE, "chat_template.json"):
        template = _read_json(directory / name).get("chat_template")
        if isinstance(template, list):
            named = {e.get("name"): e.get("template") for e in template if isinstance(e, dict)}
            template = named.get("default")
        if isinstance(template, str) and template:
            return template
    return None


def load_special_tokens(checkpoint_dir: str | os.PathLike) -> dict[str, str]:
    """bos_token, eos_token, ... from the checkpoint's tokenizer_config.json, for templates that use them."""
    config = _read_json(Path(checkpoint_dir) / TOKENIZER_CONFIG_FILE)
    tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):  # older configs store {"content": "<s>", "lstrip": ...}
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant text for training masks
    with it; rendering just keeps the body, but without the tag such templates would not compile."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes ("<" -> "\u003c"), which would change tool schemas in prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def compile_chat_template(template: str) -> jinja2.Template:
    """Compiles like transformers does; raises jinja2.TemplateSyntaxError for a broken template."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def message_text(content: Any, where: str) -> str:
    """A message's content as one string: a string, or a list of text parts concatenated.

    Parts are joined with no separator, as the GLM-5 template's own `visible_text` does, so flattening
    here changes nothing for GLM templates and lets string-only templates take part lists too.
    """
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string or a list of text parts")
    texts = []
    for index, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise InvalidRequestError(
                f"{where}[{index}] has type {shown(kind)}; only text parts ({{'type': 'text', 'text': ...}}) "
                "are supported")
    return "".join(texts)


class ChatRenderer:
    """Renders a conversation to the prompt string the model was trained on.

    template: the checkpoint's Jinja chat template, or None for the built-in GLM-5 format.
    special_tokens: variables such as bos_token / eos_token that templates may reference.
    """

    def __init__(self, template: str | None = None, special_tokens: Mapping[str, str] | None = None):
        self.template_source = template
        self._template = compile_chat_template(template) if template is not None else None
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping] | None = None,
               add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """messages: dicts with "role" and "content" (string or text parts) and optional extra keys
        (tool_calls, reasoning_content, ...). Raises InvalidRequestError for unusable content and
        jinja2.TemplateError when the template rejects the conversation (raise_exception)."""
        if not messages:
            raise InvalidRequestError("messages must be a non-empty list")
        # Like transformers: keys whose value is None are dropped, since templates test for presence.
        plain = [{key: value for key, value in message.items() if value is not None} for message in messages]
        for index, message in enumerate(plain):
            if message.get("role") == "developer":  # OpenAI's newer name for the system role
                message["role"] = "system"
            if message.get("content") is None and message.get("role") != "assistant":
                # Only an assistant turn that just calls tools may have no content.
                raise InvalidRequestError(f"messages[{index}].content is required for role "
                                          f"{shown(message.get('role'))}")
            message["content"] = message_text(message.get("content"), f"messages[{index}].content")
            if message.get("tool_calls"):
                message["tool_calls"] = [_parsed_arguments(call) for call in message["tool_calls"]]
            if "reasoning" in message and "reasoning_content" not in message:
                # Newer vLLM answers `reasoning`; clients send it back in the next turn's history.
                message["reasoning_content"] = message.pop("reasoning")
        if self._template is None:
            return render_glm5(plain, tools=tools, add_generation_prompt=add_generation_prompt,
                               enable_thinking=template_kwargs.get("enable_thinking", True),
                               clear_thinking=template_kwargs.get("clear_thinking", True))
        variables = {**self.special_tokens, **template_kwargs}
        return self._template.render(messages=plain, tools=list(tools) if tools else None,
                                     add_generation_prompt=add_generation_prompt, **variables)


def _parsed_arguments(call: Any) -> Any:
    """OpenAI sends tool-call arguments as a JSON string; templates (GLM's too) iterate a dict."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
        with contextlib.suppress(ValueError):
            arguments = json.loads(function["arguments"])
            if isinstance(arguments, dict):
                return {**call, "function": {**function, "arguments": arguments}}
    return call


_GLM5_TOOLS_INTRO = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
_GLM5_TOOLS_OUTRO = (
    "</tools>\n\nFor each function call, output the function name and arguments within the following "
    "XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}"
    "</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>")


def _glm5_tool_call(call: Mapping[str, Any]) -> str:
    call = call.get("function") or call
    if not isinstance(call.get("arguments") or {}, Mapping):
        raise InvalidRequestError("messages: tool_calls[].function.arguments must be a JSON object, "
                                  f"got {shown(call.get('arguments'))}")
    values = {k: v if isinstance(v, str) else _tojson(v) for k, v in (call.get("arguments") or {}).items()}
    arguments = "".join(f"<arg_key>{key}</arg_key><arg_value>{v}</arg_value>" for key, v in values.items())
    return f"<tool_call>{call.get('name', '')}{arguments}</tool_call>"


def _glm5_reasoning(message: Mapping[str, Any], text: str) -> tuple[str, str]:
    """(reasoning, answer) of a past assistant turn, as the GLM-5 template splits them: its
    reasoning_content, else what its content has before `</think>`."""
    if isinstance(message.get("reasoning_content"), str):
        return message["reasoning_content"], text
    if "</think>" in text:
        reasoning = text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
        return reasoning, text.split("</think>")[-1].lstrip("\n")
    return "", text


def render_glm5(messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping] | None = None,
                add_generation_prompt: bool = True, enable_thinking: bool = True,
                clear_thinking: bool = True) -> str:
    """The built-in GLM-5 format, used when a checkpoint has no template (e.g. a train.py run).

    It reproduces what GLM-5's own chat_template.jinja renders: `[gMASK]<sop>`, the tool list, then
    `<|system|>`/`<|user|>` + text with no newline, past assistant turns as `<|assistant|></think>` +
    stripped text + `<tool_call>`s (turns after the last user message, or all with clear_thinking
    false, keep their reasoning as `<think>...</think>`), tool results as
    `<|observation|><tool_response>...`, and `<|assistant|><think>` (or `</think>` with thinking off)
    as the generation prompt.
    """
    parts = ["[gMASK]<sop>"]
    if tools:
        parts += [_GLM5_TOOLS_INTRO, *(_tojson(tool) + "\n" for tool in tools), _GLM5_TOOLS_OUTRO]
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    previous_role = None
    for index, message in enumerate(messages):
        role, text = message["role"], message_text(message.get("content"), "content")
        if role == "system":
            parts.append(f"<|system|>{text}")
        elif role == "user":
            parts.append(f"<|user|>{text}")
        elif role == "assistant":
            reasoning, text = _glm5_reasoning(message, text)
            shown = (not clear_thinking or index > last_user) and reasoning
            parts.append("<|assistant|>" + (f"<think>{reasoning.strip()}</think>" if shown else "</think>")
                         + text.strip())
            parts += [_glm5_tool_call(call) for call in message.get("tool_calls") or ()]
        elif role == "tool":
            if previous_role != "tool":
                parts.append("<|observation|>")
            parts.append(f"<tool_response>{text}</tool_response>")
        else:
            raise InvalidRequestError(f"role must be system, user, assistant or tool, got {shown(role)}")
        previous_role = role
    if add_generation_prompt:
        parts.append("<|assistant|>" + ("<think>" if enable_thinking else "</think>"))
    return "".join(parts)
