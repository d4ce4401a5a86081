"""The engine requests behind one API request and the HTTP answer they make.

A request asks for `n` choices of each of its prompts (/v1/completions takes a list of prompts;
choice index = prompt index * n + j); each choice is its own engine request. The answer is either
one JSON body once all have finished, or one SSE stream in which the choices' chunks interleave
as their tokens arrive. A client that goes away cancels every engine request; a request that
fails in the engine fails the whole answer (a generic 500, or a final SSE error event).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from glm5_jax.api.accounting import AccountedGeneration
from glm5_jax.api.errors import APIError, error_body, internal_error_message, shutting_down_error
from glm5_jax.api.limits import Reservation
from glm5_jax.engine.textstream import Piece
from glm5_jax.engine.types import SHUTTING_DOWN, GenerationEvent

logger = logging.getLogger(__name__)


class Choices:
    """The generations of one request, `n` per prompt, and its one rate-limit reservation.

    usage(): each prompt's tokens once (as OpenAI and vLLM count them), every choice's completion
    tokens, and the prompts' cached tokens (of each prompt's first choice). close() closes every
    generation and settles the reservation with the usage's total.
    """

    def __init__(self, generations: list[AccountedGeneration], n: int, reservation: Reservation):
        self.generations, self.n, self._reservation = generations, n, reservation
        self._closed = False

    def usage(self) -> dict:
        firsts = self.generations[::self.n]
        prompt = sum(g.prompt_tokens for g in firsts)
        completion = sum(g.completion_tokens for g in self.generations)
        cached = sum(g.stream.cached_tokens for g in firsts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for generation in self.generations:
                generation.close()
            self._reservation.settle(self.usage()["total_tokens"])

    @property
    def shut_down(self) -> bool:
        """A drain ended some choice before it finished (serve.py got SIGTERM)."""
        return any(g.finish_reason == "abort" and g.error == SHUTTING_DOWN for g in self.generations)

    def log_errors(self, request_id: str) -> None:
        # The engine logs the cause with its traceback; this ties it to the HTTP request.
        for generation in self.generations:
            if generation.finish_reason == "error":
                logger.error("request %s failed in the engine (engine request %s)", request_id,
                             generation.stream.request_id)


class _SSEResponse(StreamingResponse):
    """Closes the event generator however the response ends (e.g. the client disconnected while a
    chunk was being sent), so its `finally` cancels the engine requests now rather than at GC."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


# Characters that str.splitlines (and line readers built on it, e.g. httpx's iter_lines) take for
# line ends, which JSON leaves raw inside strings: escaped, so one event stays one line for any
# reader (a sampled token can decode to one of them).
_LINE_ENDS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(data) -> str:
    """`data` as one server-sent event's JSON: UTF-8 text kept, line-ending characters escaped."""
    return json.dumps(data, ensure_ascii=False).translate(_LINE_ENDS)

async def _until_disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (uvicorn blocks until then).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(request: Request, choices: Choices) -> list[tuple[str, list[GenerationEvent]]] | None:
    """Runs every generation to the end; None (requests cancelled) if the client leaves first."""

    async def run(generation):
        texts, events = [], []
        async with contextlib.aclosing(generation.pieces()) as pieces:
            async for piece in pieces:
                texts.append(piece.text)
                events.extend(piece.events)
        return "".join(texts), events

    task = asyncio.ensure_future(asyncio.gather(*(run(g) for g in choices.generations)))
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        task.cancel()  # no-op when done; otherwise each pieces() finally cancels its engine request
        watcher.cancel()


async def _merged(generations: list[AccountedGeneration]) -> AsyncIterator[tuple[int, Piece]]:
    """(choice index, piece) of all generations, in the order the pieces come."""
    if len(generations) == 1:
        async with contextlib.aclosing(generations[0].pieces()) as pieces:
            async for piece in pieces:
                yield 0, piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index, generation):
        try:
            async with contextlib.aclosing(generation.pieces()) as pieces:
                async for piece in pieces:
                    queue.put_nowait((index, piece))
            queue.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                running -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def respond(request: Request, stream: bool, include_usage: bool, choices: Choices, base: dict,
                  first_chunks: list[dict], chunks: Callable[[int, Piece], Iterable[dict]],
                  response: Callable[[list[tuple[str, list[GenerationEvent]]]], dict]):
    """Streams SSE chunks (first_chunks, then chunks(index, piece) for each piece, the usage chunk
    when asked, then [DONE]) or waits for every output and returns response([(text, events), ...])."""
    if not stream:
        try:
            results = await _collect(request, choices)
        finally:
            choices.close()
        if any(g.finish_reason == "error" for g in choices.generations):
            choices.log_errors(base["id"])
            raise APIError(500, internal_error_message(base["id"]), kind="server_error")
        if choices.shut_down:  # queued, or still running when the grace period ended
            raise shutting_down_error()
        # 499: nobody is listening any more (the engine requests were cancelled).
        return Response(status_code=499) if results is None else response(results)

    def sse(data: dict) -> str:
        # With include_usage every chunk carries "usage": null except the last one, as OpenAI does.
        data = {**data, "usage": None} if include_usage else data
        return f"data: {sse_json(data)}\n\n"

    async def events():
        for chunk in first_chunks:
            yield sse(chunk)
        failed = False
        try:
            async with contextlib.aclosing(_merged(choices.generations)) as pieces:
                async for index, piece in pieces:
                    if piece.finish_reason == "error":  # send what was generated, then the error
                        failed, piece = True, Piece(piece.text, piece.events)
                    if piece.text or piece.events or not failed:
                        for chunk in chunks(index, piece):
                            yield sse(chunk)
                    if failed:
                        break
            if failed:
                choices.log_errors(base["id"])
        except Exception:  # a bug mid-stream: too late for a status code
            logger.exception("request %s failed", base["id"])
            failed = True
        finally:
            choices.close()
        if failed:
            error = error_body(internal_error_message(base["id"]), "server_error")
            yield f"data: {json.dumps({'error': error})}\n\n"
        elif choices.shut_down:  # after each cut choice's finish_reason "abort" chunk
            exc = shutting_down_error()
            yield f"data: {json.dumps({'error': error_body(exc.message, exc.kind, code=exc.code)})}\n\n"
        elif include_usage:
            yield f"data: {json.dumps({**base, 'choices': [], 'usage': choices.usage()})}\n\n"
        yield "data: [DONE]\n\n"

    return _SSEResponse(events(), media_type="text/event-stream")
