"""Log probabilities in the OpenAI formats: /v1/completions' (tokens, token_logprobs, top_logprobs,
text_offset; with echo, the prompt's tokens first) and chat's (content: [{token, logprob, bytes,
top_logprobs}])."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from glm5_jax.engine.types import GenerationEvent

PromptLogprobs = Sequence[tuple[float | None, Sequence[tuple[int, float]]]]


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _completion_format(tokenizer, token_ids, logprobs, tops, offset: int) -> dict:
    tokens = [token_text(tokenizer, token) for token in token_ids]
    offsets = list(itertools.accumulate(map(len, tokens[:-1]), initial=offset)) if tokens else []
    return {"tokens": tokens, "token_logprobs": list(logprobs), "text_offset": offsets,
            "top_logprobs": [None if top is None else {token_text(tokenizer, t): lp for t, lp in top}
                             for top in tops]}


def completion_logprobs(tokenizer, events: Sequence[GenerationEvent], offset: int) -> dict:
    """Generated tokens; offset: where the first one's text starts in the choice's text."""
    return _completion_format(tokenizer, [e.token_id for e in events], [e.logprob for e in events],
                              [e.top_logprobs for e in events], offset)


def prompt_completion_logprobs(tokenizer, prompt_ids: Sequence[int], entries: PromptLogprobs | None) -> dict:
    """The echoed prompt's tokens: the first has no log probability (null, as OpenAI and vLLM
    answer); entries: GenerationEvent.prompt_logprobs (None when the engine gave none: all null)."""
    entries = list(entries or ())
    if len(entries) != len(prompt_ids):
        entries = [(None, ())] * len(prompt_ids)
    logprobs = [None] + [logprob for logprob, _ in entries[1:]]
    tops = [None] + [top if logprob is not None else None for logprob, top in entries[1:]]
    return _completion_format(tokenizer, prompt_ids, logprobs[:len(prompt_ids)], tops[:len(prompt_ids)], 0)


def joined(first: dict, second: dict) -> dict:
    """Two completion logprobs blocks one after the other (the echoed prompt, then the output)."""
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(tokenizer, events: Sequence[GenerationEvent]) -> dict:
    def entry(token_id, logprob):
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(e.token_id, e.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in e.top_logprobs]} for e in events]}
