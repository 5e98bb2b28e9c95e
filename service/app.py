"""`create_app(settings)` builds the FastAPI app and nothing else: heavy state (the ONNX session, the
batcher, the thread pool) is made in the lifespan and reached through `service.usecases.state` dependencies.
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from vitserve.service.engine import Engine
from vitserve.service.engine.inference_model import InferenceModel
from vitserve.service.ground import tracing
from vitserve.service.ground.errors import ServiceError
from vitserve.service.ground.memory import freeze_startup_objects
from vitserve.service.ground.metrics import ServiceMetrics
from vitserve.service.ground.request_record import RequestRecord
from vitserve.service.ground.settings import Settings
from vitserve.service.http import infer_lane, inference_routes
from vitserve.service.http.compression import ResponseCompression
from vitserve.service.http.errors import error_answer, error_headers, service_error_answer, validation_error_answer
from vitserve.service.http.routes import open_inference, operations, repository, web
from vitserve.service.usecases.state import ServiceState

log = logging.getLogger("vitserve.app")


@asynccontextmanager
async def lifespan(app: FastAPI):
    state: ServiceState = app.state.service
    await state.start()
    grpc_front_end = None
    try:
        if app.state.serve_grpc and state.settings.engine == "inline":
            # Each worker has its own model here: one that took connections while it warmed up would answer 503 to
            # what the others, ready, answer, after a readiness probe that reached one of them said the server was
            # ready. uvicorn listens once the lifespan has started, so until then the others take every connection.
            await state.engine.warmed_up()
        if app.state.serve_grpc and state.settings.grpc_port:
            from vitserve.service.grpc.server import GrpcFrontEnd  # grpcio: only where gRPC is served
            grpc_front_end = GrpcFrontEnd(state)
            await grpc_front_end.start()
        freeze_startup_objects()
        # lifespan state: uvicorn hands it to each connection, whose protocol refuses overload early with it
        # and the count of its connections, which it keeps
        yield {"early_refusal": inference_routes.early_refusal(state),
               "count_connection": state.admission.count_connection}
    finally:
        if grpc_front_end is not None:
            await grpc_front_end.stop()
        await state.stop()
        if app.state.serve_grpc:  # the server's own process ends here: flush its last spans
            tracing.shutdown()


def create_app(settings: Settings | None = None, *, model: InferenceModel | None = None,
               metrics: ServiceMetrics | None = None, serve_grpc: bool = False) -> FastAPI:
    """The app; `model` replaces loading `settings.model_path` (tests wrap the real model with it): a repository
    of that one model. With `serve_grpc` (what `vitserve serve` runs), its lifespan also serves gRPC on
    settings.grpc_port (service/grpc/): an app embedded elsewhere opens no port of its own."""
    from vitserve import __version__
    settings = settings or Settings()
    metrics = metrics or ServiceMetrics()
    # /docs is the web router's, Swagger UI with its files from this install (FastAPI's loads them from a CDN)
    app = ServiceApp(title="vitserve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                     description="Vision Transformer classification with attention-rollout maps, dynamically batched "
                                 "onto ONNX Runtime.")
    app.state.service = ServiceState(settings, metrics, engine_for(settings, metrics, model))
    app.state.serve_grpc = serve_grpc
    install_error_handlers(app, metrics)
    # innermost: inside the request record's middleware
    app.add_middleware(infer_lane.InferenceLane, metrics=metrics)
    # around the lane, so its answers are compressed too; inside the metrics, which then count its time
    app.add_middleware(ResponseCompression, min_bytes=settings.compress_min_bytes,
                       max_bytes=settings.compress_max_bytes)
    app.add_middleware(RequestRecordMiddleware, metrics=metrics, traced=tracing.enabled())
    # the web page and the docs last: routing an API request never looks at their routes
    # the inference routes are the lane's (service/http/inference_routes.py): the router never sees them
    for router in (repository.router, open_inference.router, operations.router, web.router):
        app.include_router(router)
    return app


class ServiceApp(FastAPI):
    """FastAPI with the service's OpenAPI document (`openapi_document`)."""

    def openapi(self) -> dict[str, Any]:
        return openapi_document(self)


