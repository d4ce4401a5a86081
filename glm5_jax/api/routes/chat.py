"""POST /v1/chat/completions: messages rendered by the chat template, n choices, tools and
response_format as grammar constraints, the reasoning block and tool calls split out of the
content (chat_output.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from fastapi import APIRouter, Request

from glm5_jax.api.chat_constraints import output_constraint, plan_tools
from glm5_jax.api.chat_output import ChatOutput, message
from glm5_jax.api.choices import respond
from glm5_jax.api.errors import APIError
from glm5_jax.api.feedback import recording
from glm5_jax.api.logprobs import chat_logprobs
from glm5_jax.api.protocol import ChatRequest
from glm5_jax.api.state import SYSTEM_FINGERPRINT, Shared, checked_field, include_usage
from glm5_jax.chat.reasoning import ReasoningParser, starts_in_reasoning
from glm5_jax.chat.tool_calls import ToolCallParser
from glm5_jax.engine.textstream import Piece
from glm5_jax.engine.types import MAX_TOP_LOGPROBS

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, state: Shared):
    request_id, reservation, body = await state.receive(request, ChatRequest, "chatcmpl-")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    top = body.top_logprobs or 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}",
                       "top_logprobs")
    max_param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    params = state.sampling_params(body, getattr(body, max_param), state.engine.max_context,
                                   top if body.logprobs else None, max_param)
    plan = checked_field(plan_tools, body.tools, body.tool_choice, body.parallel_tool_calls)
    messages = [message.model_dump(exclude_none=True) for message in body.messages]

    def prompt_ids():
        prompt = state.render(messages, plan.tools, state.template_kwargs(body.chat_template_kwargs),
                              truncating=body.truncate_prompt_tokens is not None)
        # The template already wrote the special tokens ([gMASK]<sop>, ...): add none of our own.
        return prompt, state.encode(prompt, add_special_tokens=False)

    prompt, ids = await asyncio.to_thread(prompt_ids)
    reservation.charge(len(ids))
    # GLM-5's template opens the thinking block itself: the output then starts inside it.
    thinking = starts_in_reasoning(prompt)
    constraint = checked_field(output_constraint, plan, body.response_format, thinking)
    params = dataclasses.replace(params, constraint=constraint)
    choices = state.start(request, reservation, body, [state.prepared(body, ids, "messages")], params)
    tokenizer = state.tokenizer
    outputs = [ChatOutput(ReasoningParser(thinking) if state.reasoning_parser == "glm45" else None,
                          ToolCallParser(plan.tools, plan.max_calls, bool(plan.forced))
                          if plan.parse else None)
               for _ in choices.generations]
    base = {"id": request_id, "object": "chat.completion.chunk",
            "created": int(time.time()), "model": state.model_id, "system_fingerprint": SYSTEM_FINGERPRINT}

    def chunk(index, events, finish, delta):  # events None: a chunk without tokens (role, finish)
        wanted = params.logprobs is not None and events is not None
        logprobs = chat_logprobs(tokenizer, events) if wanted else None
        return {**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish}]}

    def chunks(index, piece: Piece):
        output = outputs[index]
        deltas = output.feed(piece.text) if piece.text else []
        if piece.finish_reason:
            deltas += output.finish()
        for k, delta in enumerate(deltas or ([{}] if piece.events else [])):
            yield chunk(index, piece.events if k == 0 else None, None, delta)
        if piece.finish_reason:
            yield chunk(index, None, output.finish_reason(piece.finish_reason), {})

    def response(results):
        answers = []
        for index, ((text, events), output) in enumerate(zip(results, outputs, strict=True)):
            deltas = output.feed(text) + output.finish()
            logprobs = chat_logprobs(tokenizer, events) if params.logprobs is not None else None
            finish = output.finish_reason(choices.generations[index].finish_reason)
            answers.append({"index": index, "message": message(deltas, output.tool_calls),
                            "logprobs": logprobs, "finish_reason": finish})
        return {**base, "object": "chat.completion", "usage": choices.usage(), "choices": answers}

    first = [chunk(index, None, None, {"role": "assistant", "content": ""})
             for index in range(len(choices.generations))]
    asked = {"messages": messages, "tools": body.tools, "tool_choice": body.tool_choice,
             "response_format": body.response_format}
    chunks, response = recording(state.feedback_log, "chat", base, asked, params, choices, chunks, response)
    return await respond(request, bool(body.stream), include_usage(body), choices, base, first, chunks,
                         response)
