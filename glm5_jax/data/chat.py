"""Chat conversations as training examples: rendered with a chat template, loss on assistant tokens.

One `chat_jsonl` line is an OpenAI-style conversation:

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": ...,
                   "reasoning_content"?: str, "tool_calls"?: [...], "tool_call_id"?: str}, ...],
     "tools"?: [...]}

How a conversation becomes examples (`conversation_examples`):
- It is cut after each user turn's replies: one example per user turn that an assistant answers,
  holding the conversation up to the next user turn. GLM-5's template drops the reasoning of
  assistant turns before the last user message, so a turn is trained as the model sees it when it
  writes it: its own reasoning shown, earlier turns' reasoning cleared. (Single-question data, the
  common case, gives one example per conversation.)
- Targets are the assistant turns after that user turn: their text as the template renders it,
  without the role header the template adds as the generation prompt (`<|assistant|>`, and
  `<think>` when the turn has reasoning), plus the one token after each turn, which ends it (the
  next role token, or `<|endoftext|>` after the last turn). Everything else (system, user, tool
  results, headers) is context with loss mask 0.
- Target spans are found by rendering prefixes of the example: the template must render a prefix
  of a conversation as a prefix of the whole (the GLM-5 and built-in templates do, given the cut
  above); a template that does not is an error naming the turn.

Tokens come from one encoding of the whole rendered text; a token is a target when its characters
overlap a target span (template role tokens are special tokens, so spans fall on token boundaries
but for a split inside one, e.g. `</think>` against a `<think>` generation prompt).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from glm5_jax.chat.template import ChatRenderer
from glm5_jax.data.sources import DataSourceError, Document, json_object
from glm5_jax.data.tokenizer import end_of_text_id
from glm5_jax.errors import InvalidRequestError

ROLES = ("system", "user", "assistant", "tool")
Example = dict[str, np.ndarray]  # {"input_ids": int32 [T], "loss_mask": int32 [T]}


@dataclasses.dataclass
class ChatStatistics:
    """What turning conversations into examples kept, cut and skipped (logged by train.py)."""

    conversations: int = 0
    examples: int = 0
    skipped_no_assistant: int = 0  # conversations without an assistant turn to learn from
    truncated_examples: int = 0  # examples longer than seq_len, cut at the end
    cut_target_tokens: int = 0  # target tokens those cuts removed
    dropped_examples: int = 0  # examples whose every target token was cut away
    target_tokens: int = 0  # target tokens kept

    def add(self, other: ChatStatistics) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def as_dict(self, pairs: bool = False) -> dict[str, int]:
        """The counts by name. pairs: named as preference pairs count them (glm5_jax/data/preference.py:
        a pair is one "conversation", each of its two answers one "example"; no chat-only skips)."""
        counts = dataclasses.asdict(self)
        if not pairs:
            return counts
        return {PAIR_NAMES[name]: value for name, value in counts.items() if name in PAIR_NAMES}


# ChatStatistics' counts as preference_pairs fills them: a pair is kept when both answers fit.
PAIR_NAMES = {"conversations": "pairs", "examples": "pairs_kept", "truncated_examples": "truncated_answers",
              "cut_target_tokens": "cut_target_tokens", "dropped_examples": "dropped_answers",
              "target_tokens": "target_tokens"}


def parse_conversation(line: str | dict, where: str) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """One JSONL line (or its parsed object) -> (messages, tools); raises DataSourceError naming
    `where` and the field."""
    record = line if isinstance(line, dict) else json_object(line, where, what="conversation")
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataSourceError(f"{where}: field 'messages' must be a non-empty list")
    for index, message in enumerate(messages):
        field = f"{where}: messages[{index}]"
        if not isinstance(message, dict):
            raise DataSourceError(f"{field} must be an object")
        if message.get("role") not in ROLES:
            raise DataSourceError(f"{field}.role must be one of {ROLES}, got {message.get('role')!r}")
        content = message.get("content")
        if not (content is None or isinstance(content, str | list)):
            raise DataSourceError(f"{field}.content must be a string or a list of text parts")
        if content is None and not (message["role"] == "assistant" and message.get("tool_calls")):
            raise DataSourceError(f"{field}.content is required (only an assistant turn that calls "
                                  "tools may omit it)")
        if not isinstance(message.get("reasoning_content") or "", str):
            raise DataSourceError(f"{field}.reasoning_content must be a string")
        calls = message.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise DataSourceError(f"{field}.tool_calls must be a list of objects")
    tools = record.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataSourceError(f"{where}: field 'tools' must be a list of objects")
    return messages, tools


def conversation_examples(messages: Sequence[Mapping[str, Any]]) -> list[tuple[list, list[int]]]:
    """The examples of one conversation: (messages of the example, indices of its target turns).

    One per user turn followed by assistant turns; the example ends before the next user turn.
    Assistant turns before the first user turn (if any) are context only.
    """
    users = [i for i, message in enumerate(messages) if message["role"] == "user"]
    examples = []
    for k, start in enumerate(users):
        end = users[k + 1] if k + 1 < len(users) else len(messages)
        targets = [i for i in range(start + 1, end) if messages[i]["role"] == "assistant"]
        if targets:
            examples.append((list(messages[:end]), targets))
    return examples


def _common_prefix_length(a: str, b: str) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


def target_spans(renderer: ChatRenderer, messages: Sequence[Mapping[str, Any]], targets: Sequence[int],
                 tools: Sequence[Mapping] | None, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered example and its target character spans [start, end), one per target turn.

    Raises DataSourceError when the template rejects the conversation or renders a prefix of it
    differently from the whole (then spans cannot be located).
    """
    def render(upto: int, generation_prompt: bool) -> str:
        try:
            return renderer.render(messages[:upto], tools=tools, add_generation_prompt=generation_prompt)
        except (InvalidRequestError, ValueError) as error:  # jinja2.TemplateError is not a ValueError
            raise DataSourceError(f"{where}: {error}") from error
        except Exception as error:  # a template's raise_exception(), or a template bug
            raise DataSourceError(f"{where}: the chat template rejected the conversation: {error}") from error

    text = render(len(messages), False)
    spans = []
    for index in targets:
        before, prompted, through = render(index, False), render(index, True), render(index + 1, False)
        if not (through.startswith(before) and text.startswith(through)):
            raise DataSourceError(f"{where}: the chat template does not render messages[:{index + 1}] as "
                                  "a prefix of the conversation; cannot locate the assistant turn")
        header = _common_prefix_length(prompted[len(before):], through[len(before):])
        spans.append((len(before) + header, len(through)))
    return text, spans


