"""Domain errors and the one table that maps them to HTTP.

Everything below the routes raises these plain exceptions; only `STATUS_CODES` and `error_response` know
about HTTP. An error response on /v1 is `{"error": {"code": ..., "message": ...}}`; on the Open Inference
Protocol's /v2 it is the protocol's `{"error": "<message>"}` (with vitserve's `code` beside it), and the
protocol has no 422: an invalid request is a 400 there.
"""
from __future__ import annotations


class ServiceError(Exception):
    """Base of every error the service answers with; `code` is the stable, machine-readable name."""

    code = "internal_error"


class ModelLoadError(ServiceError):
    """The model file is missing, unreadable, not ONNX, or lacks the vitserve metadata (startup only)."""

    code = "model_load_failed"


class ImageDecodeError(ServiceError):
    code = "invalid_image"


class PayloadTooLarge(ServiceError):
    code = "payload_too_large"


class ImageTooLarge(ServiceError):
    """More pixels than the limit: rejected from the header, before the pixels are decoded."""

    code = "image_too_large"


class UnsupportedMediaType(ServiceError):
    code = "unsupported_media_type"


class InvalidParameter(ServiceError):
    code = "invalid_parameter"


class ModelNotFound(ServiceError):
    code = "model_not_found"


class InspectionNotStored(ServiceError):
    """The version's file carries no Figure 7 numbers (exported with --inspection-images 0, or before they existed)."""

    code = "inspection_not_stored"


class InvalidModelName(ServiceError):
    """A model name or version that cannot name anything in a repository ('..', '/', ...): refused before it
    touches a path."""

    code = "invalid_model_name"


class ModelUnavailable(ServiceError):
    """The model exists but no version of it is ready (loading, unloading, or its load failed)."""

    code = "model_unavailable"


class VersionRetired(ServiceError):
    """The version a request was routed to was unloaded before the request reached it; it never ran (an
    unpinned request is routed again)."""

    code = "version_retired"


class RepositoryError(ServiceError):
    """The repository or a model's config.json is not usable (its text says why)."""

    code = "repository_error"


class RepositoryControlDisabled(ServiceError):
    """The repository API is off in this control mode."""

    code = "repository_control_disabled"


class Unauthorized(ServiceError):
    """No credentials where a key is required."""

    code = "unauthorized"


class Forbidden(ServiceError):
    """Credentials that do not match the key."""

    code = "forbidden"


class QueueFullError(ServiceError):
    """Too much work waiting; the client should come back after `Retry-After` (the error layer adds it)."""

    code = "queue_full"


class Overloaded(ServiceError):
    """Admission refused before the body was read: too many requests in flight, or more queued work than the
    deadline allows. The client should come back after `Retry-After`."""

    code = "overloaded"


class NotReady(ServiceError):
    code = "not_ready"


class MalformedRequest(ServiceError):
    """Not HTTP the parser accepts (a garbage request line, a bad chunk size, Content-Length with chunked...)."""

    code = "invalid_request"


class HeadersTooLarge(ServiceError):
    """The request line and headers are over the size or count limit (refused by the connection, service/http/connection.py)."""

    code = "headers_too_large"


class UriTooLong(ServiceError):
    code = "uri_too_long"


class RequestTimeout(ServiceError):
    """The client sent its request too slowly (the upload outlasted the request's deadline)."""

    code = "request_timeout"


class DeadlineExceeded(ServiceError):
    code = "deadline_exceeded"


class ClientDisconnected(ServiceError):
    """The client went away before its answer was ready; its work was dropped (logged as 499, never sent)."""

    code = "client_disconnected"


class InferenceError(ServiceError):
    """The ONNX Runtime call for a batch failed; every item of that batch gets this error."""

    code = "inference_failed"


# The single domain-error -> status-code table (most specific class first is not needed: exact types).
STATUS_CODES: dict[type[ServiceError], int] = {
    ImageDecodeError: 400,
    MalformedRequest: 400,
    ModelNotFound: 404,
    InspectionNotStored: 404,
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


def is_protocol_path(path: str) -> bool:
    """Whether `path` belongs to the Open Inference Protocol (KServe v2), whose errors have their own shape."""
    return path == "/v2" or path.startswith("/v2/")


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


def openapi_responses(*codes: int, protocol: bool = False) -> dict[int, dict]:
    """The `responses=` of a route: each listed status with its meaning and the error schema it really sends
    (the Open Inference Protocol's on /v2, `protocol=True`)."""
    schema = _PROTOCOL_ERROR_SCHEMA if protocol else _V1_ERROR_SCHEMA
    described = {**STATUS_DESCRIPTIONS, **_PROTOCOL_DESCRIPTIONS} if protocol else STATUS_DESCRIPTIONS
    return {c: {"description": described[c], "content": {"application/json": {"schema": schema}}} for c in codes}
