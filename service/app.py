"""`create_app(settings)` builds the FastAPI app and nothing else: heavy state (the ONNX session, the
batcher, the thread pool) is made in the lifespan and reached through `service.state` dependencies.
"""
from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from service.errors import ServiceError, error_body, error_headers, status_code
from service.metrics import ServiceMetrics
from service.routes import classify, open_inference, operations
from service.runtime import InferenceModel
from service.settings import Settings
from service.state import ServiceState

log = logging.getLogger("vitserve.app")


@asynccontextmanager
async def lifespan(app: FastAPI):
    state: ServiceState = app.state.service
    await state.start()
    try:
        # lifespan state: uvicorn hands it to each connection, whose protocol refuses overload early with it
        yield {"early_refusal": state.early_refusal}
    finally:
        await state.stop()


def create_app(settings: Settings | None = None, *, model: InferenceModel | None = None,
               metrics: ServiceMetrics | None = None) -> FastAPI:
    """The app; `model` replaces loading `settings.model_path` (tests wrap the real model with it)."""
    from vitserve import __version__
    settings = settings or Settings()
    metrics = metrics or ServiceMetrics()
    app = FastAPI(title="vitserve", version=__version__, lifespan=lifespan,
                  description="Vision Transformer classification with attention-rollout maps, dynamically batched "
                              "onto ONNX Runtime.")
    app.state.service = ServiceState(settings, metrics, model=model)
    install_error_handlers(app, metrics)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    for router in (classify.router, open_inference.router, operations.router):
        app.include_router(router)
    return app


def app_from_env() -> FastAPI:
    """uvicorn's factory for worker processes: settings from the `VITSERVE_*` environment."""
    from service.cli import configure_logging
    settings = Settings()
    configure_logging(settings.log_level)
    return create_app(settings)


def install_error_handlers(app: FastAPI, metrics: ServiceMetrics) -> None:
    """Every error response in one shape; `service.errors.STATUS_CODES` decides the status."""
    def respond(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
        metrics.rejected_request(code)
        return JSONResponse(error_body(code, message), status_code=status, headers=headers)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> JSONResponse:
        status = status_code(exc)
        return respond(status, exc.code, str(exc), error_headers(status, request.app.state.service.retry_after_s()))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return respond(422, "invalid_parameter", problems)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, f"http_{exc.status_code}")
        return respond(exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return respond(500, "internal_error", "internal server error", error_headers(500, 0))


class RequestMetricsMiddleware:
    """Pure ASGI middleware: requests in flight, and each request's duration by route template and status."""

    def __init__(self, app, metrics: ServiceMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status, started = 500, time.perf_counter()

        async def send_with_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.request_started()
        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            self.metrics.request_done(endpoint, status, time.perf_counter() - started)
