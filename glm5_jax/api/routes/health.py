"""GET /health and GET /metrics: for load balancers, supervisors and scrapers (no API key: they sit
next to the server, docs/serving.md). /health: 200 {"status": "ok"} when serving; 503 with "starting"
(and the warm-up's progress), "draining" or "unavailable" (and the engine's failure) otherwise."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from glm5_jax.api.errors import STARTING_RETRY_AFTER_S, warm_up_progress
from glm5_jax.api.metrics import CONTENT_TYPE
from glm5_jax.api.state import Shared

router = APIRouter()


@router.get("/health")
async def health(state: Shared):
    engine = state.engine
    if engine.failure is not None:  # for load balancers and supervisors: take this one out
        return JSONResponse({"status": "unavailable", "reason": engine.failure}, status_code=503)
    if getattr(engine, "draining", False):
        return JSONResponse({"status": "draining"}, status_code=503)
    if (progress := warm_up_progress(engine)) is not None:  # serve.py listens while it compiles
        body = {"status": "starting", "progress": progress, "compile_count": engine.compile_count}
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(STARTING_RETRY_AFTER_S)})
    # The compile count shows recompilation in steady state (it should stop growing).
    return {"status": "ok", "compile_count": engine.compile_count}


@router.get("/metrics")
async def prometheus_metrics(state: Shared):
    state.metrics.compile_count.set(state.engine.compile_count)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
