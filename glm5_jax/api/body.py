"""Reading a request body: a size cap (413) and a deadline (408) while it streams in, JSON parsed
here rather than by FastAPI (so that `curl -d` without a JSON Content-Type works and malformed JSON
gets a clear message), refused when it nests too deep or holds a lone UTF-16 surrogate, then
validated strictly against the route's pydantic model (protocol.py)."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from pydantic import BaseModel

from glm5_jax.api.errors import APIError
from glm5_jax.chat.feedback_log import LONE_SURROGATE

# Far above any prompt the context allows (128k token ids as JSON are ~1 MB), far below memory trouble.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0
MAX_JSON_DEPTH = 64  # JSON schemas and tool parameters nest far less; the template and grammar recurse


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The body, refused with 413 as soon as it is known to be over max_bytes: by its Content-Length
    up front, else (chunked) by counting while it streams in, so no oversized body is held; 408
    when it has not all come within timeout_s (a stalled client must not hold its connection)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise _too_large(max_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"The request body did not arrive within {timeout_s:g} s",
                       code="request_timeout") from None
    return b"".join(chunks)


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"The request body is larger than this server's limit of {max_bytes} bytes",
                    code="request_too_large")


async def parse_body(request: Request, model: type[BaseModel], max_bytes: int, timeout_s: float):
    """The JSON body as `model` (a ValidationError becomes a 400 in the app's handler)."""
    body = await read_body(request, max_bytes, timeout_s)
    try:
        data = json.loads(body)
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise APIError(400, f"The request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise APIError(400, f"The request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    check_json(data)
    return model.model_validate(data)


def check_json(data) -> None:
    """400 for JSON nested deeper than MAX_JSON_DEPTH (the chat template, the grammar compiler and
    the feedback log recurse into it) or holding a lone UTF-16 surrogate ("\\ud800": not Unicode,
    so neither the tokenizer nor a UTF-8 file can take it), naming where; without recursion."""
    stack = [(data, "body", 1)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"The request body nests deeper than {MAX_JSON_DEPTH} levels (at {where})")
        if isinstance(value, str):
            if LONE_SURROGATE.search(value):
                raise APIError(400, f"{where} holds a lone UTF-16 surrogate (e.g. \\ud800 without its "
                                    "pair), which is not valid Unicode", where.split(".")[1].split("[")[0]
                               if "." in where else None)
        elif isinstance(value, dict):
            for key, item in value.items():
                if LONE_SURROGATE.search(key):
                    raise APIError(400, f"a key in {where} holds a lone UTF-16 surrogate, which is not "
                                        "valid Unicode")
                stack.append((item, f"{where}.{key[:40]}", depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{index}]", depth + 1) for index, item in enumerate(value)
                         if not isinstance(item, int))


def text_chars(value) -> int:
    """Characters of all the strings in a JSON value (depth bounded by check_json)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(item) for item in value.values())
    if isinstance(value, list):
        return sum(text_chars(item) for item in value)
    return 0
