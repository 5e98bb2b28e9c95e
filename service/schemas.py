"""Request and response bodies, for validation and for the OpenAPI document."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

RolloutFormat = Literal["grid", "png", "overlay", "none"]


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelRef(BaseModel):
    name: str
    version: str


class Prediction(BaseModel):
    index: int
    label: str
    score: float = Field(description="softmax probability")


class RolloutGrid(BaseModel):
    """The class token's attention rollout over the patch grid, min-max scaled to [0, 1]."""

    height: int
    width: int
    values: list[list[float]]


class RolloutImage(BaseModel):
    """A heat-map PNG (`png`), or the heat-map blended over the input (`overlay`), at the input's size."""

    height: int
    width: int
    media_type: Literal["image/png"] = "image/png"
    data: str = Field(description="base64 PNG")


class Timing(BaseModel):
    queue: float
    preprocess: float
    inference: float
    total: float


class ClassifyResponse(BaseModel):
    model: ModelRef
    predictions: list[Prediction]
    rollout: RolloutGrid | RolloutImage | None
    timing_ms: Timing


class BatchResponse(BaseModel):
    model: ModelRef
    results: list[ClassifyResponse | ErrorResponse] = Field(description="one per `file` field, in order")


class ModelCard(BaseModel):
    name: str
    version: str
    labels: list[str]
    image_height: int
    image_width: int
    patch_size: int
    channels: int
    mean: list[float]
    std: list[float]
    precision: str
    provider: str
    opset: int | None
    exporter: str
    weights_sha256: str
    test_accuracy: float | None
    max_batch_size: int
    max_native_tokens: int


# --- Open Inference Protocol (KServe v2) ---
class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class InferInputTensor(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] = Field(description="row-major values, flat or nested")


class RequestedOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[InferInputTensor]
    outputs: list[RequestedOutput] | None = None


class InferOutputTensor(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: list[float]


class InferResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    outputs: list[InferOutputTensor]
