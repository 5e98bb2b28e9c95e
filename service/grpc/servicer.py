"""Triton's `GRPCInferenceService` over the same use cases as /v2: every RPC translates its message into the
calls the HTTP routes make (service/usecases/inference.py) and the answer back, so limits, deadlines, admission,
keys and metrics are the same on both transports.

Errors: every `ServiceError` becomes the gRPC status Triton would send for it (`GRPC_CODES`, by its kind; no
HTTP status on the way), its message the details; a refusal for overload is RESOURCE_EXHAUSTED with
`retry-after` (seconds) in the trailing metadata. Keys travel as the `authorization` metadata
(`Bearer KEY`); ServerLive, ServerReady and ServerMetadata stay open, like /v2's health routes.
The RPCs Triton has and vitserve does not (shared memory, trace and log settings) answer UNIMPLEMENTED.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time

import grpc

from vitserve.service.ground import errors, tracing
from vitserve.service.ground.errors import InvalidModelName, InvalidParameter, NotReady, ServiceError
from vitserve.service.ground.model_names import check_name_lengths
from vitserve.service.ground.request_record import RequestRecord
from vitserve.service.grpc import messages
from vitserve.service.grpc.generated import grpc_service_pb2 as pb
from vitserve.service.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from vitserve.service.schemas.inference_protocol import limits_for
from vitserve.service.schemas.model_config import server_document
from vitserve.service.usecases import control, inference, pipeline
from vitserve.service.usecases.keys import check_authorization, check_repository_access
from vitserve.service.usecases.state import ServiceState

log = logging.getLogger("vitserve.grpc")

SERVICE_NAME = "inference.GRPCInferenceService"
StatusCode = grpc.StatusCode
# Each kind of the service's errors (service/ground/errors.py) -> its gRPC status, as Triton maps its errors
# (INVALID_ARG -> INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE, ...). A request over a content limit (pixels, images)
# is INVALID_ARGUMENT: sending it again cannot help, while RESOURCE_EXHAUSTED says "later". Every kind is listed
# (tests/service/test_errors.py): a new kind must choose its code here.
GRPC_CODES: dict[type[ServiceError], grpc.StatusCode] = {
    errors.ServiceError: StatusCode.INTERNAL,
    errors.ModelLoadError: StatusCode.INVALID_ARGUMENT,  # a load asked for through the repository API failed
    errors.ImageDecodeError: StatusCode.INVALID_ARGUMENT,
    errors.PayloadTooLarge: StatusCode.INVALID_ARGUMENT,
    errors.ImageTooLarge: StatusCode.INVALID_ARGUMENT,
    errors.UnsupportedMediaType: StatusCode.INVALID_ARGUMENT,
    errors.InvalidParameter: StatusCode.INVALID_ARGUMENT,
    errors.ModelNotFound: StatusCode.NOT_FOUND,
    errors.InspectionNotStored: StatusCode.NOT_FOUND,
    errors.ShadowNotConfigured: StatusCode.NOT_FOUND,
    errors.InvalidModelName: StatusCode.INVALID_ARGUMENT,
    errors.ModelUnavailable: StatusCode.UNAVAILABLE,
    errors.VersionRetired: StatusCode.UNAVAILABLE,
    errors.RepositoryError: StatusCode.INVALID_ARGUMENT,
    errors.RepositoryControlDisabled: StatusCode.PERMISSION_DENIED,
    errors.Unauthorized: StatusCode.UNAUTHENTICATED,
    errors.Forbidden: StatusCode.PERMISSION_DENIED,
    errors.QueueFullError: StatusCode.RESOURCE_EXHAUSTED,
    errors.Overloaded: StatusCode.RESOURCE_EXHAUSTED,
    errors.NotReady: StatusCode.UNAVAILABLE,
    errors.MalformedRequest: StatusCode.INVALID_ARGUMENT,
    errors.HeadersTooLarge: StatusCode.INVALID_ARGUMENT,
    errors.UriTooLong: StatusCode.INVALID_ARGUMENT,
    errors.RequestTimeout: StatusCode.DEADLINE_EXCEEDED,
    errors.DeadlineExceeded: StatusCode.DEADLINE_EXCEEDED,
    errors.ClientDisconnected: StatusCode.CANCELLED,
    errors.InferenceError: StatusCode.INTERNAL,
    errors.Unimplemented: StatusCode.UNIMPLEMENTED,
}
SERVER_FAULTS = frozenset({StatusCode.INTERNAL, StatusCode.UNKNOWN, StatusCode.DATA_LOSS})
RETRY_AFTER_KEY = "retry-after"  # trailing metadata of RESOURCE_EXHAUSTED: seconds, as HTTP's Retry-After


def grpc_code(error: ServiceError) -> grpc.StatusCode:
    """The code of the error's kind, or of the nearest kind it derives from."""
    return next(GRPC_CODES[kind] for kind in type(error).__mro__ if kind in GRPC_CODES)


def authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else None
    return None


def rpc(*, open_: bool = False, traced: bool = False):
    """An RPC's frame: the api key (unless `open_`), its error as a gRPC status, its duration in
    vitserve_request_duration_seconds{protocol="grpc"} under the RPC's full name and status code, and (`traced`,
    with tracing on) its server span, the child of the `traceparent` metadata when the caller sent one."""
    def wrap(method):
        endpoint = f"/{SERVICE_NAME}/{method.__name__}"

        @functools.wraps(method)
        async def handler(self: InferenceServicer, request, context: grpc.aio.ServicerContext):
            if traced and tracing.enabled():
                carrier = {key: value for key, value in context.invocation_metadata() or ()
                           if key in ("traceparent", "tracestate") and isinstance(value, str)}
                attributes = {"rpc.system": "grpc", "rpc.service": SERVICE_NAME, "rpc.method": method.__name__}
                with tracing.server_span(f"{SERVICE_NAME}/{method.__name__}", carrier, attributes) as span:
                    return await framed(self, request, context, span)
            return await framed(self, request, context, None)

        async def framed(self: InferenceServicer, request, context: grpc.aio.ServicerContext, span):
            state = self.state
            served: dict[str, str] = {}  # the model the call asked for, and the one that answered
            record = RequestRecord(state.metrics, span)
            code, error = StatusCode.OK, None
            try:
                if not open_:
                    check_authorization(authorization(context), state.settings.api_key, "this call")
                answer = await method(self, request, context, served)
                compress_answer(context, answer, state.settings)
                return answer
            except ServiceError as e:
                code, error = grpc_code(e), e
                state.metrics.rejected_request(e.code)
            except asyncio.CancelledError:  # the client cancelled, or its deadline passed
                code = StatusCode.CANCELLED
                raise
            except Exception:
                log.exception("unhandled error in %s", endpoint)
                code, error = StatusCode.INTERNAL, ServiceError("internal server error")
            finally:
                record.done(endpoint, code.name, fault=code in SERVER_FAULTS, model=served.get("name", ""),
                            version=served.get("version", ""), protocol="grpc")
            trailing: tuple[tuple[str, str], ...] = ()
            if code is StatusCode.RESOURCE_EXHAUSTED:
                trailing = ((RETRY_AFTER_KEY, str(pipeline.retry_after_s(state, served.get("requested")))),)
            await context.abort(code, str(error), trailing_metadata=trailing)
        return handler
    return wrap


