"""POST /v1/classify and /v1/classify/batch: image -> top-k classes and an explanation map.

HTTP's side of a classify call: the query parameters (`ClassifyQuery`, then `ClassifyParams`, which makes the use
case's `ClassifyOptions`), the upload, and the answer; the call itself is the pipeline's (service/usecases/pipeline.py,
service/usecases/inference.py `classify`). Both routes are in the inference route table
(service/http/inference_routes.py), which dispatches to `classify` and `classify_batch` and documents them.
"""
from __future__ import annotations

from typing import Literal

from fastapi import Request, Response
from pydantic import BaseModel, ConfigDict, Field

from vitserve.artifact import ModelInfo
from vitserve.service.ground.errors import InvalidParameter
from vitserve.service.ground.model_names import MAX_NAME_CHARS, MAX_VERSION_CHARS
from vitserve.service.http.access import require_api_key
from vitserve.service.http.dependencies import admitted_call, json_answer, query_parameters
from vitserve.service.http.routes.uploads import image_body, read_files, upload_within
from vitserve.service.schemas.inference_protocol import MAX_TOKENS
from vitserve.service.schemas.v1 import BatchResponse, MapFormat, MapKind, ResizePolicy, RolloutFormat
from vitserve.service.usecases import inference
from vitserve.service.usecases.explanations import MAX_TARGET_CHARS, relevance_target
from vitserve.service.usecases.inference import ClassifyOptions
from vitserve.service.usecases.pipeline import Call

IMAGE_BODY = image_body(several=False)
BATCH_BODY = image_body(several=True, raw=False)
MAX_TOP_K = 1000  # above it a 422, before any work: every class of an ImageNet-1k model


class BudgetQuery(BaseModel):
    """The token budget a /v1 inference request asks for (docs/token-budgets.md): /v1/classify's, /v1/classify/batch's
    and /v1/embed's query parameters."""

    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description=(
        "the token budget: answer at the most accurate input grid of at most this many tokens the model serves "
        "(default: the full budget; below its cheapest: 422); the answer's `budget` says what was used"))
    degrade: Literal["load", "never"] = Field("load", description=(
        "load: under load the server may answer at a cheaper budget; never: refuse (429) rather than answer "
        "cheaper than asked"))


class ClassifyQuery(BudgetQuery):
    """The query parameters of /v1/classify and /v1/classify/batch, validated by `query_parameters` and documented
    by the route table."""

    model_config = ConfigDict(extra="ignore")
    top_k: int = Field(5, ge=1, le=MAX_TOP_K, description=(
        "classes to return, at most the model's class count: a top_k above it gets every class, and the answer's "
        "`warnings` says so"))
    map_kind: MapKind | None = Field(None, alias="map", description=(
        "rollout: attention rollout, how attention flows from the class token (the same map for every class); "
        "relevance: what each patch added to one class's score, signed (a backward pass: about 2.6x a rollout "
        "answer served); none"))
    map_format: MapFormat | None = Field(None, description="the map as grid values in [0, 1], a heat-map png, or "
                                                           "the heat-map over the image")
    target: str | None = Field(None, max_length=MAX_TARGET_CHARS, description=(
        "map=relevance: the class to explain, an index or a label (default: the top-1)"))
    # Deprecated in the documentation only: pydantic's own `deprecated` warns on every read of the field.
    rollout: RolloutFormat | None = Field(None, json_schema_extra={"deprecated": True}, description=(
        "the older spelling: rollout=F is map=rollout&map_format=F, rollout=none is map=none"))
    resize: ResizePolicy = Field("fit", description="fit: scale and centre-crop to the trained size; native: keep "
                                                    "aspect, snap to patches")
    model: str | None = Field(None, max_length=MAX_NAME_CHARS, description="the model to run (GET /v1/models lists "
                                                                           "them); default: the only model")
    version: str | None = Field(None, max_length=MAX_VERSION_CHARS, description="the model's version; default: its "
                                                                                "newest ready version")


class ClassifyParams:
    def __init__(self, request: Request, query: ClassifyQuery):
        map_kind, map_format = query.map_kind, query.map_format
        if query.rollout is not None:
            if map_kind is not None or map_format is not None:
                raise InvalidParameter("rollout is the older spelling of map and map_format: send one or the other")
            map_kind, map_format = ("none", None) if query.rollout == "none" else ("rollout", query.rollout)
        self.map: MapKind = map_kind or "rollout"
        self.map_format: RolloutFormat = "none" if self.map == "none" else map_format or "grid"
        if query.target is not None and self.map != "relevance":
            raise InvalidParameter("target names the class to explain: it needs map=relevance")
        self.top_k, self.target, self.resize = query.top_k, query.target, query.resize
        self.top_k_asked = "top_k" in query.model_fields_set
        self.max_tokens, self.degrade = query.max_tokens, query.degrade != "never"
        self.model, self.version = query.model, query.version

    def options_for(self, info: ModelInfo) -> ClassifyOptions:
        """The use case's options, the class to explain resolved with the model's labels (before any upload is
        read)."""
        target_index = relevance_target(self.target, info) if self.map == "relevance" else None
        return ClassifyOptions(top_k=self.top_k, top_k_asked=self.top_k_asked, map=self.map,
                               map_format=self.map_format, resize=self.resize, target_index=target_index,
                               max_tokens=self.max_tokens, degrade=self.degrade)


async def classify(request: Request, path: dict[str, str]) -> Response:
    """Classify one image sent as the raw body (image content type) or as multipart field `file`."""
    await require_api_key(request)
    params = ClassifyParams(request, query_parameters(request, ClassifyQuery))
    with admitted_call(request) as call:
        handle = call.route(params.model, params.version)
        options = params.options_for(handle.info)
        files = await upload(request, call, max_files=1)
        answer = await inference.classify_image(call, files[0], options)
    return json_answer(call, answer)


async def classify_batch(request: Request, path: dict[str, str]) -> Response:
    """Classify several `file` fields; one result or one error per file, in order."""
    await require_api_key(request)
    params = ClassifyParams(request, query_parameters(request, ClassifyQuery))
    with admitted_call(request) as call:
        handle = call.route(params.model, params.version)
        options = params.options_for(handle.info)
        files = await upload(request, call, max_files=call.state.settings.max_batch_files)
        results = await inference.classify_images(call, files, options)
    answer = BatchResponse(model=inference.model_ref(handle.name, handle.version), results=results)
    return json_answer(call, answer)


async def upload(request: Request, call: Call, max_files: int) -> list:
    """The request's image files, read within its call's deadline."""
    reading = read_files(request, max_bytes=call.state.settings.max_upload_bytes, max_files=max_files)
    return await upload_within(call, reading)
