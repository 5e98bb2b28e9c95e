"""The Open Inference Protocol's infer route, taken before FastAPI's router.

`POST /v2/models/{name}[/versions/{version}]/infer` is the answer a loaded server gives most. At 32 clients on two
cores, FastAPI's own work around it (matching the path against every route, solving the route's dependencies,
its exception and exit-stack layers) was about a fifth of an HTTP worker's CPU, and the workers' CPU per answer
is what kept the tensor paths behind Triton's (docs/tail-latency.md). This pure ASGI middleware sits inside the
app's middleware (request metrics, tracing, the handler of last resort for a bug's 500) and in front of the
router: it takes those requests and does what the routes' dependencies do, with the same functions (the API
key, readiness, admission), then the routes' own work (`open_inference.infer_response`). Errors are answered as
the app's handlers answer them (service/http/errors.py). Everything else, and every route's documentation, is
FastAPI's as before.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi import Request

from service.core.errors import ServiceError
from service.core.metrics import ServiceMetrics
from service.core.state import admit
from service.http.access import require_api_key
from service.http.errors import service_error_answer
from service.http.routes.open_inference import infer_response

# FastAPI's `{name}` and `{version}`: one path segment each, already percent-decoded in scope["path"]
_INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")


@dataclass(frozen=True)
class RouteTemplate:
    """What the request-metrics middleware reads of the route a request matched (scope["route"].path)."""

    path: str


_UNVERSIONED = RouteTemplate("/v2/models/{name}/infer")
_VERSIONED = RouteTemplate("/v2/models/{name}/versions/{version}/infer")


class InferenceLane:
    def __init__(self, app, metrics: ServiceMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        match = _INFER_PATH.fullmatch(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" \
            else None
        if match is None:
            return await self.app(scope, receive, send)
        name, version = match.groups()
        scope["route"] = _VERSIONED if version is not None else _UNVERSIONED  # as routing sets it
        scope["path_params"] = {"name": name} if version is None else {"name": name, "version": version}
        request = Request(scope, receive, send)
        try:
            response = await self._answer(request, name, version)
        except ServiceError as error:
            response = service_error_answer(request, self.metrics, error)
        await response(scope, receive, send)

    @staticmethod
    async def _answer(request: Request, name: str, version: str | None):
        await require_api_key(request)
        state = admit(request)
        try:
            return await infer_response(request, state, name, version)
        finally:
            state.admission.leave()