RESPONSE_COMPRESSIONS = {"none": None, "gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate}


def compress_answer(context: grpc.aio.ServicerContext, answer, settings) -> None:
    """Leave an answer outside the compress_* sizes uncompressed (the same bounds as HTTP's: the CPU one answer
    costs). The server compresses every other one with `grpc_response_compression`, whatever the client's
    grpc-accept-encoding lists (grpcio 1.85's server does not check it: grpcio's and tritonclient's clients list
    gzip and deflate; docs/open-inference-protocol.md). The server's default, not `context.set_compression` per
    call: grpcio 1.85's asyncio server ignored the latter (measured: 5101 bytes on the wire for 5000 zeros either
    way)."""
    if settings.grpc_response_compression != "none" and not (
            settings.compress_min_bytes <= answer.ByteSize() <= settings.compress_max_bytes):
        context.disable_next_message_compression()


def _unimplemented(name: str, why: str):
    """An RPC `InferenceServicer` does not serve, answered UNIMPLEMENTED through `rpc`'s frame."""
    async def unimplemented(self, request, context, served):
        raise errors.Unimplemented(f"{name} is not served by vitserve: {why} (docs/grpc.md)")
    unimplemented.__name__ = unimplemented.__qualname__ = name
    return rpc()(unimplemented)


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, state: ServiceState):
        self.state = state

    # --- health and metadata ---
    @rpc(open_=True)
    async def ServerLive(self, request, context, served) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @rpc(open_=True)
    async def ServerReady(self, request, context, served) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.state.ready)

    @rpc(open_=True)
    async def ServerMetadata(self, request, context, served) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**server_document())

    @rpc()
    async def ModelReady(self, request, context, served) -> pb.ModelReadyResponse:
        """Ready: the version (or, unnamed, a version of the model) is routed to; false while it loads, and for a
        name the server does not serve (as Triton answers)."""
        _check_names(request.name, request.version)
        return pb.ModelReadyResponse(ready=control.is_routed(self.state, request.name, request.version or None))

    @rpc()
    async def ModelMetadata(self, request, context, served) -> pb.ModelMetadataResponse:
        _check_names(request.name, request.version)
        return messages.metadata_response(control.metadata(self.state, request.name, request.version or None))

    @rpc()
    async def ModelConfig(self, request, context, served) -> pb.ModelConfigResponse:
        _check_names(request.name, request.version)
        return messages.config_response(control.configuration(self.state, request.name, request.version or None))

    @rpc()
    async def ModelStatistics(self, request, context, served) -> pb.ModelStatisticsResponse:
        """One model's statistics (every ready version, or the one named); no name: every ready model's."""
        if request.name:
            _check_names(request.name, request.version)
        return messages.statistics_response(await control.statistics(self.state, request.name or None,
                                                                    request.version or None))

    # --- inference ---
    @rpc(traced=True)
    async def ModelInfer(self, request: pb.ModelInferRequest, context, served) -> pb.ModelInferResponse:
        """As POST /v2/models/{name}/infer, through the same call pipeline: admitted first (RESOURCE_EXHAUSTED at
        once when full), routed, its protobuf read into the protocol's call (service/grpc/messages.py, no HTTP
        model on the way), run within the deadline (the server's, shortened by the call's gRPC deadline and its
        `timeout` parameter), and encoded."""
        state = self.state
        _check_names(request.model_name, request.model_version)
        served["requested"] = request.model_name
        with pipeline.admit(state, request.model_name, on_route=lambda n, v: served.update(name=n, version=v),
                            client_seconds_left=context.time_remaining()) as call:
            handle = call.route(request.model_name, request.model_version or None)
            parsed = messages.parsed_from_grpc(request, limits_for(state.settings, handle.info))
            parse_s = time.perf_counter() - call.started
            outcome = await inference.infer(call, parsed, parse_s)
            info = outcome.info
            with outcome.encoding():
                return messages.infer_response(parsed, info.name, info.version, outcome.outputs, info.labels,
                                               outcome.parameters)

    # --- the model repository extension (the admin key; explicit mode for load and unload) ---
    @rpc(open_=True)
    async def RepositoryIndex(self, request, context, served) -> pb.RepositoryIndexResponse:
        self._repository_call(request.repository_name, context, changes=False)
        entries = await control.index(self.state, ready_only=request.ready)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(
            name=e.name, version=e.version or "", state=e.state or "", reason=e.reason or "") for e in entries])

    @rpc(open_=True)
    async def RepositoryModelLoad(self, request, context, served) -> pb.RepositoryModelLoadResponse:
        self._repository_call(request.repository_name, context, changes=True)
        if request.parameters:
            raise InvalidParameter("load parameters (a config override, model files) are not supported: the "
                                   "repository's files and config.json say what is loaded")
        await control.load(self.state, request.model_name)
        return pb.RepositoryModelLoadResponse()

    @rpc(open_=True)
    async def RepositoryModelUnload(self, request, context, served) -> pb.RepositoryModelUnloadResponse:
        self._repository_call(request.repository_name, context, changes=True)
        await control.unload(self.state, request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # --- what Triton has and vitserve does not: UNIMPLEMENTED through the same frame (key, metrics), where the
    # generated base class would raise NotImplementedError and grpcio log its traceback at every call ---
    ModelStreamInfer = _unimplemented("ModelStreamInfer", "its models are not decoupled; use ModelInfer")
    SystemSharedMemoryStatus = _unimplemented("SystemSharedMemoryStatus", "no shared-memory extension")
    SystemSharedMemoryRegister = _unimplemented("SystemSharedMemoryRegister", "no shared-memory extension")
    SystemSharedMemoryUnregister = _unimplemented("SystemSharedMemoryUnregister", "no shared-memory extension")
    CudaSharedMemoryStatus = _unimplemented("CudaSharedMemoryStatus", "no shared-memory extension")
    CudaSharedMemoryRegister = _unimplemented("CudaSharedMemoryRegister", "no shared-memory extension")
    CudaSharedMemoryUnregister = _unimplemented("CudaSharedMemoryUnregister", "no shared-memory extension")
    TraceSetting = _unimplemented("TraceSetting", "tracing is configured at start (docs/tracing.md)")
    LogSettings = _unimplemented("LogSettings", "logging is configured at start (--log-level)")

    # --- helpers ---
    def _repository_call(self, repository_name: str, context, *, changes: bool) -> None:
        check_repository_access(self.state.settings, authorization(context), changes=changes)
        if not self.state.ready:
            raise NotReady("the server is not ready (warming up or shutting down)")
        if repository_name:
            raise InvalidParameter("repository_name: this server has one repository; leave it empty")


def _check_names(name: str, version: str) -> None:
    """A model must be named (gRPC has no path that could name the only one); name and version are held to /v1's
    limits, those of a name the repository can hold, before they reach routing (docs/open-inference-protocol.md)."""
    if not name:
        raise InvalidModelName("name the model (model_name / name): this call has none")
    check_name_lengths(name, version)
