"""POST /v1/classify and /v1/classify/batch: image -> top-k classes and an explanation map.

One image's life, top to bottom in `classify_one`: decode (thread pool) -> submit to the batcher (with the class
to explain when the map is `relevance`: service/explanations.py) -> encode (top-k, the map; PNGs in the thread
pool).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from service import postprocess
from service.admission import Deadline
from service.errors import InvalidParameter, ServiceError, error_body, openapi_responses
from service.explanations import MAX_TARGET_CHARS, relevance_target
from service.preprocess import PreparedImage, ResizePolicy
from service.routes.uploads import read_files, run_guarded, upload_within
from service.schemas import (BatchResponse, ClassifyResponse, ErrorResponse, ExplainedClass, MapFormat, MapKind,
                             ModelRef, RelevanceGrid, RelevanceImage, RolloutFormat, RolloutGrid, Timing)
from service.state import ServiceState, get_admitted_state
from vitserve.artifact import ModelInfo

router = APIRouter(tags=["classify"])
log = logging.getLogger("vitserve.classify")

_IMAGE_BODY = {"requestBody": {"required": True, "content": {
    "multipart/form-data": {"schema": {"type": "object", "required": ["file"], "properties": {
        "file": {"type": "string", "format": "binary"}}}},
    **{t: {"schema": {"type": "string", "format": "binary"}} for t in
       ("image/jpeg", "image/png", "image/webp", "image/bmp", "image/gif", "image/tiff")}}}}
_BATCH_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file"], "properties": {
        "file": {"type": "array", "items": {"type": "string", "format": "binary"}}}}}}}}


_TOP_K = Query(ge=1, le=1000, description="classes to return (capped at the model's class count)")
_MAP = Query(alias="map", description="rollout: attention rollout, how attention flows from the class token (the "
                                      "same map for every class); relevance: what drove one class's score "
                                      "(gradient-weighted rollout, about 2.5x the compute); none")
_MAP_FORMAT = Query(description="the map as grid values in [0, 1], a heat-map png, or the heat-map over the image")
_TARGET = Query(max_length=MAX_TARGET_CHARS, description="map=relevance: the class to explain, an index or a label "
                                                         "(default: the top-1)")
_ROLLOUT = Query(deprecated=True, description="the older spelling: rollout=F is map=rollout&map_format=F, "
                                              "rollout=none is map=none")
_RESIZE = Query(description="fit: scale and centre-crop to the trained size; native: keep aspect, snap to patches")
_NAMES = ("top_k", "map", "map_format", "target", "rollout", "resize")


class ClassifyParams:
    def __init__(self, request: Request, top_k: Annotated[int, _TOP_K] = 5,
                 map_kind: Annotated[MapKind | None, _MAP] = None,
                 map_format: Annotated[MapFormat | None, _MAP_FORMAT] = None,
                 target: Annotated[str | None, _TARGET] = None,
                 rollout: Annotated[RolloutFormat | None, _ROLLOUT] = None,
                 resize: Annotated[ResizePolicy, _RESIZE] = "fit"):
        # A parameter given twice would be read from its last copy, an invalid first one silently ignored.
        repeated = sorted(name for name in _NAMES if len(request.query_params.getlist(name)) > 1)
        if repeated:
            raise InvalidParameter(f"query parameters given more than once: {', '.join(repeated)}")
        if rollout is not None:
            if map_kind is not None or map_format is not None:
                raise InvalidParameter("rollout is the older spelling of map and map_format: send one or the other")
            map_kind, map_format = ("none", None) if rollout == "none" else ("rollout", rollout)
        self.map: MapKind = map_kind or "rollout"
        self.map_format: RolloutFormat = "none" if self.map == "none" else map_format or "grid"
        if target is not None and self.map != "relevance":
            raise InvalidParameter("target names the class to explain: it needs map=relevance")
        self.top_k, self.target, self.resize = top_k, target, resize
        self.target_index: int | None = None  # set by `check_against`

    def check_against(self, info: ModelInfo) -> None:
        """Resolve the class to explain with the model's labels (before any upload is read)."""
        if self.map == "relevance":
            self.target_index = relevance_target(self.target, info)


@router.post("/v1/classify", response_model=ClassifyResponse, openapi_extra=_IMAGE_BODY,
             responses=openapi_responses(400, 408, 413, 415, 422, 429, 500, 503, 504))
