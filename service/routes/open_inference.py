"""The Open Inference Protocol (KServe v2) over the same model and batcher, so standard clients work.

`pixel_values` arrives as an FP32 JSON tensor (already normalised, like the ONNX input); each image of
it joins the shared batch queue on its own and the answers come back as `logits` and `rollout` tensors.
"""
from __future__ import annotations

import asyncio
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, Request

from service.errors import InvalidParameter, ModelNotFound, NotReady, openapi_responses
from service.routes.uploads import unless_disconnected
from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES
from service.schemas import (InferOutputTensor, InferRequest, InferResponse, ModelMetadata, TensorMetadata)
from service.state import ServiceState, get_ready_state, get_state

router = APIRouter(prefix="/v2", tags=["open inference protocol (v2)"])


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


@router.post("/models/{name}/infer", response_model=InferResponse,
             responses=openapi_responses(404, 422, 429, 500, 503, 504))
async def infer(name: str, body: InferRequest, request: Request,
                state: Annotated[ServiceState, Depends(get_ready_state)]) -> InferResponse:
    """Run `pixel_values` (B, C, H, W), normalised FP32, and return `logits` (B, K) and `rollout` (B, H/P, W/P)."""
    _model_named(state, name)
    pixels = _pixel_values(body, state)
    submits = (state.batcher.submit(image, state.settings.request_timeout_s) for image in pixels)
    results = await unless_disconnected(request, asyncio.gather(*submits))
    logits = np.stack([r.output[0] for r in results])
    rollout = np.stack([r.output[1] for r in results])
    wanted = {o.name for o in body.outputs} if body.outputs else set(OUTPUT_NAMES)
    if not wanted <= set(OUTPUT_NAMES):
        raise InvalidParameter(f"unknown outputs {sorted(wanted - set(OUTPUT_NAMES))}; this model has {OUTPUT_NAMES}")
    outputs = [InferOutputTensor(name=n, shape=list(a.shape), datatype="FP32", data=a.ravel().tolist())
               for n, a in zip(OUTPUT_NAMES, (logits, rollout)) if n in wanted]
    return InferResponse(model_name=name, model_version=state.model.info.version, id=body.id, outputs=outputs)


def _model_named(state: ServiceState, name: str):
    if state.model is None:
        raise NotReady("no model loaded yet")
    if name != state.model.info.name:
        raise ModelNotFound(f"no model named {name!r}; this server serves {state.model.info.name!r}")
    return state.model


def _pixel_values(body: InferRequest, state: ServiceState) -> np.ndarray:
    """The request's one `pixel_values` tensor as (B, C, H, W) float32, checked against the model."""
    info, s = state.model.info, state.settings
    if [t.name for t in body.inputs] != [INPUT_NAME]:
        raise InvalidParameter(f"expected exactly one input named {INPUT_NAME!r}, got {[t.name for t in body.inputs]}")
    tensor = body.inputs[0]
    if tensor.datatype != "FP32":
        raise InvalidParameter(f"{INPUT_NAME} must be FP32, got {tensor.datatype}")
    if len(tensor.shape) != 4 or min(tensor.shape) < 1:
        raise InvalidParameter(f"{INPUT_NAME} shape must be [batch, channels, height, width], got {tensor.shape}")
    batch, channels, height, width = tensor.shape
    p = info.patch_size
    if channels != info.channels or height % p or width % p:
        raise InvalidParameter(f"{INPUT_NAME} must have {info.channels} channels and height/width multiples of "
                               f"{p}; got {tensor.shape}")
    if batch > s.max_batch_files or (height // p) * (width // p) > s.max_native_tokens:
        raise InvalidParameter(f"at most {s.max_batch_files} images of at most {s.max_native_tokens} patches")
    try:
        array = np.asarray(tensor.data, dtype=np.float32)
    except (ValueError, TypeError) as e:
        raise InvalidParameter(f"{INPUT_NAME} data is not numeric: {e}") from e
    if array.size != batch * channels * height * width:
        raise InvalidParameter(f"{INPUT_NAME} has {array.size} values for shape {tensor.shape}")
    return array.reshape(batch, channels, height, width)
