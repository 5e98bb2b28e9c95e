"""The Open Inference Protocol (KServe v2) over the same model and batcher, so standard clients work.

`pixel_values` arrives as an FP32 JSON tensor (already normalised, like the ONNX input); each image of
it joins the shared batch queue on its own and the answers come back as `logits` and `rollout` tensors.
The infer route reads its own body within the byte and value limits, parses it strictly against
`service.schemas` (where every field's limit is), and answers bad input with 4xx naming the field.
"""
from __future__ import annotations

import asyncio
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError

from service.errors import InvalidParameter, ModelNotFound, NotReady, PayloadTooLarge, openapi_responses
from service.admission import Deadline
from service.routes.uploads import read_raw_body, run_guarded, upload_within
from service.schemas import (MAX_ABS_PIXEL_VALUE, InferInputTensor, InferOutputTensor, InferRequest,
                             InferResponse, ModelMetadata, TensorMetadata)
from service.state import ServiceState, get_admitted_state, get_ready_state, get_state
from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES

router = APIRouter(prefix="/v2", tags=["open inference protocol (v2)"])


def _inlined(schema: dict) -> dict:
    """A model's JSON schema with its `$defs` written in place: in a route's `openapi_extra` a `#/$defs/...`
    reference would point into the OpenAPI document, where those definitions are not."""
    definitions = schema.pop("$defs", {})

    def resolve(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(definitions[node["$ref"].rsplit("/", 1)[-1]])
            return {key: resolve(value) for key, value in node.items()}
        return [resolve(value) for value in node] if isinstance(node, list) else node
    return resolve(schema)


# The infer route reads its own body (to cap it as it streams in), so its schema is declared here for /docs.
_INFER_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": _inlined(InferRequest.model_json_schema())}}}}


@router.get("")
async def server_metadata() -> dict:
    from vitserve import __version__
    return {"name": "vitserve", "version": __version__, "extensions": []}


@router.get("/health/live")
async def live() -> dict:
    return {"live": True}


@router.get("/health/ready", responses=openapi_responses(503))
async def ready(state: Annotated[ServiceState, Depends(get_state)]) -> dict:
    if not state.ready:
        raise NotReady("the model is not ready (warming up or shutting down)")
    return {"ready": True}


@router.get("/models/{name}", response_model=ModelMetadata, responses=openapi_responses(404, 503))
async def model_metadata(name: str, state: Annotated[ServiceState, Depends(get_state)]) -> ModelMetadata:
    info = _model_named(state, name).info
    return ModelMetadata(name=info.name, versions=[info.version], platform="onnxruntime_onnx",
                         inputs=[TensorMetadata(name=INPUT_NAME, datatype="FP32", shape=[-1, info.channels, -1, -1])],
                         outputs=[TensorMetadata(name=OUTPUT_NAMES[0], datatype="FP32", shape=[-1, info.num_classes]),
                                  TensorMetadata(name=OUTPUT_NAMES[1], datatype="FP32", shape=[-1, -1, -1])])


@router.get("/models/{name}/ready", responses=openapi_responses(404, 503))
async def model_ready(name: str, state: Annotated[ServiceState, Depends(get_ready_state)]) -> dict:
    _model_named(state, name)
    return {"name": name, "ready": True}


@router.post("/models/{name}/infer", response_model=InferResponse, openapi_extra=_INFER_BODY,
             responses=openapi_responses(404, 413, 422, 429, 500, 503, 504))
async def infer(name: str, request: Request,
                state: Annotated[ServiceState, Depends(get_admitted_state)]) -> InferResponse:
    """Run `pixel_values` (B, C, H, W), normalised FP32, and return `logits` (B, K) and `rollout` (B, H/P, W/P).

    The body is read here as it streams in, up to `max_json_body_bytes`, and parsed as JSON whatever its
    Content-Type (tritonclient sends none)."""
    _model_named(state, name)
    s, deadline = state.settings, Deadline.after(state.settings.request_timeout_s)
    raw = await upload_within(request, read_raw_body(request, s.max_json_body_bytes), deadline, state.stopping)
    body = parse_infer_request(raw, s.max_json_values)
    pixels = _pixel_values(body.inputs[0], state)
    submits = (state.batcher.submit(image, deadline.remaining()) for image in pixels)
    results = await run_guarded(request, asyncio.gather(*submits), deadline, state.stopping)
    logits = np.stack([r.output[0] for r in results])
    rollout = np.stack([r.output[1] for r in results])
    wanted = {o.name for o in body.outputs} if body.outputs else set(OUTPUT_NAMES)
    outputs = [InferOutputTensor(name=n, shape=list(a.shape), datatype="FP32", data=a.ravel().tolist())
               for n, a in zip(OUTPUT_NAMES, (logits, rollout)) if n in wanted]
    return InferResponse(model_name=name, model_version=state.model.info.version, id=body.id, outputs=outputs)


def _model_named(state: ServiceState, name: str):
    if state.model is None:
        raise NotReady("no model loaded yet")
    if name != state.model.info.name:
        raise ModelNotFound(f"no model named {name!r}; this server serves {state.model.info.name!r}")
    return state.model


def parse_infer_request(body: bytes, max_values: int) -> InferRequest:
    """The body as an `InferRequest` (every field within the limits in `service.schemas`), or InvalidParameter
    naming what is wrong; PayloadTooLarge, before any parsing, past `max_values` JSON values.

    The values are counted by their separating commas first: the parse costs about 80 bytes and 0.25 us per
    value, so a body of short numbers ("0,0,0,...": 8M values in 16 MiB) would take 640 MiB and 2 s of the
    event loop."""
    if not body or body.isspace():
        raise InvalidParameter("empty body: send an inference request as JSON")
    commas = int(np.count_nonzero(np.frombuffer(body, np.uint8) == ord(",")))  # 1 ms per 10 MB (bytes.count: 5)
    if commas >= max_values:  # refused before the parse, which costs per value
        raise PayloadTooLarge(f"request body holds up to {commas + 1} JSON values; the limit is {max_values}")
    try:
        return InferRequest.model_validate_json(body)
    except ValidationError as e:
        raise InvalidParameter(_problems(e)) from None


def _problems(error: ValidationError, shown: int = 3) -> str:
    """The first few problems as `where: what` (`body` for the document itself). A tensor's `data` is one of
    four list depths, and each depth that does not fit reports an error: only the one that got furthest into
    the data is kept (the others fail at its first element)."""
    places: dict[tuple, tuple[tuple, str]] = {}  # where -> (index into data, message)
    for e in error.errors(include_url=False, include_input=False):
        loc = e["loc"]
        in_data = len(loc) > 3 and loc[0] == "inputs" and loc[2] == "data"  # then loc[3] names the list depth
        place, index = (loc[:3], loc[4:]) if in_data else (loc, ())
        if place not in places or index > places[place][0]:
            places[place] = (index, e["msg"])
    lines = [f"{_dotted(place + index)}: {msg}" for place, (index, msg) in places.items()]
    return "; ".join(lines[:shown]) + (f" (and {len(lines) - shown} more)" if len(lines) > shown else "")


def _dotted(loc: tuple) -> str:
    """`inputs.0.data.5`; a part the client named (a parameter's key) is cut short, never echoed whole."""
    return ".".join(str(p) if len(str(p)) <= 32 else f"{str(p)[:29]}..." for p in loc) or "body"


def _pixel_values(tensor: InferInputTensor, state: ServiceState) -> np.ndarray:
    """The request's one `pixel_values` tensor as (B, C, H, W) float32, checked against the model."""
    info, s = state.model.info, state.settings
    if len(tensor.shape) != 4:
        raise InvalidParameter(f"inputs.0.shape must be [batch, channels, height, width], got {tensor.shape}")
    batch, channels, height, width = tensor.shape
    p = info.patch_size
    if channels != info.channels or height % p or width % p:
        raise InvalidParameter(f"inputs.0.shape must have {info.channels} channels and height/width multiples of "
                               f"{p}; got {tensor.shape}")
    if batch > s.max_batch_files or (height // p) * (width // p) > s.max_native_tokens:
        raise InvalidParameter(f"inputs.0.shape {tensor.shape}: at most {s.max_batch_files} images of at most "
                               f"{s.max_native_tokens} patches")
    values = _float32_values(tensor.data)
    if values.size != batch * channels * height * width:
        raise InvalidParameter(f"inputs.0.data has {values.size} values; shape {tensor.shape} needs "
                               f"{batch * channels * height * width}")
    return values.reshape(batch, channels, height, width)


def _float32_values(data: list) -> np.ndarray:
    """`data` (flat or nested, row-major) as a flat float32 array; each value must lie within
    MAX_ABS_PIXEL_VALUE (the schema has already refused NaN, Infinity and anything not a number)."""
    try:
        values = np.asarray(data, dtype=np.float64).ravel()
    except ValueError:  # nested lists of different lengths
        raise InvalidParameter("inputs.0.data: nested lists differ in length; nest them as the shape, or send the "
                               "values flat") from None
    outside = np.abs(values) > MAX_ABS_PIXEL_VALUE
    if outside.any():
        i = int(outside.argmax())
        raise InvalidParameter(f"inputs.0.data: value {i} (row-major) is {values[i]:g}, outside the range of "
                               f"normalised pixels (magnitude at most {MAX_ABS_PIXEL_VALUE:g})")
    return values.astype(np.float32)