async def classify(request: Request, params: Annotated[ClassifyParams, Depends()],
                   state: Annotated[ServiceState, Depends(get_admitted_state)]) -> ClassifyResponse:
    """Classify one image sent as the raw body (image content type) or as multipart field `file`."""
    started, deadline = time.perf_counter(), Deadline.after(state.settings.request_timeout_s)
    params.check_against(state.info)
    files = await upload(request, state, deadline, max_files=1)
    if isinstance(files[0], ServiceError):
        raise files[0]
    return await run_guarded(request, classify_one(state, files[0], params, started, deadline), deadline,
                             state.stopping)


@router.post("/v1/classify/batch", response_model=BatchResponse, openapi_extra=_BATCH_BODY,
             responses=openapi_responses(408, 413, 415, 422, 429, 503, 504))
async def classify_batch(request: Request, params: Annotated[ClassifyParams, Depends()],
                         state: Annotated[ServiceState, Depends(get_admitted_state)]) -> BatchResponse:
    """Classify several `file` fields; one result or one error per file, in order."""
    started, deadline = time.perf_counter(), Deadline.after(state.settings.request_timeout_s)
    params.check_against(state.info)
    files = await upload(request, state, deadline, max_files=state.settings.max_batch_files)

    async def one(data: bytes | ServiceError) -> ClassifyResponse | ErrorResponse:
        try:
            if isinstance(data, ServiceError):
                raise data
            return await classify_one(state, data, params, started, deadline)
        except ServiceError as e:
            error = e
        except Exception as e:  # a bug shows in this file's answer and the log, never in its neighbours'
            log.exception("unexpected error on one file of a batch")
            error = ServiceError(f"internal error: {type(e).__name__}")
        state.metrics.rejected_request(error.code)
        return ErrorResponse.model_validate(error_body(error.code, str(error)))

    work = asyncio.gather(*(one(f) for f in files))
    results = await run_guarded(request, work, deadline, state.stopping)
    return BatchResponse(model=_model_ref(state), results=results)


async def upload(request: Request, state: ServiceState, deadline: Deadline, max_files: int) -> list:
    """The request's image files, read within its deadline."""
    reading = read_files(request, max_bytes=state.settings.max_upload_bytes, max_files=max_files)
    return await upload_within(request, reading, deadline, state.stopping)


async def classify_one(state: ServiceState, data: bytes, params: ClassifyParams, started: float,
                       deadline: Deadline) -> ClassifyResponse:
    target = params.target_index
    prepared, preprocess_s = await state.preprocess(data, params.resize, params.map_format == "overlay")
    result = await state.engine.submit(prepared.pixels, deadline.remaining(), target)
    logits, rollout, *relevance = result.output  # the relevance path adds the relevance map
    shown = relevance[0] if params.map == "relevance" else rollout
    (predictions, map_body), postprocess_s = await _encode(state, prepared, logits, shown, params)
    state.metrics.image_stages(preprocess_s, postprocess_s)
    timing = Timing(queue=_ms(result.queue_s), preprocess=_ms(preprocess_s), inference=_ms(result.inference_s),
                    total=_ms(time.perf_counter() - started))
    if params.map == "relevance":
        body = _explained(map_body, state.info.labels, logits, target)
        return ClassifyResponse(model=_model_ref(state), predictions=predictions, rollout=None, relevance=body,
                                timing_ms=timing)
    return ClassifyResponse(model=_model_ref(state), predictions=predictions, rollout=map_body, timing_ms=timing)


def _explained(map_body, labels: list[str], logits, target: int) -> RelevanceGrid | RelevanceImage:
    """The relevance map with the class it explains (the top-1 when the client named none)."""
    index = int(logits.argmax()) if target < 0 else target  # the graph's own choice for -1: the arg max
    explained = ExplainedClass(index=index, label=labels[index], score=float(postprocess.softmax(logits)[index]))
    kind = RelevanceGrid if isinstance(map_body, RolloutGrid) else RelevanceImage
    return kind(**map_body.model_dump(), target=explained)


async def _encode(state: ServiceState, prepared: PreparedImage, logits, map_values, params: ClassifyParams):
    args = (state.info.labels, prepared, logits, map_values, params.top_k, params.map_format)
    if params.map_format in ("png", "overlay"):  # PNG encoding is real work: keep it off the event loop
        return await state.in_pool(postprocess.encode_result, *args)
    started = time.perf_counter()
    return postprocess.encode_result(*args), time.perf_counter() - started


def _model_ref(state: ServiceState) -> ModelRef:
    return ModelRef(name=state.info.name, version=state.info.version)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)
