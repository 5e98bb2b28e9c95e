"""How HTTP reaches the serving state and enters the call pipeline (service/usecases/pipeline.py): FastAPI's
dependencies of the model and health routes (the state; the ready state), `admitted_call` (the one way every HTTP
inference request is admitted: the handlers of the inference route table, service/http/inference_routes.py, enter
it), `query_parameters` (a query checked against its model as FastAPI checks one), and the model an inference path
names.
"""
from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import TypeVar

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from vitserve.service.ground.errors import InvalidParameter
from vitserve.service.schemas.paths import model_in_protocol_path
from vitserve.service.usecases import pipeline
from vitserve.service.usecases.pipeline import Call
from vitserve.service.usecases.state import ServiceState

Q = TypeVar("Q", bound=BaseModel)


# The dependencies are coroutines, though they wait for nothing: FastAPI runs a plain function dependency in its
# thread pool, a thread hop per request (docs/tail-latency.md).
async def get_state(request: Request) -> ServiceState:
    """Dependency: the serving state, whether or not it is ready (health and metadata routes)."""
    return request.app.state.service


def model_in_path(path: str) -> str | None:
    """The model an inference path names (/v2/models/NAME/...), or None (/v1: a query parameter, or the only
    model)."""
    return model_in_protocol_path(path)


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
                          watch_client=lambda: client_gone(request),
                          received=request.scope.get("state", {}).get("received"))


def json_answer(call: Call, document: BaseModel) -> Response:
    """An inference call's JSON answer, serialised by the model that made it (a framework would validate it once
    more first); its `encode` stage timed."""
    started = time.perf_counter()
    body = document.model_dump_json()
    call.stages.append(("encode", time.perf_counter() - started))
    return answer(call, body)


def answer(call: Call, body: bytes | str, media_type: str | None = "application/json",
           headers: dict[str, str] | None = None) -> Response:
    """An inference call's answer; with the server_timing setting, its stages as a Server-Timing header (W3C: each
    `name;dur=MILLISECONDS`, then `total` from when the request came in)."""
    if call.state.settings.server_timing:
        total = time.perf_counter() - call.received
        stages = ", ".join(f"{name};dur={seconds * 1000:.3f}" for name, seconds in call.stages)
        headers = {**(headers or {}), "Server-Timing": f"{stages}, total;dur={total * 1000:.3f}"}
    return Response(body, media_type=media_type, headers=headers)


async def client_gone(request: Request) -> None:
    """Completes when the client hangs up; only once its body has been read, when the next ASGI message can only
    be the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def query_parameters(request: Request, model: type[Q]) -> Q:
    """The request's query parameters, checked against `model` as FastAPI checks a query model (a 422 naming each
    problem by its place, `query.top_k`). A parameter of the model given twice is refused: it would be read from its
    last copy, an invalid first one silently ignored (and a proxy routing by its first copy would disagree)."""
    query = request.query_params
    if len(query.multi_items()) > len(query):  # some parameter repeats: is it one of the model's?
        names = [field.alias or name for name, field in model.model_fields.items()]
        repeated = sorted(name for name in names if len(query.getlist(name)) > 1)
        if repeated:
            raise InvalidParameter(f"query parameters given more than once: {', '.join(repeated)}")
    try:
        return model.model_validate(dict(query))
    except ValidationError as e:
        raise RequestValidationError([{**error, "loc": ("query", *error["loc"])} for error in e.errors()]) from None
