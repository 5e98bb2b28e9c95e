"""POST /v1/embed: image(s) -> embedding vectors, for search and de-duplication, from the model being served.

The vector is the class token after the final LayerNorm, before the head (the `embedding` output of every file the
exporter writes), computed on the fast path in the same batches as /v1/classify's images. One image as the raw body
(an image content type), or several as multipart `file` fields (up to max_batch_files): one result or one error per
image, in order. The route is in the inference route table (service/http/inference_routes.py), which dispatches to
`embed` and documents it.
"""
from __future__ import annotations

import logging
import time

from fastapi import Request, Response
from pydantic import Field

from vitserve.service.ground.model_names import MAX_NAME_CHARS, MAX_VERSION_CHARS
from vitserve.service.http.access import require_api_key
from vitserve.service.http.dependencies import admitted_call, json_answer, query_parameters
from vitserve.service.http.routes.classify import BudgetQuery, upload
from vitserve.service.http.routes.uploads import image_body, media_type
from vitserve.service.schemas.v1 import EmbedResponse, ErrorResponse, ImageEmbedding, ResizePolicy
from vitserve.service.usecases import inference
from vitserve.service.usecases.inference import EmbedOptions

log = logging.getLogger("vitserve.embed")

EMBED_BODY = image_body(several=True)


class EmbedQuery(BudgetQuery):
    normalize: bool = Field(False, description="L2-normalise each vector (cosine similarity becomes a dot product)")
    resize: ResizePolicy = Field("fit", description="fit: scale and centre-crop to the trained size; native: keep "
                                                    "aspect, snap to patches")
    model: str | None = Field(None, max_length=MAX_NAME_CHARS, description="the model to run; default: the only "
                                                                           "model")
    version: str | None = Field(None, max_length=MAX_VERSION_CHARS, description="the model's version; default: its "
                                                                                "newest ready version")


async def embed(request: Request, path: dict[str, str]) -> Response:
    """The embedding of each image: the raw body, or each multipart `file` field in order."""
    await require_api_key(request)
    query = query_parameters(request, EmbedQuery)
    with admitted_call(request) as call:
        handle = call.route(query.model, query.version)
        inference.check_embeds(handle)
        options = EmbedOptions(query.resize, query.normalize, query.max_tokens, query.degrade != "never")
        files = await upload(request, call, max_files=call.state.settings.max_batch_files)
        results: list[ImageEmbedding | ErrorResponse]
        if media_type(request) != "multipart/form-data":
            # one image as the body: its error is the request's, with its status, as on /v1/classify
            results = [await inference.embed_image(call, files[0], options)]
        else:
            results = await inference.embed_images(call, files, options)
            log.debug("embedded %d images in %.1f ms", len(files), (time.perf_counter() - call.started) * 1000)
    answer = EmbedResponse(model=inference.model_ref(handle.name, handle.version), results=results)
    return json_answer(call, answer)
