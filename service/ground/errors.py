"""The service's errors: a closed list of kinds, each with a stable `code`, and nothing about any transport.

Every layer raises these plain exceptions. Each transport maps them to its own answers in one place: HTTP's status
table in service/http/errors.py, gRPC's codes in service/grpc/servicer.py, and the engine's wire carries the
`code` (service/engine/messages.py), which `KINDS` turns back into the class on the other side.
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


class ShadowNotConfigured(ServiceError):
    """The model is served but its config.json names no shadow version: there is no comparison to report."""

    code = "shadow_not_configured"


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
    """The request line and headers are over the size or count limit (refused by the connection,
    service/http/connection.py)."""

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


class Unimplemented(ServiceError):
    """A call of the protocol that vitserve does not serve (Triton's shared-memory, trace and log settings RPCs,
    ModelStreamInfer): the client's to handle, never logged as the server's fault."""

    code = "unimplemented"




def _kinds(base: type[ServiceError]) -> list[type[ServiceError]]:
    return [base, *(kind for sub in base.__subclasses__() for kind in _kinds(sub))]


# Every kind by its code: the closed list a transport's table must cover (tests/service/test_errors.py checks).
KINDS: dict[str, type[ServiceError]] = {kind.code: kind for kind in _kinds(ServiceError)}
