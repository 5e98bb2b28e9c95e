"""The inference routes a loaded server answers most, taken before FastAPI's router: the Open Inference
Protocol's `POST /v2/models/{name}[/versions/{version}]/infer` and `POST /v1/classify`.

At 32 clients on two cores, FastAPI's own work around them (matching the path against every route, solving the
route's dependencies, validating the answer against its response model, its exception and exit-stack layers)
was about a fifth of an HTTP worker's CPU (docs/tail-latency.md), and made /v1/classify cost an HTTP worker 30%
more CPU than the same image sent to /v2 (docs/results/bench-paths.md). This pure ASGI middleware sits inside the app's
middleware (request metrics, tracing, the handler of last resort for a bug's 500) and in front of the router: it
takes those requests and does what the routes' dependencies do, with the same functions (the API key, the query
parameters' pydantic model, readiness, admission), then the routes' own work (`open_inference.infer_response`,
`classify.classify_response`). Errors are answered as the app's handlers answer them (service/http/errors.py).
Everything else, and every route's documentation, is FastAPI's as before.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi import Request
from fastapi.exceptions import RequestValidationError

from vitserve.service.ground.errors import ServiceError
from vitserve.service.ground.metrics import ServiceMetrics
from vitserve.service.http.dependencies import admit
from vitserve.service.http.access import require_api_key
from vitserve.service.http.errors import service_error_answer, validation_error_answer
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


class InferenceLane:
    def __init__(self, app, metrics: ServiceMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        answer = self._lane_for(scope) if scope["type"] == "http" and scope["method"] == "POST" else None
        if answer is None:
            return await self.app(scope, receive, send)
        request = Request(scope, receive, send)
        try:
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
    state = admit(request)
    try:
        return await infer_response(request, state, name, version)
    finally:
        state.admission.leave()


async def _classify(request: Request):
    await require_api_key(request)
    params = classify_params(request)
    state = admit(request)
    try:
        return await classify_response(request, state, params)
    finally:
        state.admission.leave()
