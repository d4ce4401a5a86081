"""OpenAI-style errors for the HTTP API: the {"error": {"message", "type", "param", "code"}} body, and
the app's exception handlers that turn every failure into one.

Client mistakes are 400s naming the parameter; overload, a starting server and a failed engine are
503s (a full queue and a starting server with Retry-After); anything unexpected is a 500 whose
message is generic ("Internal server error", with the request id when there is one) while the
details go to the log.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from glm5_jax.engine.types import (
    EngineUnavailableError,
    InvalidRequestError,
    QueueFullError,
    SamplingParams,
    ShuttingDownError,
)

logger = logging.getLogger(__name__)
_PARAM_NAMES = frozenset(field.name for field in dataclasses.fields(SamplingParams)) | {"prompt", "messages"}


class APIError(Exception):
    """An error answered as {"error": {...}} with the given HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = dict(headers or {})


def error_body(message: str, kind="invalid_request_error", param=None, code=None) -> dict:
    return {"message": message, "type": kind, "param": param, "code": code}


def error_response(status: int, message: str, param=None, code=None, kind="invalid_request_error",
                   headers=None) -> JSONResponse:
    return JSONResponse({"error": error_body(message, kind, param, code)}, status_code=status,
                        headers=headers)


def shutting_down_error() -> APIError:
    """503 for a request a drain refused or ended: the client should retry (on another replica)."""
    return APIError(503, "The server is shutting down; retry the request", code="shutting_down",
                    kind="server_error", headers={"Retry-After": "1"})


STARTING_RETRY_AFTER_S = 5  # a step shape compiles in seconds to a minute; clients poll at this pace


def warm_up_progress(engine) -> dict | None:
    """{"done": k, "total": n} step shapes compiled while the engine warms up (serve.py listens
    meanwhile), else None (also once the engine has failed: then it is unavailable, not starting)."""
    if not getattr(engine, "warming_up", False) or getattr(engine, "failure", None) is not None:
        return None
    return {"done": engine.warm_up_done, "total": engine.warm_up_total}


def starting_error(progress: dict) -> APIError:
    """503 for a generation request that came before the engine was warm: the client should retry."""
    return APIError(503, f"The server is starting: compiling step shapes {progress['done']} of "
                         f"{progress['total']}; retry in {STARTING_RETRY_AFTER_S} s", code="starting",
                    kind="server_error", headers={"Retry-After": str(STARTING_RETRY_AFTER_S)})


def internal_error_message(request_id: str | None) -> str:
    """What a client sees of a server-side failure: nothing of its cause (that is logged)."""
    return "Internal server error" + (f" (request {request_id})" if request_id else "")


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.kind, exc.headers)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_, exc: InvalidRequestError):
        # SamplingParams.validate() starts its messages with the parameter's name.
        message = str(exc)
        first_word = message.split(" ", 1)[0]
        return error_response(400, message, first_word if first_word in _PARAM_NAMES else None)

    @app.exception_handler(ValidationError)
    @app.exception_handler(RequestValidationError)
    async def _validation(_, exc: ValidationError | RequestValidationError):
        # The first problem only, named by its path (e.g. "messages.0.role"); param is the top-level field.
        first = exc.errors()[0]
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        return error_response(400, f"{'.'.join(loc) or 'body'}: {first.get('msg')}", loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind=kind)

    @app.exception_handler(QueueFullError)
    async def _queue_full(_, exc: QueueFullError):
        # "server_error" is what OpenAI answers when a model is overloaded; clients retry 503s.
        seconds = max(1, math.ceil(exc.retry_after))
        return error_response(503, f"The server is overloaded (its request queue is full); retry in "
                                   f"{seconds} s", code="queue_full", kind="server_error",
                              headers={"Retry-After": str(seconds)})

    @app.exception_handler(ShuttingDownError)
    async def _shutting_down(_, exc: ShuttingDownError):
        error = shutting_down_error()
        return error_response(error.status, error.message, None, error.code, error.kind, error.headers)

    @app.exception_handler(EngineUnavailableError)
    async def _unavailable(_, exc: EngineUnavailableError):
        return error_response(503, f"The engine is unavailable: {exc}", code="engine_unavailable",
                              kind="server_error")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):  # a bug: not the client's doing
        request_id = getattr(request.state, "request_id", None)
        logger.error("unhandled error in %s %s (request %s)", request.method, request.url.path, request_id,
                     exc_info=exc)
        return error_response(500, internal_error_message(request_id), kind="server_error")
