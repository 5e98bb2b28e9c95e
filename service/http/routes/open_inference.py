"""The Open Inference Protocol (KServe v2, Triton's HTTP/REST) over the same model and batcher, so that
standard clients (tritonclient, kserve) work unmodified. docs/open-inference-protocol.md is the
conformance table: every endpoint, field and extension, and the test that holds it.

An inference request sends one input: `pixel_values` (normalised FP32, the ONNX input) or `image` (BYTES:
encoded images, decoded and preprocessed here as /v1/classify does), as JSON or as binary tensors, whatever
its Content-Type, gzip/deflate-compressed or not. Each image joins the shared batch queue on its own; the
answer holds `logits` and `rollout` (or the classification extension's top classes), as JSON or binary.
Every route also answers under `/versions/{version}`. Errors are the protocol's `{"error": "..."}`. The infer
routes are in the inference route table (service/http/inference_routes.py), which dispatches to `infer`; the
router holds the others.
"""
from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from vitserve.service.http.access import require_api_key
from vitserve.service.http.dependencies import admitted_call, answer, get_ready_state, get_state
from vitserve.service.http.errors import openapi_responses
from vitserve.service.http.routes.uploads import decode_content, read_raw_body, upload_within
from vitserve.service.schemas import paths
from vitserve.service.schemas.binary_tensors import BINARY_MEDIA_TYPE, HEADER_LENGTH
from vitserve.service.schemas.inference_protocol import (
    ParsedInferRequest,
    encode_response,
    limits_for,
    parse_infer_request,
)
from vitserve.service.schemas.model_config import server_document
from vitserve.service.schemas.v2 import InferRequest, InferResponse, ModelMetadata
from vitserve.service.usecases import control, inference
from vitserve.service.usecases.pipeline import Call
from vitserve.service.usecases.state import ServiceState

router = APIRouter(prefix=paths.PROTOCOL_ROOT, tags=["open inference protocol (v2)"],
                   dependencies=[Depends(require_api_key)])

MODEL = "/models/{name}"
VERSIONED = "/models/{name}/versions/{version}"


def _errors(*codes: int) -> dict:
    return openapi_responses(*codes, protocol=True)


