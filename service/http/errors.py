"""Every error answer on HTTP, in its protocol's shape: the app's exception handlers and the infer lane
(service/http/infer_lane.py) both answer through these, so an error reads the same whichever path raised it."""
from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from vitserve.service.core.errors import ServiceError, error_headers, error_response, status_code
from vitserve.service.core.metrics import ServiceMetrics


def error_answer(request: Request, metrics: ServiceMetrics, status: int, code: str, message: str,
                 headers: dict | None = None) -> JSONResponse:
    """The error, counted by its code."""
    metrics.rejected_request(code)
    status, body = error_response(request.url.path, status, code, message)
    return JSONResponse(body, status_code=status, headers=headers)


def service_error_answer(request: Request, metrics: ServiceMetrics, exc: ServiceError) -> JSONResponse:
    """A domain error: its status from the error table; a 429's Retry-After is the model's it was refused for."""
    status = status_code(exc)
    model = getattr(request.state, "model_name", None)  # set on admission
    headers = error_headers(status, request.app.state.service.retry_after_s(model))
    return error_answer(request, metrics, status, exc.code, str(exc), headers)


def validation_error_answer(request: Request, metrics: ServiceMetrics, exc: RequestValidationError) -> JSONResponse:
    """A parameter FastAPI's (or the same pydantic model's) validation refused: 422, naming each problem."""
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
    return error_answer(request, metrics, 422, "invalid_parameter", problems)
