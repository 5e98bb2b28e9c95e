"""How HTTP reaches the serving state and enters the call pipeline (service/core/pipeline.py): FastAPI's
dependencies (the state; the ready state; the admitted call, in flight until the route returns), `admitted_call`
(the one way every HTTP inference request is admitted, by the infer lane and by that dependency), the path helpers
that read an inference request's route and model from its request line, and the connection's early refusal built
from them.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager

from fastapi import Request

from vitserve.service.core import pipeline
from vitserve.service.core.pipeline import Call
from vitserve.service.core.state import ServiceState
from vitserve.service.ground.errors import ServiceError


# The dependencies are coroutines, though they wait for nothing: FastAPI runs a plain function dependency in its
# thread pool, a thread hop per request (docs/tail-latency.md).
async def get_state(request: Request) -> ServiceState:
    """Dependency: the serving state, whether or not it is ready (health and metadata routes)."""
    return request.app.state.service


def inference_route(method: bytes, path: str) -> str | None:
    """The inference route a request line asks for, as the connection sees it (before routing), or None."""
    if method != b"POST":
        return None
    if path in ("/v1/classify", "/v1/classify/batch", "/v1/embed"):
        return path
    if path.startswith("/v2/models/") and path.endswith("/infer"):
        return "/v2/models/{name}/versions/{version}/infer" if "/versions/" in path else "/v2/models/{name}/infer"
    return None


def model_in_path(path: str) -> str | None:
    """The model an inference path names (/v2/models/NAME/...), or None (/v1: a query parameter, or the only
    model)."""
    if path.startswith("/v2/models/"):
        return path.split("/", 4)[3] or None
    return None


def early_refusal(state: ServiceState) -> Callable[[bytes, str], tuple[ServiceError, int] | None]:
    """For the connection (service/http/connection.py), from the request line alone: the error and Retry-After
    seconds of an inference request that admission would refuse now, or None."""
    def refuse(method: bytes, path: str) -> tuple[ServiceError, int] | None:
        route = inference_route(method, path)
        return None if route is None else pipeline.would_refuse(state, route, model_in_path(path))
    return refuse


async def get_ready_state(request: Request) -> ServiceState:
    """Dependency: the serving state once warmed up; 503 before that and while shutting down."""
    return ready_state(request)


def ready_state(request: Request) -> ServiceState:
    """The serving state once warmed up; NotReady (503) before that and while shutting down."""
    state: ServiceState = request.app.state.service
    state.require_ready()
    return state


def requested_model(request: Request) -> str | None:
    """The model a request names, in its path or its `model` query parameter."""
    return request.path_params.get("name") or request.query_params.get("model")


def admitted_call(request: Request) -> AbstractContextManager[Call]:
    """The request's call through the pipeline, once admitted (NotReady or Overloaded at once otherwise, before its
    body is read), in flight until the `with` block ends. The version it is routed to is remembered on the
    request for its metrics and span; the model it names, for Retry-After should it be refused later on."""
    model = requested_model(request)
    request.state.model_name = model

    def remember(name: str, version: str) -> None:
        request.state.served = (name, version)

    return pipeline.admit(request.app.state.service, model, on_route=remember,
                          watch_client=lambda: client_gone(request))


async def client_gone(request: Request) -> None:
    """Completes when the client hangs up; only once its body has been read, when the next ASGI message can only
    be the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def get_admitted_call(request: Request) -> AsyncIterator[Call]:
    """Dependency of the FastAPI inference routes: `admitted_call`, in flight until the route returns."""
    with admitted_call(request) as call:
        yield call
