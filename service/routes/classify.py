"""POST /v1/classify and /v1/classify/batch: image -> top-k classes and an attention-rollout map.

One image's life, top to bottom in `classify_one`: decode (thread pool) -> submit to the batcher ->
encode (top-k, rollout; PNGs in the thread pool).
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
from service.preprocess import PreparedImage, ResizePolicy
from service.routes.uploads import read_files, run_guarded, upload_within
from service.schemas import BatchResponse, ClassifyResponse, ErrorResponse, ModelRef, RolloutFormat, Timing
from service.state import ServiceState, get_admitted_state

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
_ROLLOUT = Query(description="rollout map: grid values, heat-map png, overlay png, or none")
_RESIZE = Query(description="fit: scale and centre-crop to the trained size; native: keep aspect, snap to patches")


class ClassifyParams:
    def __init__(self, request: Request, top_k: Annotated[int, _TOP_K] = 5,
                 rollout: Annotated[RolloutFormat, _ROLLOUT] = "grid", resize: Annotated[ResizePolicy, _RESIZE] = "fit"):
        # A parameter given twice would be read from its last copy, an invalid first one silently ignored.
        repeated = sorted(name for name in ("top_k", "rollout", "resize") if len(request.query_params.getlist(name)) > 1)
        if repeated:
            raise InvalidParameter(f"query parameters given more than once: {', '.join(repeated)}")
        self.top_k, self.rollout, self.resize = top_k, rollout, resize


@router.post("/v1/classify", response_model=ClassifyResponse, openapi_extra=_IMAGE_BODY,
             responses=openapi_responses(400, 408, 413, 415, 422, 429, 500, 503, 504))
async def classify(request: Request, params: Annotated[ClassifyParams, Depends()],
                   state: Annotated[ServiceState, Depends(get_admitted_state)]) -> ClassifyResponse:
    """Classify one image sent as the raw body (image content type) or as multipart field `file`."""
    started, deadline = time.perf_counter(), Deadline.after(state.settings.request_timeout_s)
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
    keep_source = params.rollout == "overlay"
    prepared, preprocess_s = await state.preprocess(data, params.resize, keep_source)
    result = await state.engine.submit(prepared.pixels, deadline.remaining())
    logits, rollout = result.output
    (predictions, rollout_body), postprocess_s = await _encode(state, prepared, logits, rollout, params)
    state.metrics.image_stages(preprocess_s, postprocess_s)
    timing = Timing(queue=_ms(result.queue_s), preprocess=_ms(preprocess_s), inference=_ms(result.inference_s),
                    total=_ms(time.perf_counter() - started))
    return ClassifyResponse(model=_model_ref(state), predictions=predictions, rollout=rollout_body, timing_ms=timing)


async def _encode(state: ServiceState, prepared: PreparedImage, logits, rollout, params: ClassifyParams):
    args = (state.info.labels, prepared, logits, rollout, params.top_k, params.rollout)
    if params.rollout in ("png", "overlay"):  # PNG encoding is real work: keep it off the event loop
        return await state.in_pool(postprocess.encode_result, *args)
    started = time.perf_counter()
    return postprocess.encode_result(*args), time.perf_counter() - started


def _model_ref(state: ServiceState) -> ModelRef:
    return ModelRef(name=state.info.name, version=state.info.version)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)
