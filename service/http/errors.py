"""Every error answer on HTTP, in its protocol's shape, and the one table that maps the service's errors to HTTP
statuses. The app's exception handlers, the connection's early refusals (service/http/connection.py) and the infer
lane (service/http/infer_lane.py) all answer through these, so an error reads the same whichever path raised it.

An error response on /v1 is `{"error": {"code": ..., "message": ...}}`; on the Open Inference Protocol's /v2 it is
the protocol's `{"error": "<message>"}` (with vitserve's `code` beside it), and the protocol has no 422: an invalid
request is a 400 there.
"""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from vitserve.service.ground.errors import (
    ClientDisconnected,
    DeadlineExceeded,
    Forbidden,
    HeadersTooLarge,
    ImageDecodeError,
    ImageTooLarge,
    InferenceError,
    InspectionNotStored,
    InvalidModelName,
    InvalidParameter,
    MalformedRequest,
    ModelLoadError,
    ModelNotFound,
    ModelUnavailable,
    NotReady,
    Overloaded,
    PayloadTooLarge,
    QueueFullError,
    RepositoryControlDisabled,
    RepositoryError,
    RequestTimeout,
    ServiceError,
    ShadowNotConfigured,
    Unauthorized,
    Unimplemented,
    UnsupportedMediaType,
    UriTooLong,
    VersionRetired,
)
from vitserve.service.ground.metrics import ServiceMetrics
from vitserve.service.schemas.paths import is_protocol_path
from vitserve.service.usecases.pipeline import retry_after_s

# The single domain-error -> status-code table (most specific class first is not needed: exact types).
STATUS_CODES: dict[type[ServiceError], int] = {
    ImageDecodeError: 400,
    MalformedRequest: 400,
    ModelNotFound: 404,
    InspectionNotStored: 404,
    ShadowNotConfigured: 404,
    InvalidModelName: 400,
    ModelLoadError: 400,  # a load asked for through the repository API failed (Triton answers 400 too)
    RepositoryError: 400,
    RepositoryControlDisabled: 403,
    Unauthorized: 401,
    Forbidden: 403,
    PayloadTooLarge: 413,
    ImageTooLarge: 413,
    UnsupportedMediaType: 415,
    RequestTimeout: 408,
    UriTooLong: 414,
    HeadersTooLarge: 431,
    InvalidParameter: 422,
    QueueFullError: 429,
    Overloaded: 429,
    ClientDisconnected: 499,  # nginx's convention; only ever seen in logs and metrics
    InferenceError: 500,
    ServiceError: 500,
    Unimplemented: 501,
    NotReady: 503,
    ModelUnavailable: 503,
    VersionRetired: 503,
    DeadlineExceeded: 504,
}

# For OpenAPI: what each status means, shared by every route's `responses`.
STATUS_DESCRIPTIONS = {
    400: "Undecodable or corrupt image, an invalid model name, or a model load that failed",
    401: "No credentials where the server requires a key (Authorization: Bearer KEY)",
    403: "Wrong key, or the repository API is off in this control mode",
    404: "No model (or version) with that name, or no inspection stored in its file",
    413: "Too many bytes, pixels or files",
    408: "The request was sent too slowly",
    414: "Request line too long",
    415: "Unsupported media type",
    422: "Invalid parameters",
    431: "Too many or too large headers",
    429: "Overloaded or queue full; retry after the Retry-After header's seconds",
    500: "Inference failed",
    503: "Not ready (warming up, loading or shutting down)",
    504: "Deadline exceeded (decoding, queueing, inference and rendering together)",
}


def status_code(exc: ServiceError) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]
    return 500


def error_body(code: str, message: str) -> dict:
    return {"error": {"code": code, "message": message}}


def error_response(path: str, status: int, code: str, message: str) -> tuple[int, dict]:
    """The status and body of an error answered on `path`, in its protocol's shape."""
    if is_protocol_path(path):
        return (400 if status == 422 else status), {"error": message, "code": code}
    return status, error_body(code, message)


# Statuses that tell the client to come back later, with the Retry-After header (RFC 9110, section 10.2.3).
RETRY_LATER_STATUSES = frozenset({429})
# Statuses after which the connection is closed, and the response says so: the request was not read to its
# end (408), or the server's state for it is unknown (500). A client that reuses the connection would lose
# its next request.
CLOSE_CONNECTION_STATUSES = frozenset({408, 500})


def error_headers(status: int, retry_after_s: int) -> dict[str, str]:
    headers = {"Retry-After": str(retry_after_s)} if status in RETRY_LATER_STATUSES else {}
    if status == 401:  # RFC 9110, section 11.6.1: a 401 says which scheme it wants
        headers["WWW-Authenticate"] = 'Bearer realm="vitserve"'

    if status in CLOSE_CONNECTION_STATUSES:
        headers["Connection"] = "close"
    return headers


_V1_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["code", "message"], "properties": {
        "code": {"type": "string"}, "message": {"type": "string"}}}}}
_PROTOCOL_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {
    "error": {"type": "string", "description": "what went wrong"},
    "code": {"type": "string", "description": "vitserve's stable name for the error (as on /v1)"}}}
_PROTOCOL_DESCRIPTIONS = {400: "Malformed or invalid inference request, or an undecodable image"}


# Answered by the connection (service/http/connection.py) before any route, on every path, in its protocol's shape
CONNECTION_STATUSES = (414, 431)


def openapi_responses(*codes: int, protocol: bool = False) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route: each listed status, and the connection's own, with its meaning and the error
    schema it really sends (the Open Inference Protocol's on /v2, `protocol=True`)."""
    schema = _PROTOCOL_ERROR_SCHEMA if protocol else _V1_ERROR_SCHEMA
    described = {**STATUS_DESCRIPTIONS, **_PROTOCOL_DESCRIPTIONS} if protocol else STATUS_DESCRIPTIONS
    return {c: {"description": described[c], "content": {"application/json": {"schema": schema}}}
            for c in sorted({*codes, *CONNECTION_STATUSES})}



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
    headers = error_headers(status, retry_after_s(request.app.state.service, model))
    return error_answer(request, metrics, status, exc.code, str(exc), headers)


def validation_error_answer(request: Request, metrics: ServiceMetrics, exc: RequestValidationError) -> JSONResponse:
    """A parameter FastAPI's (or the same pydantic model's) validation refused: 422, naming each problem."""
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
    return error_answer(request, metrics, 422, "invalid_parameter", problems)
