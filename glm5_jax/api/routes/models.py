"""GET /v1/models: the served model id and its aliases."""

from __future__ import annotations

from fastapi import APIRouter

from glm5_jax.api.state import Shared

router = APIRouter()


@router.get("/v1/models")
async def models(state: Shared):
    # Aliases are listed as models of their own whose "root" is the canonical id.
    return {"object": "list", "data": [{"id": name, "object": "model", "created": state.created,
                                        "owned_by": "glm5-jax", "root": state.model_id}
                                       for name in state.names]}
