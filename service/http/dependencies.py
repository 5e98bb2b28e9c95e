"""How HTTP reaches the serving state: FastAPI's dependencies (the state; the ready state; the admitted state,
in flight until the route returns), the path helpers that read an inference request's route and model from its
request line, and the connection's early refusal built from them.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi import Request

from vitserve.service.core.state import ServiceState
from vitserve.service.ground.errors import NotReady, ServiceError


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
        return None if route is None else state.refusal(route, model_in_path(path))
    return refuse


async def get_ready_state(request: Request) -> ServiceState:
    """Dependency: the serving state once warmed up; 503 before that and while shutting down."""
    return ready_state(request)


def ready_state(request: Request) -> ServiceState:
    """The serving state once warmed up; NotReady (503) before that and while shutting down."""
    state: ServiceState = request.app.state.service
    if not state.ready:
        raise NotReady("the model is not ready (warming up or shutting down)")
    return state


def requested_model(request: Request) -> str | None:
    """The model a request names, in its path or its `model` query parameter."""
    return request.path_params.get("name") or request.query_params.get("model")


def admit(request: Request) -> ServiceState:
    """The ready state, once this request is admitted (429 at once otherwise, before its body is read); it counts
    as in flight until the caller's `state.admission.leave()`, when its route returns. The queued work it is
    measured against is its own model's: an overloaded big model does not refuse a small one's requests."""
    state = ready_state(request)
    model = requested_model(request)
    request.state.model_name = model  # for Retry-After, should the request be refused later on
    state.admission.enter(state.engine.predicted_wait_s(model), state.settings.queue_wait_limit_s)
    return state


async def get_admitted_state(request: Request) -> AsyncIterator[ServiceState]:
    """Dependency of the inference routes: `admit`, and in flight until the route returns."""
    state = admit(request)
    try:
        yield state
    finally:
        state.admission.leave()
