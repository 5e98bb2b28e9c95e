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
from vitserve.service.core.pipeline import Call
from vitserve.service.core.preprocess import ResizePolicy
from vitserve.service.ground.errors import ServiceError
from vitserve.service.http.access import require_api_key
from vitserve.service.http.dependencies import get_admitted_call
from vitserve.service.http.errors import openapi_responses
from vitserve.service.http.routes.classify import upload
from vitserve.service.http.routes.uploads import each_file
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
                call: Annotated[Call, Depends(get_admitted_call)]) -> EmbedResponse:
    """The embedding of each image: the raw body, or each multipart `file` field in order."""
    handle = call.route(query.model, query.version)
    inference.check_embeds(handle)
    files = await upload(request, call, max_files=call.state.settings.max_batch_files)
    ref = inference.model_ref(handle.name, handle.version)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        # one image as the body: its error is the request's, with its status, as on /v1/classify
        if isinstance(files[0], ServiceError):
            raise files[0]
        return EmbedResponse(model=ref, results=[await call.run(inference.embed(call, files[0], query.resize,
                                                                                query.normalize))])

    work = each_file(call.state, files, lambda data: inference.embed(call, data, query.resize, query.normalize),
                     "an embed request")
    results = await call.run(work)
    log.debug("embedded %d images in %.1f ms", len(files), (time.perf_counter() - call.started) * 1000)
    return EmbedResponse(model=ref, results=results)
