"""vLLM's POST /tokenize, POST /detokenize and GET /tokenizer_info (what a remote tokenizer client,
e.g. lm-evaluation-harness' tokenizer_backend=remote, needs)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from glm5_jax.api.errors import APIError
from glm5_jax.api.logprobs import token_text
from glm5_jax.api.protocol import DetokenizeRequest, TokenizeRequest
from glm5_jax.api.state import Shared

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request, state: Shared):
    # A prompt (special tokens added unless told not to) or chat messages (rendered by the chat
    # template, which writes its own special tokens).
    reservation = state.admit(request)
    body = await state.parse(request, TokenizeRequest)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send either prompt or messages", "prompt")
    if body.prompt is not None:
        state.check_text(body.prompt, "prompt")
        special = body.add_special_tokens is not False
        ids = await asyncio.to_thread(state.encode, body.prompt, special)
    else:
        messages = [message.model_dump(exclude_none=True) for message in body.messages]
        kwargs = state.template_kwargs(body.chat_template_kwargs)
        prompt = await asyncio.to_thread(state.render, messages, body.tools, kwargs,
                                         body.add_generation_prompt is not False)
        ids = await asyncio.to_thread(state.encode, prompt, bool(body.add_special_tokens))
    reservation.settle(len(ids))
    strings = [token_text(state.tokenizer, token) for token in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.engine.max_context, "tokens": ids,
            "token_strs": strings}


@router.post("/detokenize")
async def detokenize(request: Request, state: Shared):
    reservation = state.admit(request)
    body = await state.parse(request, DetokenizeRequest)
    state.check_model(body.model)
    max_context = state.engine.max_context
    if len(body.tokens) > max_context:
        raise APIError(400, f"tokens: at most {max_context} (this server's context), got "
                            f"{len(body.tokens)}", "tokens", "context_length_exceeded")
    state.check_token_ids(body.tokens, "tokens")
    reservation.settle(len(body.tokens))
    return {"prompt": await asyncio.to_thread(state.decode, body.tokens, False)}


@router.get("/tokenizer_info")
async def tokenizer_info(state: Shared):
    # Besides /tokenize and /detokenize: the special tokens and the chat template.
    renderer = state.renderer
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": state.engine.max_context,
            **renderer.special_tokens, "chat_template": renderer.template_source}
