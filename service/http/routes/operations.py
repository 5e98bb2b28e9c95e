"""GET /v1/models (what is served), /v1/model (one version's card, and its execution provider),
/v1/models/{name}/inspect (what the model learned: the paper's Figure 7), /v1/models/{name}/shadow (how far its
shadow version agrees), /metrics."""
from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Response

from vitserve.service.ground.model_names import MAX_NAME_CHARS, MAX_VERSION_CHARS
from vitserve.service.http.access import require_api_key
from vitserve.service.http.dependencies import get_state
from vitserve.service.http.errors import openapi_responses
from vitserve.service.schemas.v1 import ModelCard, ModelList, ModelVersionState, ShadowReport
from vitserve.service.usecases import control
from vitserve.service.usecases.state import ServiceState

router = APIRouter(tags=["operations"])


@router.get("/v1/models", response_model=ModelList, dependencies=[Depends(require_api_key)],
            responses=openapi_responses(401, 403, 503))
async def models(state: Annotated[ServiceState, Depends(get_state)]) -> ModelList:
    """Every model and version this server knows, with its state; the ready ones first under each model."""
    entries = await control.index(state)
    return ModelList(models=[ModelVersionState(name=e.name, version=e.version, state=e.state or "UNAVAILABLE",
                                               reason=e.reason or ("not loaded" if not e.version else ""))
                             for e in entries])


@router.get("/v1/model", response_model=ModelCard, dependencies=[Depends(require_api_key)],
            responses=openapi_responses(400, 401, 403, 404, 503))
async def model_card(state: Annotated[ServiceState, Depends(get_state)],
                     model: Annotated[str | None, Query(max_length=MAX_NAME_CHARS)] = None,
                     version: Annotated[str | None, Query(max_length=MAX_VERSION_CHARS)] = None) -> ModelCard:
    """A model version's card (default: the only model, its newest ready version)."""
    return control.card(state, model, version)


@router.get("/v1/models/{name}/inspect", dependencies=[Depends(require_api_key)],
            responses=openapi_responses(400, 401, 403, 404, 503))
async def inspect_model(state: Annotated[ServiceState, Depends(get_state)],
                        name: Annotated[str, Path(max_length=MAX_NAME_CHARS)],
                        version: Annotated[str | None, Query(max_length=MAX_VERSION_CHARS)] = None) -> dict:
    """What the model version learned, as the paper's Figure 7 shows it: the principal components of its
    patch-embedding filters (a hybrid's stem filters) with their explained variance, the cosine similarity of its
    position embeddings, and the mean attention distance of each head at each depth, in pixels. Computed by
    `vitserve export` from the float32 weights and stored in the file (default: the newest ready version)."""
    return await state.inspections.get(state.settings, control.version(state, name, version))


@router.get("/v1/models/{name}/shadow", response_model=ShadowReport, dependencies=[Depends(require_api_key)],
            responses=openapi_responses(401, 403, 404, 503))
async def shadow_report(state: Annotated[ServiceState, Depends(get_state)],
                        name: Annotated[str, Path(max_length=MAX_NAME_CHARS)]) -> ShadowReport:
    """How far model `name`'s shadow version agrees with the versions that answer, over the copies compared since
    its config named it: top-1 agreement, the mean Jensen-Shannon divergence of the served probabilities, the mean
    rank correlation of the rollout maps, the shadow's latency, and the copies dropped or failed (docs/shadow.md).
    404 when the model has no shadow version."""
    return ShadowReport.model_validate(await control.shadow_report(state, name))


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus exposition format"}})
async def metrics(state: Annotated[ServiceState, Depends(get_state)]) -> Response:
    live = control.live_versions(state)  # an unloaded version's series are not exported
    body, content_type = await asyncio.to_thread(state.metrics.render, live)  # file reads in multiprocess mode
    return Response(body, media_type=content_type)
