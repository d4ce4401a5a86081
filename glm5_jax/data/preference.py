"""Preference pairs for DPO: a prompt conversation, a chosen and a rejected assistant answer.

One `preference_jsonl` line (the format `python -m glm5_jax.data.feedback --pairs` writes):

    {"messages": [...prompt turns...] | "prompt": "text",
     "chosen": {"role": "assistant", "content": ..., "reasoning_content"?, "tool_calls"?} | "text",
     "rejected": (the same), "tools"?: [...]}

Each answer is rendered after the prompt with the chat template exactly like a chat_jsonl assistant
turn (glm5_jax/data/chat.py), so loss_mask marks the answer's tokens. A pair is two rows, chosen
then rejected, each one sequence padded to seq_len (never packed: DPO needs each answer's summed
log-probability). Pairs where either answer loses every target token to truncation are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from glm5_jax.chat.template import ChatRenderer
from glm5_jax.data.chat import (
    ChatStatistics,
    Example,
    parse_conversation,
    target_spans,
    tokenize_example,
    truncate,
)
from glm5_jax.data.sources import DataSourceError, Document, json_object


def _answer(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    if not isinstance(value, dict) or value.get("role", "assistant") != "assistant":
        raise DataSourceError(f"{where} must be a string or an assistant message")
    return {**value, "role": "assistant"}


def parse_pair(line: str, where: str) -> tuple[list[dict], dict, dict, list[dict] | None]:
    """One JSONL line -> (prompt messages, chosen, rejected, tools); errors name the line and field."""
    record = json_object(line, where, what="preference")
    if "messages" not in record:
        if not isinstance(record.get("prompt"), str):
            raise DataSourceError(f"{where}: needs 'messages' (a list) or 'prompt' (a string)")
        record = {**record, "messages": [{"role": "user", "content": record["prompt"]}]}
    for field in ("chosen", "rejected"):
        if field not in record:
            raise DataSourceError(f"{where}: field {field!r} is missing")
    chosen, rejected = (_answer(record[field], f"{where}: field {field!r}")
                        for field in ("chosen", "rejected"))
    # The prompt plus either answer must itself be a valid conversation.
    prompt = record["messages"] if isinstance(record["messages"], list) else None  # None: named below
    messages, tools = parse_conversation({**record, "messages": prompt and prompt + [chosen]}, where)
    parse_conversation({**record, "messages": prompt + [rejected]}, where)
    return messages[:-1], chosen, rejected, tools


def _answer_example(renderer: ChatRenderer, tokenizer: Tokenizer, prompt: list[dict], answer: dict,
                    tools, where: str) -> Example:
    messages = prompt + [answer]
    text, spans = target_spans(renderer, messages, [len(prompt)], tools, where)
    return tokenize_example(tokenizer, text, spans)


def preference_pairs(documents: Sequence[Document], renderer: ChatRenderer, tokenizer: Tokenizer,
                     seq_len: int) -> tuple[list[Example], ChatStatistics]:
    """preference_jsonl documents -> pair examples {input_ids, loss_mask: int32 [2, seq_len],
    segment_ids (1 = token, 0 = padding), positions}: row 0 chosen, row 1 rejected."""
    statistics = ChatStatistics()
    pairs = []
    for document in documents:
        prompt, chosen, rejected, tools = parse_pair(document.text, document.doc_id)
        statistics.conversations += 1
        rows = []
        for answer in (chosen, rejected):
            example = _answer_example(renderer, tokenizer, prompt, answer, tools, document.doc_id)
            rows.append(truncate(example, seq_len, statistics))
        if any(row is None for row in rows):
            continue
        statistics.examples += 1
        pair = {name: np.zeros((2, seq_len), np.int32) for name in ("input_ids", "loss_mask", "segment_ids",
                                                                     "positions")}
        for index, row in enumerate(rows):
            length = len(row["input_ids"])
            pair["input_ids"][index, :length] = row["input_ids"]
            pair["loss_mask"][index, :length] = row["loss_mask"]
            pair["segment_ids"][index, :length] = 1
            pair["positions"][index, :length] = np.arange(length)
        pairs.append(pair)
    return pairs, statistics
