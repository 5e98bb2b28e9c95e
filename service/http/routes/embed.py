"""POST /v1/embed: image(s) -> embedding vectors, for search and de-duplication, from the model being served.

The vector is the class token after the final LayerNorm, before the head (the `embedding` output of files exported
since issue #42), computed on the fast path in the same batches as /v1/classify's images. One image as the raw body
(an image content type), or several as multipart `file` fields (up to max_batch_files): one result or one error per
image, in order.
"""
from __future__ import annotations

import logging
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field

from vitserve.service.core import inference
from vitserve.service.core.preprocess import ResizePolicy
from vitserve.service.core.state import ServiceState
from vitserve.service.ground.deadlines import Deadline
from vitserve.service.ground.errors import InvalidParameter, ServiceError
from vitserve.service.http.access import require_api_key
from vitserve.service.http.dependencies import get_admitted_state
from vitserve.service.http.errors import openapi_responses
from vitserve.service.http.routes.classify import upload
from vitserve.service.http.routes.uploads import each_file, run_guarded
from vitserve.service.protocols.schemas import EmbedResponse

router = APIRouter(tags=["classify"], dependencies=[Depends(require_api_key)])
log = logging.getLogger("vitserve.embed")

_EMBED_BODY = {"requestBody": {"required": True, "content": {
    "multipart/form-data": {"schema": {"type": "object", "required": ["file"], "properties": {
        "file": {"type": "array", "items": {"type": "string", "format": "binary"}}}}},
    **{t: {"schema": {"type": "string", "format": "binary"}} for t in
       ("image/jpeg", "image/png", "image/webp", "image/bmp", "image/gif", "image/tiff")}}}}


class EmbedQuery(BaseModel):
    normalize: bool = Field(False, description="L2-normalise each vector (cosine similarity becomes a dot product)")
    resize: ResizePolicy = Field("fit", description="fit: scale and centre-crop to the trained size; native: keep "
                                                    "aspect, snap to patches")
    model: str | None = Field(None, max_length=64, description="the model to run; default: the only model")
    version: str | None = Field(None, max_length=20, description="the model's version; default: its newest ready "
                                                                 "version")


@router.post("/v1/embed", response_model=EmbedResponse, openapi_extra=_EMBED_BODY,
             responses=openapi_responses(400, 404, 408, 413, 415, 422, 429, 503, 504))
async def embed(request: Request, query: Annotated[EmbedQuery, Query()],
                state: Annotated[ServiceState, Depends(get_admitted_state)]) -> EmbedResponse:
    """The embedding of each image: the raw body, or each multipart `file` field in order."""
    started, deadline = time.perf_counter(), Deadline.after(state.settings.request_timeout_s)
    handle = inference.route(state, query.model, query.version, request)
    if not handle.info.embedding_size:  # refused before the upload is read
        raise InvalidParameter(f"{handle.name} {handle.version} has no embedding output: its file was exported "
                               f"before embeddings existed (export it again with vitserve export)")
    files = await upload(request, state, deadline, max_files=state.settings.max_batch_files)
    ref = inference.model_ref(handle.name, handle.version)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        # one image as the body: its error is the request's, with its status, as on /v1/classify
        if isinstance(files[0], ServiceError):
            raise files[0]
        work = inference.embed_image(state, handle, files[0], query.resize, deadline, query.normalize)
        return EmbedResponse(model=ref, results=[await run_guarded(request, work, deadline, state.stopping)])

    work = each_file(state, files, lambda data: inference.embed_image(state, handle, data, query.resize, deadline,
                                                                     query.normalize), "an embed request")
    results = await run_guarded(request, work, deadline, state.stopping)
    log.debug("embedded %d images in %.1f ms", len(files), (time.perf_counter() - started) * 1000)
    return EmbedResponse(model=ref, results=results)