def inlined(schema: dict) -> dict:
    """A model's JSON schema with its `$defs` written in place: in an OpenAPI operation a `#/$defs/...` reference
    would point into the OpenAPI document, where those definitions are not."""
    definitions = schema.pop("$defs", {})

    def resolve(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(definitions[node["$ref"].rsplit("/", 1)[-1]])
            return {key: resolve(value) for key, value in node.items()}
        return [resolve(value) for value in node] if isinstance(node, list) else node
    return resolve(schema)


# The infer route reads its own body (to cap it as it streams in), so its schema is declared here for /docs.
_BINARY_BODY = {"type": "string", "format": "binary", "description": f"the JSON request, then the binary tensors; "
                                                                     f"the {HEADER_LENGTH} header says where the "
                                                                     f"JSON ends"}
INFER_BODY = {"required": True, "content": {
    "application/json": {"schema": inlined(InferRequest.model_json_schema())},
    BINARY_MEDIA_TYPE: {"schema": _BINARY_BODY}}}
INFER_ANSWER = {"description": "The outputs, as JSON, or (binary outputs) JSON followed by their bytes",
                "content": {"application/json": {"schema": inlined(InferResponse.model_json_schema())},
                            BINARY_MEDIA_TYPE: {"schema": _BINARY_BODY}}}


@router.get("")
async def server_metadata() -> dict:
    return server_document()


@router.get("/health/live")
@router.head("/health/live")
async def live() -> dict:
    return {"live": True}


@router.get("/health/ready", responses=_errors(503))
@router.head("/health/ready", responses=_errors(503))
async def ready(state: Annotated[ServiceState, Depends(get_state)]) -> dict:
    state.require_ready()
    return {"ready": True}


# Before `/models/{name}`, which would take "stats" for a model's name.
@router.get("/models/stats", responses=_errors(503))
async def all_statistics(state: Annotated[ServiceState, Depends(get_state)]) -> dict:
    """Triton's statistics extension for every ready model version."""
    return {"model_stats": await control.statistics(state, None, None)}


# Every model route is also served under /versions/{version}: a pair of thin routes (so that the OpenAPI document
# declares each path's own parameters) over one function.
@router.get(MODEL, response_model=ModelMetadata, responses=_errors(404, 503))
async def metadata(name: str, state: Annotated[ServiceState, Depends(get_state)]) -> ModelMetadata:
    return control.metadata(state, name, None)


@router.get(VERSIONED, response_model=ModelMetadata, responses=_errors(404, 503))
async def versioned_metadata(name: str, version: str,
                             state: Annotated[ServiceState, Depends(get_state)]) -> ModelMetadata:
    return control.metadata(state, name, version)


@router.get(MODEL + "/ready", responses=_errors(404, 503))
@router.head(MODEL + "/ready", responses=_errors(404, 503))
async def model_ready(name: str, state: Annotated[ServiceState, Depends(get_ready_state)]) -> dict:
    control.version(state, name)
    return {"name": name, "ready": True}


@router.get(VERSIONED + "/ready", responses=_errors(404, 503))
@router.head(VERSIONED + "/ready", responses=_errors(404, 503))
async def versioned_model_ready(name: str, version: str,
                                state: Annotated[ServiceState, Depends(get_ready_state)]) -> dict:
    control.version(state, name, version)
    return {"name": name, "ready": True}


@router.get(MODEL + "/config", responses=_errors(404, 503))
async def config(name: str, state: Annotated[ServiceState, Depends(get_state)]) -> dict:
    """Triton's model configuration extension: the model's tensors and this server's batching settings."""
    return control.configuration(state, name, None)


@router.get(VERSIONED + "/config", responses=_errors(404, 503))
async def versioned_config(name: str, version: str, state: Annotated[ServiceState, Depends(get_state)]) -> dict:
    return control.configuration(state, name, version)


@router.get(MODEL + "/stats", responses=_errors(404, 503))
async def statistics(name: str, state: Annotated[ServiceState, Depends(get_state)]) -> dict:
    """Triton's statistics extension: this process's counts and durations (see service/schemas/statistics.py)."""
    return {"model_stats": await control.statistics(state, name, None)}


@router.get(VERSIONED + "/stats", responses=_errors(404, 503))
async def versioned_statistics(name: str, version: str, state: Annotated[ServiceState, Depends(get_state)]) -> dict:
    return {"model_stats": await control.statistics(state, name, version)}


async def infer(request: Request, path: dict[str, str]) -> Response:
    """Run `pixel_values` (B, C, H, W), normalised FP32, or `image` (B encoded images); return `logits` (B, K)
    and `rollout` (B, H/P, W/P), or the top classes of `logits` (classification extension).

    The body is read as it streams in (up to `max_json_body_bytes`, or `max_binary_body_bytes` with
    binary tensors), decompressed if its Content-Encoding says so, and parsed whatever its Content-Type
    (tritonclient sends none, or application/octet-stream). Also under `/versions/{version}`."""
    await require_api_key(request)
    with admitted_call(request) as call:
        call.route(path["name"], path.get("version"))
        parsed, parse_s = await _read_request(request, call)
        outcome = await inference.infer(call, parsed, parse_s)
        info = outcome.info
        with outcome.encoding():
            body, headers = encode_response(parsed, info.name, info.version, outcome.outputs, info.labels,
                                            outcome.parameters)
    return answer(call, body, None, headers)


async def _read_request(request: Request, call: Call) -> tuple[ParsedInferRequest, float]:
    """The routed call's body, read within its limit and deadline, decompressed and parsed; and the parse's
    seconds."""
    state = call.state
    s = state.settings
    header_length = request.headers.get(HEADER_LENGTH)
    limit = s.max_binary_body_bytes if header_length is not None else s.max_json_body_bytes
    body = await upload_within(call, read_raw_body(request, limit))
    started = time.perf_counter()
    encoding = request.headers.get("content-encoding")
    if encoding:  # inflating megabytes is real work: off the event loop
        body, _ = await state.images.run(decode_content, body, encoding, limit)
    return parse_infer_request(body, header_length, limits_for(s, call.handle.info)), time.perf_counter() - started
