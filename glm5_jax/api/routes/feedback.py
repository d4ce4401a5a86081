"""POST /v1/feedback: rates a recorded answer (404 when the server keeps no feedback log)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from glm5_jax.api.errors import APIError
from glm5_jax.api.feedback import FeedbackRequest, answer_feedback
from glm5_jax.api.state import Shared

router = APIRouter()


@router.post("/v1/feedback")
async def feedback(request: Request, state: Shared):
    if state.feedback_log is None:
        raise APIError(404, "This server does not collect feedback: start serve.py with --feedback-dir "
                            "DIR to rate answers with POST /v1/feedback", code="feedback_disabled")
    state.admit(request).settle(0)
    return await answer_feedback(state.feedback_log, await state.parse(request, FeedbackRequest))
