"""The door of the inference routes, before FastAPI's router: a pure ASGI middleware that answers every path of the
inference route table (service/http/inference_routes.py) by the table's handler, and passes every other request on.

It sits inside the app's middleware (request record, tracing, compression, the handler of last resort for a bug's
500), so an inference answer is counted, traced and compressed as any other. For each request it sets what routing
sets (the path parameters, and the route's template for the request record) and answers errors as the app's
handlers answer them (service/http/errors.py); another method on these paths is 405, as the router says it.
"""
from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError

from vitserve.service.ground.errors import ServiceError
from vitserve.service.ground.metrics import ServiceMetrics
from vitserve.service.http import inference_routes
from vitserve.service.http.errors import error_answer, service_error_answer, validation_error_answer


class InferenceLane:
    def __init__(self, app, metrics: ServiceMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        found = inference_routes.match(scope["path"]) if scope["type"] == "http" else None
        if found is None:
            return await self.app(scope, receive, send)
        route, path_params = found
        scope["path_params"] = path_params
        scope.setdefault("state", {})["endpoint"] = route.template  # the request record's label
        request = Request(scope, receive, send)
        try:
            if scope["method"] != "POST":
                response = error_answer(request, self.metrics, 405, "method_not_allowed", "Method Not Allowed",
                                        {"Allow": "POST"})
            else:
                response = await route.handler(request, path_params)
        except ServiceError as error:
            response = service_error_answer(request, self.metrics, error)
        except RequestValidationError as error:
            response = validation_error_answer(request, self.metrics, error)
        await response(scope, receive, send)
