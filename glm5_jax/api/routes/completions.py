"""POST /v1/completions: one or more prompts (text or token ids), n choices each, with echo and
logprobs (echo + logprobs scores the prompt: lm-evaluation-harness' loglikelihood requests)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from fastapi import APIRouter, Request

from glm5_jax.api.chat_constraints import response_format_constraint
from glm5_jax.api.choices import respond
from glm5_jax.api.errors import APIError
from glm5_jax.api.feedback import recording
from glm5_jax.api.logprobs import completion_logprobs, joined, prompt_completion_logprobs
from glm5_jax.api.protocol import CompletionRequest
from glm5_jax.api.state import SYSTEM_FINGERPRINT, Shared, checked_field, include_usage
from glm5_jax.engine.textstream import Piece

MAX_COMPLETION_LOGPROBS = 5  # the OpenAI limit for /v1/completions; chat allows top_logprobs up to 20

router = APIRouter()


def prompt_list(prompt) -> list:
    """/v1/completions' prompt as a list of prompts (each a string or token ids)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


@router.post("/v1/completions")
async def completions(request: Request, state: Shared):
    request_id, reservation, body = await state.receive(request, CompletionRequest, "cmpl-")
    if body.best_of not in (None, 1) or body.suffix:
        param = "suffix" if body.suffix else "best_of"
        raise APIError(400, f"{param} is not supported", param)
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise APIError(400, f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, "
                            f"got {body.logprobs}", "logprobs")
    scoring = bool(body.echo) and body.logprobs is not None
    params = state.sampling_params(body, body.max_tokens, 16, body.logprobs,
                                   prompt_logprobs=body.logprobs if scoring else None)
    params = dataclasses.replace(params, constraint=checked_field(response_format_constraint,
                                                                  body.response_format, None))
    prompts = prompt_list(body.prompt)
    capacity = state.capacity
    if len(prompts) * (body.n or 1) > capacity:
        raise APIError(400, f"prompt: at most {capacity} prompts x n per request (this server queues "
                            f"at most {capacity} requests at once)", "prompt")
    for prompt in prompts:
        if isinstance(prompt, str):
            if body.truncate_prompt_tokens is None:  # else only its tail is kept: tokenize to see
                state.check_text(prompt, "prompt")
        else:
            state.check_token_ids(prompt, "prompt")
    ids = [await asyncio.to_thread(state.encode, p) if isinstance(p, str) else list(p) for p in prompts]
    reservation.charge(sum(map(len, ids)))  # the tokenizer's work counts if refused below
    ids = [state.prepared(body, prompt_ids, "prompt") for prompt_ids in ids]
    echoes = [await asyncio.to_thread(state.decode, p) if body.echo else "" for p in ids]
    choices = state.start(request, reservation, body, ids, params)
    tokenizer = state.tokenizer
    n, offsets, echoed = choices.n, [0] * len(choices.generations), [False] * len(choices.generations)
    base = {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": state.model_id, "system_fingerprint": SYSTEM_FINGERPRINT}

    def choice(index, text, events, finish):
        """Choice `index`'s text and logprobs; offsets[index]: where `text` starts in the choice's text.
        When scoring, the final (EOS) token counts too: clients slice by token counts."""
        logprobs = None
        if params.logprobs is not None:
            hidden = choices.generations[index].hidden_event
            shown = [*events, hidden] if scoring and finish and hidden is not None else events
            logprobs = completion_logprobs(tokenizer, shown, offsets[index])
        offsets[index] += len(text)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def echo_choice(index):
        echoed[index], prompt = True, index // n
        logprobs = None
        if scoring:
            logprobs = prompt_completion_logprobs(tokenizer, ids[prompt],
                                                  choices.generations[index].prompt_logprobs)
        offsets[index] += len(echoes[prompt])
        return {"index": index, "text": echoes[prompt], "logprobs": logprobs, "finish_reason": None}

    def chunks(index, piece: Piece):
        if body.echo and not echoed[index]:  # sent once the prompt's log probabilities have come
            yield {**base, "choices": [echo_choice(index)]}
        yield {**base, "choices": [choice(index, piece.text, piece.events, piece.finish_reason)]}

    def response(results):
        answers = []
        for index, (text, events) in enumerate(results):
            first = echo_choice(index) if body.echo else None
            answer = choice(index, text, events, choices.generations[index].finish_reason)
            if first is not None:
                answer["text"] = first["text"] + answer["text"]
                if scoring:
                    answer["logprobs"] = joined(first["logprobs"], answer["logprobs"])
            answers.append(answer)
        return {**base, "choices": answers, "usage": choices.usage()}

    chunks, response = recording(state.feedback_log, "completions", base, {"prompts": prompts}, params,
                                 choices, chunks, response)
    return await respond(request, bool(body.stream), include_usage(body), choices, base, [], chunks, response)
