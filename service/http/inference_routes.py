"""The inference routes, in one table: `/v1/classify`, `/v1/classify/batch`, `/v1/embed` and the Open Inference
Protocol's `POST /v2/models/{name}[/versions/{version}]/infer`.

Each `InferenceRoute` holds its path template, its handler, its query model, its body and its answers. The infer
lane (service/http/infer_lane.py) dispatches from this table before FastAPI's router, the OpenAPI document's entries
for these paths are made from it (`openapi_paths`), the request record labels a request by its template, and the
connection refuses an overloaded request from its request line with it (`early_refusal`): a route added here is
served, documented, counted and shed alike, and FastAPI's router never sees these paths.

Why not FastAPI's router: at 32 clients on two cores its work around these routes (matching the path against every
route, solving dependencies, validating the answer once more) was about a fifth of an HTTP worker's CPU
(docs/tail-latency.md).
"""
from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request, Response
from pydantic import BaseModel

from vitserve.service.ground.errors import ServiceError
from vitserve.service.http.errors import openapi_responses
from vitserve.service.http.routes import classify, embed, open_inference
from vitserve.service.http.routes.open_inference import inlined
from vitserve.service.schemas import paths
from vitserve.service.schemas.v1 import BatchResponse, ClassifyResponse, EmbedResponse
from vitserve.service.usecases import pipeline
from vitserve.service.usecases.state import ServiceState

Handler = Callable[[Request, dict[str, str]], Awaitable[Response]]


@dataclass(frozen=True)
class InferenceRoute:
    """One inference route: POST `template`, answered by `handler(request, path_params)`."""

    template: str  # as FastAPI writes a path: the metrics' endpoint label and the OpenAPI document's key
    handler: Handler
    tag: str
    query: type[BaseModel] | None  # the query parameters' model (None: the route takes none)
    body: dict[str, Any]  # the OpenAPI requestBody
    answer: dict[str, Any]  # the OpenAPI 200 response
    errors: tuple[int, ...]
    protocol: bool = False  # errors in the Open Inference Protocol's shape
    operation: str = ""  # the OpenAPI operation's name (default: the handler's)
    pattern: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # `{name}`: one path segment, already percent-decoded in scope["path"] (as FastAPI matches it)
        regex = re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", self.template)
        object.__setattr__(self, "pattern", re.compile(regex))

    @property
    def operation_id(self) -> str:
        """As FastAPI names an operation (`generate_unique_id`): generated clients keep their method names."""
        return re.sub(r"\W", "_", f"{self.operation or self.handler.__name__}{self.template}") + "_post"


def _json_answer(model: type[BaseModel], description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": inlined(model.model_json_schema(mode="serialization"))}}}


ROUTES: tuple[InferenceRoute, ...] = (
    InferenceRoute(paths.CLASSIFY, classify.classify, "classify", classify.ClassifyQuery, classify.IMAGE_BODY,
                   _json_answer(ClassifyResponse, "The top classes and the map"),
                   (400, 404, 408, 413, 415, 422, 429, 500, 503, 504)),
    InferenceRoute(paths.CLASSIFY_BATCH, classify.classify_batch, "classify", classify.ClassifyQuery,
                   classify.BATCH_BODY, _json_answer(BatchResponse, "One result or one error per file"),
                   (400, 404, 408, 413, 415, 422, 429, 503, 504)),
    InferenceRoute(paths.EMBED, embed.embed, "classify", embed.EmbedQuery, embed.EMBED_BODY,
                   _json_answer(EmbedResponse, "One embedding or one error per image"),
                   (400, 404, 408, 413, 415, 422, 429, 503, 504)),
    *(InferenceRoute(template, open_inference.infer, "open inference protocol (v2)", None,
                     open_inference.INFER_BODY, open_inference.INFER_ANSWER,
                     (400, 404, 408, 413, 415, 429, 500, 503, 504), protocol=True, operation=operation)
      for template, operation in ((paths.INFER, "infer"), (paths.VERSIONED_INFER, "versioned_infer"))),
)
# the table serves what admission and the statistics count: one list of paths (service/schemas/paths.py)
assert tuple(route.template for route in ROUTES) == paths.HTTP_INFERENCE
_BY_PATH = {route.template: route for route in ROUTES if "{" not in route.template}
_TEMPLATED = [route for route in ROUTES if "{" in route.template]


def match(path: str) -> tuple[InferenceRoute, dict[str, str]] | None:
    """The inference route `path` names, with its path parameters; None for a path the router takes."""
    route = _BY_PATH.get(path)
    if route is not None:
        return route, {}
    if not path.startswith(paths.PROTOCOL_MODELS):  # the common case of every other route: one prefix check
        return None
    for route in _TEMPLATED:
        found = route.pattern.fullmatch(path)
        if found is not None:
            return route, found.groupdict()
    return None


def template_of(method: str, path: str) -> str | None:
    """The template of the inference route a request line asks for (POST only), or None."""
    found = match(path) if method == "POST" else None
    return None if found is None else found[0].template


def early_refusal(state: ServiceState) -> Callable[[bytes, str], tuple[ServiceError, int] | None]:
    """For the connection (service/http/connection.py), from the request line alone: the error and Retry-After
    seconds of an inference request that admission would refuse now, or None."""
    def refuse(method: bytes, path: str) -> tuple[ServiceError, int] | None:
        found = match(path) if method == b"POST" else None
        if found is None:
            return None
        route, params = found
        return pipeline.would_refuse(state, route.template, params.get("name"))
    return refuse


def openapi_paths() -> dict[str, dict[str, Any]]:
    """The OpenAPI document's path items of the inference routes, from the table."""
    return {route.template: {"post": _operation(route)} for route in ROUTES}


def _operation(route: InferenceRoute) -> dict[str, Any]:
    doc = (route.handler.__doc__ or "").strip()
    summary, _, description = doc.partition("\n\n")
    operation: dict[str, Any] = {"tags": [route.tag], "summary": " ".join(summary.split()),
                                 "operationId": route.operation_id,
                                 "parameters": [*_path_parameters(route), *_query_parameters(route.query)],
                                 "requestBody": route.body,
                                 "responses": {"200": route.answer, **{str(code): answer for code, answer in
                                                                       openapi_responses(*route.errors,
                                                                                         protocol=route.protocol)
                                                                       .items()}}}
    if description:
        operation["description"] = " ".join(description.split())
    return operation


def _path_parameters(route: InferenceRoute) -> list[dict[str, Any]]:
    return [{"name": name, "in": "path", "required": True, "schema": {"type": "string", "title": name.title()}}
            for name in route.pattern.groupindex]


def _query_parameters(query: type[BaseModel] | None) -> list[dict[str, Any]]:
    """Each field of the query model as a query parameter, named by its alias, as FastAPI documents a model."""
    if query is None:
        return []
    schema = inlined(query.model_json_schema())
    required = set(schema.get("required", []))
    parameters = []
    for name, prop in schema["properties"].items():
        prop = dict(prop)
        parameter = {"name": name, "in": "query", "required": name in required}
        if "description" in prop:
            parameter["description"] = prop.pop("description")
        if prop.pop("deprecated", False):
            parameter["deprecated"] = True
        parameters.append({**parameter, "schema": prop})
    return parameters