def openapi_document(app: FastAPI) -> dict:
    """The inference route table's paths (service/http/inference_routes.py), then FastAPI's document of the
    router's, without the 422 `HTTPValidationError` it adds to every route with a path parameter: a path parameter
    here is a plain string that cannot fail, and the service never sends that shape (each route declares the errors
    it really answers, in its protocol's shape)."""
    if app.openapi_schema is None:
        spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        spec["paths"] = {**inference_routes.openapi_paths(), **spec["paths"]}
        for methods in spec["paths"].values():
            for operation in methods.values():
                answer = operation["responses"].get("422", {})
                if "HTTPValidationError" in str(answer):
                    del operation["responses"]["422"]
        for unused in ("HTTPValidationError", "ValidationError"):
            spec.get("components", {}).get("schemas", {}).pop(unused, None)
        app.openapi_schema = spec
    return app.openapi_schema


def engine_for(settings: Settings, metrics: ServiceMetrics, model: InferenceModel | None) -> Engine:
    """The engine process at `settings.engine_addresses` (a frontend started by `vitserve serve`), or the model
    registry in this process."""
    from vitserve.service.engine.local import LocalEngine
    from vitserve.service.engine.registry import ModelRegistry, model_source
    if settings.engine_addresses and model is None:
        from vitserve.service.engine.remote import RemoteEngine  # pyzmq: only for a frontend
        remote = RemoteEngine(settings, metrics)
        if not settings.lone_request_path or settings.model_repository is not None:
            return remote
        from vitserve.service.engine.lone_path import LonePathEngine
        from vitserve.service.engine.runtime import load_engine_model
        # the engine process's own rule for the model's threads (a light model: one), so both answer alike
        local = LocalEngine(settings, metrics, ModelRegistry(model_source(settings), settings, metrics,
                                                             loader=load_engine_model))
        return LonePathEngine(remote, local, metrics)
    return LocalEngine(settings, metrics, ModelRegistry(model_source(settings, model), settings, metrics))


def app_from_env() -> FastAPI:
    """uvicorn's factory for worker processes: settings from the `VITSERVE_*` environment."""
    from vitserve.service.ground.logs import configure_logging
    settings = Settings()
    configure_logging(settings.log_level)
    tracing.configure(settings)
    return create_app(settings, serve_grpc=True)


def install_error_handlers(app: FastAPI, metrics: ServiceMetrics) -> None:
    """Every error response in its protocol's shape (service/http/errors.py); `STATUS_CODES` decides the status."""
    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return service_error_answer(request, metrics, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_answer(request, metrics, exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, f"http_{exc.status_code}")
        return error_answer(request, metrics, exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_answer(request, metrics, 500, "internal_error", "internal server error", error_headers(500, 0))


class RequestRecordMiddleware:
    """Pure ASGI middleware, the outermost: each HTTP request's record (service/ground/request_record.py): in flight,
    its duration by route template, status and the version that ran it; with tracing on (`traced`), an inference
    request (never health, metrics or the web page) also gets a SERVER span, the child of the caller's W3C
    `traceparent` header when it sent one. Off, tracing costs nothing per request."""

    def __init__(self, app, metrics: ServiceMetrics, traced: bool = False):
        self.app, self.metrics, self.traced = app, metrics, traced

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = inference_routes.template_of(scope["method"], scope["path"]) if self.traced else None
        if route is None:
            return await self._recorded(scope, receive, send, None)
        carrier = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]
                   if key in (b"traceparent", b"tracestate")}
        attributes = {"http.request.method": scope["method"], "http.route": route, "url.path": scope["path"][:256]}
        with tracing.server_span(f"{scope['method']} {route}", carrier, attributes) as span:
            await self._recorded(scope, receive, send, span)

    async def _recorded(self, scope, receive, send, span):
        status = 500

        async def send_with_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        record = RequestRecord(self.metrics, span)
        if "state" in scope:  # when the request came in: the first stage of an inference call's (Server-Timing)
            scope["state"]["received"] = record.started
        try:
            await self.app(scope, receive, send_with_status)
        finally:
            state = scope.get("state", {})
            # an inference route's template (the lane's), or the router's route
            endpoint = state.get("endpoint") or getattr(scope.get("route"), "path", None) or "unmatched"
            # the model version the request ran on (set by the call pipeline's routing), if any
            model, version = state.get("served", ("", ""))
            if span is not None:
                span.set_attribute("http.response.status_code", status)
            record.done(endpoint, status, fault=status >= 500, model=model, version=version)
