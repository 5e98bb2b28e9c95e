"""/v1's request options and response bodies, for validation and for the OpenAPI document (the Open Inference
Protocol's, /v2 and gRPC, are in service/schemas/v2.py)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

# bench/ reads the /v2 input's name here: its place is service/schemas/v2.py
from vitserve.service.schemas.v2 import IMAGE_INPUT_NAME as IMAGE_INPUT_NAME

# How an image becomes the model's input (/v1's `resize` query parameter, /v2's `resize` request parameter): fit scales
# and centre-crops it to the trained size, native keeps its aspect and snaps its sides to patches
ResizePolicy = Literal["fit", "native"]
RolloutFormat = Literal["grid", "png", "overlay", "none"]  # a map's format, or none
MapKind = Literal["rollout", "relevance", "none"]
MapFormat = Literal["grid", "png", "overlay"]


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
    score: float = Field(description="softmax probability, calibrated when the model's file carries a temperature "
                                     "(GET /v1/model: temperature)")


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


class ExplainedClass(BaseModel):
    index: int
    label: str
    score: float = Field(description="its softmax probability")


class RelevanceGrid(RolloutGrid):
    """What each patch added to `target`'s logit (conservative relevance, signed) over the patch grid, min-max
    scaled to [0, 1] (/v2's `relevance` output keeps the raw, signed values)."""

    target: ExplainedClass


class RelevanceImage(RolloutImage):
    """The relevance for `target` as a heat-map PNG (`png`), or blended over the input (`overlay`)."""

    target: ExplainedClass


class Timing(BaseModel):
    queue: float
    preprocess: float
    inference: float
    total: float


class Budget(BaseModel):
    """The token budget an image's answer used (docs/token-budgets.md)."""

    tokens: int = Field(description="the sequence length the blocks computed on: patches, less the class token")
    full_tokens: int = Field(description="the full budget's: the trained grid's (at resize=native, the image's own)")
    grid: list[int] = Field(description="the input grid it ran at, [height, width] in pixels; its map is on this "
                                        "grid's patches")
    reason: Literal["asked", "load"] | None = Field(description="why fewer tokens than the full budget: the request "
                                                                "asked (max_tokens), or load; null at the full "
                                                                "budget")
    accuracy: float | None = Field(None, description="this budget's accuracy on the model's labelled set, measured "
                                                     "at export (null: not measured)")


class OodScore(BaseModel):
    score: float = Field(description="the squared Mahalanobis distance of the image's embedding to the nearest class "
                                     "mean of the model's training distribution (fitted at export; docs/ood.md)")
    threshold: float = Field(description="the held-out images' 99th percentile: about 1% of in-distribution images "
                                         "score above it")
    outside: bool = Field(description="score above the threshold: the image looks unlike what the model was "
                                      "trained on, and its answer deserves less trust")


class ClassifyResponse(BaseModel):
    model: ModelRef
    predictions: list[Prediction]
    rollout: RolloutGrid | RolloutImage | None = Field(description="map=rollout (the default): the attention rollout")
    relevance: RelevanceGrid | RelevanceImage | None = Field(
        None, description="map=relevance: the relevance of the explained class (`target`)")
    ood: OodScore | None = Field(None, description="how far the image is from the training distribution; null for a "
                                                   "model file exported without it (`vitserve export --eval`)")
    budget: Budget | None = Field(None, description="the token budget the answer used")
    timing_ms: Timing
    # Absent, not null, when there is nothing to say: an answer to a request that was not capped is unchanged.
    warnings: list[str] | None = Field(None, exclude_if=lambda value: value is None, description=(
        "where the answer differs from what the request asked, each in a sentence; present only then. A top_k above "
        "the model's class count: \"top_k=1000 is more than the model's 10 classes: all 10 are returned\""))


class ImageEmbedding(BaseModel):
    model: ModelRef = Field(description="the version that ran the image")
    embedding: list[float] = Field(description="the class token after the final LayerNorm, before the head (the "
                                               "model's card gives its size); L2-normalised with normalize=true")
    norm: float = Field(description="its L2 norm before any normalisation")
    ood: OodScore | None = Field(None, description="how far the image is from the training distribution; null for "
                                                   "a model file exported without it")
    budget: Budget | None = Field(None, description="the token budget the answer used")


class EmbedResponse(BaseModel):
    model: ModelRef
    results: list[ImageEmbedding | ErrorResponse] = Field(description="one per image (the body, or each `file` "
                                                                      "field in order)")


class BatchResponse(BaseModel):
    model: ModelRef
    results: list[ClassifyResponse | ErrorResponse] = Field(description="one per `file` field, in order")


class ModelVersionState(BaseModel):
    name: str
    version: str = Field(description="empty: in the repository, not loaded")
    state: str = Field(description="READY, LOADING, UNLOADING or UNAVAILABLE")
    reason: str = ""


class ModelList(BaseModel):
    models: list[ModelVersionState]


class ShadowPair(BaseModel):
    """One served version compared with the shadow version (service/engine/shadow.py), since the shadow was set."""

    version: str = Field(description="the served version that answered")
    shadow_version: str
    offered: int = Field(description="answered requests sampled for a copy")
    dropped: int = Field(description="copies dropped because the shadow's queue was full")
    failed: int = Field(description="copies the shadow could not run")
    compared: int
    top1_agreement: float | None = Field(description="share of compared images with the same top-1 class")
    mean_js_divergence: float | None = Field(description="mean Jensen-Shannon divergence (bits, 0..1) of the two "
                                                         "versions' served probabilities")
    mean_map_rank_correlation: float | None = Field(description="mean Spearman rank correlation of the two "
                                                                "rollout maps")
    shadow_latency_ms: dict[str, float] = Field(description="p50, p90, p99 of offer to shadow result, over the last "
                                                            "10,000 copies")


class ShadowReport(BaseModel):
    model: str
    shadow_version: str
    fraction: float = Field(description="the share of answered requests copied")
    queued: int = Field(description="copies waiting now")
    max_queue_size: int
    pairs: list[ShadowPair]


class TemperatureCurve(BaseModel):
    """A temperature per answer (docs/calibration.md): T = exp(c0 + c1 u + c2 u^2), u the entropy of the answer's
    raw softmax standardised by `mean` and `std` and held within [`low`, `high`]."""

    mean: float = Field(description="the fit images' mean entropy of the raw softmax (nats)")
    std: float = Field(description="their standard deviation")
    low: float = Field(description="the smallest standardised entropy among the fit images")
    high: float = Field(description="the largest")
    coefficients: list[float] = Field(description="c0, c1, c2")


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
    maps: list[str] = Field(description="the explanation maps the model computes: rollout, and relevance when its "
                                        "file has the relevance path")
    max_batch_size: int
    max_native_tokens: int
    embedding_size: int = Field(description="the size of its embedding (POST /v1/embed, the `embedding` output); "
                                            "0: its file was exported without one")
    ood: dict | None = Field(description="its out-of-distribution score's fit (threshold, held-out quantiles); null: "
                                         "its file has no OOD score")
    temperature_by_entropy: TemperatureCurve | None = Field(
        default=None, description="the scores on /v1 are softmax(logits / T) with this T per answer; null: "
                                  "`temperature` for every answer")
    temperature: float = Field(description="the scores on /v1 are softmax(logits / temperature): fitted at export "
                                           "on held-out labelled images (1.0: the file was exported without any)")
    calibration: dict | None = Field(description="what the temperature was fitted on and the expected calibration "
                                                 "error it measured before and after, on images it was not fitted "
                                                 "on; null for an uncalibrated file")
    budgets: list[dict] = Field(default_factory=list, description="its token budgets (docs/token-budgets.md), the "
                                "full budget first: each one's input grid, tokens, multiply-adds relative to the full "
                                "budget (cost), accuracy measured at export (null: not measured), and whether this "
                                "server serves it (within budget_accuracy_floor of the full budget's accuracy)")
    degrade_under_load: bool = Field(False, description="whether this server answers at a cheaper served budget "
                                                        "under load, rather than refusing")
    serving: dict = Field(default_factory=dict, description="how this server serves the version and why: its plan "
                          "(runtime, precision_hint, maps_free, light; source: settings, recorded by `vitserve tune`, "
                          "declared from the machine's units, or given; why; key: the tuning record's name, the same "
                          "on every replica of this file and machine), provider, and the seconds its load took in "
                          "all (ready_s) and by stage (docs/tuning.md)")