def tokenize_example(tokenizer: Tokenizer, text: str, spans: Sequence[tuple[int, int]]) -> Example:
    """Encodes the rendered text plus `<|endoftext|>` -> input_ids and loss_mask, int32 [T].

    A token is a target when its characters overlap a span (a span found by comparing strings may
    start inside a token, e.g. GLM's `</think>` after a `<think>` generation prompt), or is the first
    token after one (the token that ends the turn; `<|endoftext|>` after the last).
    """
    encoding = tokenizer.encode(text, add_special_tokens=False)
    ids = list(encoding.ids) + [end_of_text_id(tokenizer)]
    starts = np.asarray([start for start, _ in encoding.offsets] + [len(text)])
    ends = np.asarray([end for _, end in encoding.offsets] + [len(text) + 1])
    mask = np.zeros(len(ids), np.int32)
    for begin, end in spans:
        inside = (ends > begin) & (starts < end)
        mask |= inside
        after = np.flatnonzero(starts >= end)
        if inside.any() and after.size:
            mask[after[0]] = 1
    return {"input_ids": np.asarray(ids, np.int32), "loss_mask": mask}


def truncate(example: Example, seq_len: int, statistics: ChatStatistics) -> Example | None:
    """The example cut to seq_len tokens (counted), or None when no target token would remain."""
    length = len(example["input_ids"])
    if length <= seq_len:
        statistics.target_tokens += int(example["loss_mask"].sum())
        return example
    statistics.truncated_examples += 1
    statistics.cut_target_tokens += int(example["loss_mask"][seq_len:].sum())
    kept = {name: values[:seq_len] for name, values in example.items()}
    if not kept["loss_mask"].any():
        statistics.dropped_examples += 1
        return None
    statistics.target_tokens += int(kept["loss_mask"].sum())
    return kept


def chat_examples(documents: Sequence[Document], renderer: ChatRenderer, tokenizer: Tokenizer,
                  seq_len: int) -> tuple[list[Example], ChatStatistics]:
    """chat_jsonl documents (one conversation line each) -> examples of at most seq_len tokens."""
    statistics = ChatStatistics()
    examples = []
    for document in documents:
        messages, tools = parse_conversation(document.text, document.doc_id)
        statistics.conversations += 1
        pieces = conversation_examples(messages)
        if not pieces:
            statistics.skipped_no_assistant += 1
            continue
        for example_messages, targets in pieces:
            text, spans = target_spans(renderer, example_messages, targets, tools, document.doc_id)
            example = truncate(tokenize_example(tokenizer, text, spans), seq_len, statistics)
            if example is not None:
                statistics.examples += 1
                examples.append(example)
    return examples, statistics
