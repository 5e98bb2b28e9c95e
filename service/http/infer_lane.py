"""The one door of the inference routes a loaded server answers most: the Open Inference Protocol's
`POST /v2/models/{name}[/versions/{version}]/infer` and `POST /v1/classify`, taken before FastAPI's router.

At 32 clients on two cores, FastAPI's own work around them (matching the path against every route, solving the
route's dependencies, validating the answer against its response model, its exception and exit-stack layers)
was about a fifth of an HTTP worker's CPU (docs/tail-latency.md), and made /v1/classify cost an HTTP worker 30%
more CPU than the same image sent to /v2 (docs/results/bench-paths.md). This pure ASGI middleware sits inside the
app's middleware (request metrics, tracing, compression, the handler of last resort for a bug's 500) and in front
of the router. For each request it checks the API key and (for classify) the query parameters' pydantic model,
enters the call pipeline as every inference transport does (`dependencies.admitted_call`), and runs the route
module's own work (`open_inference.infer_response`, `classify.classify_response`). Errors are answered as the
app's handlers answer them (service/http/errors.py); another method on these paths is 405, as the router says it.

The router has no route for these paths: `documented_routes()` are their declarations for the OpenAPI document
only (`service/app.py openapi_document`), made from the same pydantic models the lane validates with.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi import Request
from fastapi.exceptions import RequestValidationError

from vitserve.service.ground.errors import ServiceError
from vitserve.service.ground.metrics import ServiceMetrics
from vitserve.service.http.access import require_api_key
from vitserve.service.http.dependencies import admitted_call
from vitserve.service.http.errors import error_answer, service_error_answer, validation_error_answer
from vitserve.service.http.routes import classify, open_inference
from vitserve.service.http.routes.classify import classify_params, classify_response
from vitserve.service.http.routes.open_inference import infer_response

# FastAPI's `{name}` and `{version}`: one path segment each, already percent-decoded in scope["path"]
_INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")
_CLASSIFY_PATH = "/v1/classify"


@dataclass(frozen=True)
class RouteTemplate:
    """What the request-metrics middleware reads of the route a request matched (scope["route"].path)."""

    path: str


_UNVERSIONED = RouteTemplate("/v2/models/{name}/infer")
_VERSIONED = RouteTemplate("/v2/models/{name}/versions/{version}/infer")
_CLASSIFY = RouteTemplate(_CLASSIFY_PATH)


def documented_routes() -> list:
    """The lane's paths as FastAPI declares them, for the OpenAPI document: never routed to."""
    return [*classify.lane_documentation.routes, *open_inference.lane_documentation.routes]


class InferenceLane:
    def __init__(self, app, metrics: ServiceMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        answer = self._lane_for(scope) if scope["type"] == "http" else None
        if answer is None:
            return await self.app(scope, receive, send)
        request = Request(scope, receive, send)
        try:
            if scope["method"] != "POST":
                response = error_answer(request, self.metrics, 405, "method_not_allowed", "Method Not Allowed",
                                        {"Allow": "POST"})
            else:
                response = await answer(request)
        except ServiceError as error:
            response = service_error_answer(request, self.metrics, error)
        except RequestValidationError as error:
            response = validation_error_answer(request, self.metrics, error)
        await response(scope, receive, send)

    @staticmethod
    def _lane_for(scope):
        """The lane's answer for this request, with the route's template and parameters set as routing sets them;
        None for a request the router takes."""
        path = scope["path"]
        if path == _CLASSIFY_PATH:
            scope["route"], scope["path_params"] = _CLASSIFY, {}
            return _classify
        match = _INFER_PATH.fullmatch(path)
        if match is None:
            return None
        name, version = match.groups()
        scope["route"] = _VERSIONED if version is not None else _UNVERSIONED
        scope["path_params"] = {"name": name} if version is None else {"name": name, "version": version}
        return lambda request: _infer(request, name, version)


async def _infer(request: Request, name: str, version: str | None):
    await require_api_key(request)
    with admitted_call(request) as call:
        return await infer_response(request, call, name, version)


async def _classify(request: Request):
    await require_api_key(request)
    params = classify_params(request)
    with admitted_call(request) as call:
        return await classify_response(request, call, params)
