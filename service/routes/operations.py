"""GET /v1/model (what is served, and on which execution provider) and GET /metrics."""
from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Response

from service.errors import openapi_responses
from service.schemas import ModelCard
from service.state import ServiceState, get_state

router = APIRouter(tags=["operations"])


@router.get("/v1/model", response_model=ModelCard, responses=openapi_responses(503))
async def model_card(state: Annotated[ServiceState, Depends(get_state)]) -> ModelCard:
    info, s = state.info, state.settings
    return ModelCard(name=info.name, version=info.version, labels=info.labels, image_height=info.image_size[0],
                     image_width=info.image_size[1], patch_size=info.patch_size, channels=info.channels,
                     mean=info.mean, std=info.std, precision=info.precision, provider=state.engine.provider,
                     opset=info.opset, exporter=info.exporter, weights_sha256=info.weights_sha256,
                     test_accuracy=info.test_accuracy, maps=list(info.maps), max_batch_size=s.max_batch_size,
                     max_native_tokens=s.max_native_tokens)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus exposition format"}})
async def metrics(state: Annotated[ServiceState, Depends(get_state)]) -> Response:
    body, content_type = await asyncio.to_thread(state.metrics.render)  # file reads in multiprocess mode
    return Response(body, media_type=content_type)
