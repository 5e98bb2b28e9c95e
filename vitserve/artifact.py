"""The contract of the exported model file: one module that export writes through and the service reads through.

An artifact is one ONNX file. Its graph takes `INPUT_NAME`, float32 `[batch, channels, height, width]` pixels
already normalised by `normalize_pixels`, and returns `OUTPUT_NAMES`: logits `[batch, classes]` and the attention
rollout `[batch, height/P, width/P]`. A model whose `maps` include "relevance" also takes `TARGET_NAME`, int64
`[n]`, optional (empty by default): with n = batch it runs the relevance path and returns `RELEVANCE_NAME`
`[batch, height/P, width/P]`, the relevance of the class named per image (`TOP1_TARGET`: the predicted one); empty,
it runs the fast path and the relevance output is empty. Everything else the server needs travels in the file's
`metadata_props` under `vitserve.*` keys, all values strings (JSON for lists and objects):
`ModelInfo.to_metadata()` writes them and `ModelInfo.from_metadata()` reads them back.
docs/architecture.md lists the keys.

Imports numpy only, so the torch world (export) and the ONNX Runtime world (service) can both use it.
"""
from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from vitserve.budgets import LadderError, Rung, derived_ladder, ladder_from_json, ladder_to_json

INPUT_NAME = "pixel_values"
OUTPUT_NAMES = ("logits", "rollout")
TARGET_NAME = "target_class"
RELEVANCE_NAME = "relevance"
TOP1_TARGET = -1
# Optional outputs, after the required ones (where present, in OPTIONAL_OUTPUT_SPECS's order), in the fast path and
# the relevance path: the image embedding, the class token after the final LayerNorm and before the head, float32
# [batch, D] (files the exporter writes; ModelInfo.embedding_size says D, 0: absent); and the out-of-distribution
# score, float32 [batch], the squared Mahalanobis distance of the embedding to the nearest class mean, computed in
# the graph from statistics fitted at export (files exported with --eval; ModelInfo.ood says how it was fitted and
# its threshold).
EMBEDDING_NAME = "embedding"
OOD_SCORE_NAME = "ood_score"
MAPS = ("rollout", "relevance")  # the explanation maps a model can compute; every model computes rollout
# Bump when a reader of the old format would misread a new file; readers refuse newer versions.
FORMAT_VERSION = 1
METADATA_PREFIX = "vitserve."
PRECISIONS = ("fp32", "fp16", "int8")
# The paper's Figure 7 numbers (model/inspection.py's to_json), computed at export; optional, and kept out of
# ModelInfo, which travels with every repository index: only GET /v1/models/{name}/inspect reads it.
INSPECTION_KEY = METADATA_PREFIX + "inspection"


@dataclass(frozen=True)
class OptionalOutput:
    """An output a file may have after the required ones: declared here once, it reaches every transport that
    sends outputs by name (/v2 and gRPC inference, /v2's model configuration) with no other change."""

    name: str
    present: Callable[[ModelInfo], bool]  # whether a file whose metadata is `info` has it
    dims: Callable[[ModelInfo], list[int]]  # one image's shape, as /v2's model configuration declares it


# The optional outputs, in the order a graph returns them where present (read when used: a test may add one).
OPTIONAL_OUTPUT_SPECS: list[OptionalOutput] = [
    OptionalOutput(EMBEDDING_NAME, lambda info: bool(info.embedding_size), lambda info: [info.embedding_size]),
    OptionalOutput(OOD_SCORE_NAME, lambda info: bool(info.ood), lambda info: [1]),
]


def optional_outputs() -> tuple[str, ...]:
    """The names of every optional output a file may have."""
    return tuple(output.name for output in OPTIONAL_OUTPUT_SPECS)


def optional_outputs_of(info: ModelInfo) -> list[OptionalOutput]:
    """The optional outputs a file whose metadata is `info` has, in the graph's order."""
    return [output for output in OPTIONAL_OUTPUT_SPECS if output.present(info)]


def requestable_outputs() -> tuple[str, ...]:
    """Every output an inference request may name: the fast path's, the relevance path's, the optional ones."""
    return (*OUTPUT_NAMES, RELEVANCE_NAME, *optional_outputs())


class ArtifactError(ValueError):
    """The file's `vitserve.*` metadata is missing, malformed, inconsistent or from a newer format."""


def softmax(logits: np.ndarray, temperature: float | np.ndarray = 1.0) -> np.ndarray:
    """(..., K) logits -> softmax(logits / temperature) in float64, stably. `temperature` is one number or one per
    row, shape (...); any positive temperature keeps each row's ranking."""
    scaled = np.asarray(logits, np.float64) / np.expand_dims(np.asarray(temperature, np.float64), -1)
    scaled = scaled - scaled.max(axis=-1, keepdims=True)
    exp = np.exp(scaled)
    return exp / exp.sum(axis=-1, keepdims=True)


def softmax_entropy(logits: np.ndarray) -> np.ndarray:
    """(..., K) logits -> the entropy of softmax(logits) in nats, shape (...). With z the logits less their
    maximum and S = sum(exp z), it is log S - sum(exp(z) z) / S: no log of a probability that underflowed to 0."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    exp = np.exp(z)
    total = exp.sum(axis=-1)
    return np.log(total) - (exp * z).sum(axis=-1) / total


# The temperatures a calibration may use: from 0.05 to 20 covers any network's over- or under-confidence (the
# export's search stays within them, and a per-answer temperature is held within them whatever a file says, so no
# answer's logits are divided by 0 or by infinity).
TEMPERATURE_BOUNDS = (0.05, 20.0)
_LOG_T_LOW, _LOG_T_HIGH = (math.log(t) for t in TEMPERATURE_BOUNDS)


def curve_log_temperatures(coefficients, u: np.ndarray) -> np.ndarray:
    """log T = c0 + c1 u + c2 u^2 of standardised entropies `u`, held within TEMPERATURE_BOUNDS: the curve's one
    formula, for the file's curve (EntropyTemperature) and for the export's search over coefficients alike."""
    c0, c1, c2 = coefficients
    return np.minimum(np.maximum(c0 + u * (c1 + c2 * u), _LOG_T_LOW), _LOG_T_HIGH)


@dataclass(frozen=True)
class EntropyTemperature:
    """A temperature per answer, set by how unsure the raw softmax is (export/calibration.py fits it): T(z) =
    exp(c0 + c1 u + c2 u^2), where u is the entropy of softmax(z) standardised by the fit images' `mean` and `std`,
    and held within the fit images' range [`low`, `high`] so an answer unlike any of them gets the edge's
    temperature, never an extrapolated one. One temperature cannot make a label-smoothed model's middle
    confidences and its top ones honest at once (docs/calibration.md); dividing each answer's logits by its own
    positive T still changes none of its ranking."""

    mean: float
    std: float
    low: float
    high: float
    coefficients: tuple[float, float, float]

    def temperatures(self, logits: np.ndarray) -> np.ndarray | float:
        """(..., K) logits -> their temperatures, shape (...); one answer's (K,) logits -> its temperature, a float."""
        z = np.asarray(logits, np.float64)
        if z.ndim == 1:  # every /v1 answer, on the request path: plain floats take a fifth of NumPy's time on ten
            return self._temperature(z.tolist())
        u = np.minimum(np.maximum((softmax_entropy(z) - self.mean) / self.std, self.low), self.high)
        return np.exp(curve_log_temperatures(self.coefficients, u))

    def _temperature(self, logits: list[float]) -> float:
        """`temperatures` of one answer, the same steps in floats (softmax_entropy, then the curve)."""
        top = max(logits)
        shifted = [x - top for x in logits]
        exp = [math.exp(x) for x in shifted]
        total = math.fsum(exp)
        raw_entropy = math.log(total) - math.fsum(e * x for e, x in zip(exp, shifted)) / total
        u = min(max((raw_entropy - self.mean) / self.std, self.low), self.high)
        c0, c1, c2 = self.coefficients
        return math.exp(min(max(c0 + u * (c1 + c2 * u), _LOG_T_LOW), _LOG_T_HIGH))

    def to_json(self) -> dict:
        return {"mean": self.mean, "std": self.std, "low": self.low, "high": self.high,
                "coefficients": list(self.coefficients)}

    @classmethod
    def from_json(cls, value: dict) -> EntropyTemperature:
        """The stored form back; anything else (missing keys, not numbers, a non-positive std, low > high, values
        that are not finite) is an ArtifactError."""
        try:
            mean, std, low, high = (float(value[key]) for key in ("mean", "std", "low", "high"))
            coefficients = tuple(float(c) for c in value["coefficients"])
        except (TypeError, KeyError, ValueError) as e:
            raise ArtifactError(f"vitserve.temperature_by_entropy: {value!r} is not a temperature curve ({e})") \
                from None
        if len(coefficients) != 3 or not all(math.isfinite(x) for x in (mean, std, low, high, *coefficients)) \
                or std <= 0 or low > high:
            raise ArtifactError(f"vitserve.temperature_by_entropy: {value!r} is not a temperature curve "
                                "(3 finite coefficients, a positive std, low <= high)")
        return cls(mean=mean, std=std, low=low, high=high, coefficients=coefficients)


@dataclass(frozen=True)
class ModelInfo:
    """Everything a server knows about a model, as written in the artifact's metadata."""

    name: str
    version: str
    labels: list[str]
    patch_size: int
    image_size: tuple[int, int]  # (height, width) it was trained at
    channels: int
    mean: list[float]
    std: list[float]
    precision: str = "fp32"
    format_version: int = FORMAT_VERSION
    exporter: str = ""
    weights_sha256: str = ""
    test_accuracy: float | None = None
    architecture: dict = field(default_factory=dict)
    maps: tuple[str, ...] = ("rollout",)
    # Calibration (export/calibration.py): served probabilities are softmax(logits / T), T from
    # `temperature_by_entropy` (one per answer) where the file has it, else `temperature` (one number; 1.0 for a
    # file exported without a labelled set, and every older file). A calibrated file carries both, so a reader
    # that knows only `temperature` still serves calibrated scores. `calibration` says what they were fitted on and
    # the calibration error measured before and after, on images they were not fitted on.
    temperature: float = 1.0
    calibration: dict = field(default_factory=dict)
    temperature_by_entropy: EntropyTemperature | None = None
    embedding_size: int = 0  # D of the EMBEDDING_NAME output; 0: the file has none
    # The OOD_SCORE_NAME output's fit: {"score": "mahalanobis", "threshold": t (the held-out images' 99th
    # percentile), "quantiles": {"0.5": ..., "0.9": ..., "0.99": ..., "0.999": ...}, "fit_images": n,
    # "heldout_images": m, "source": ..., "rank": r of the projection}; empty: the file has no OOD score
    ood: dict = field(default_factory=dict)
    # The token budgets the file serves (vitserve/budgets.py), the trained grid first, each rung's accuracy on the
    # export's labelled set where it was measured; empty: a file exported before budgets (`ladder` derives one)
    budgets: tuple[Rung, ...] = ()
    opset: int | None = None  # read from the graph's opset_import, not from metadata

    @property
    def ladder(self) -> tuple[Rung, ...]:
        """The file's budgets, or for a file that stores none the grids its architecture gives (no accuracies)."""
        return self.budgets or derived_ladder(self.image_size, self.patch_size, self.architecture)

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    @property
    def extra_outputs(self) -> tuple[str, ...]:
        """The optional outputs the file's graph has, in their order after the required ones."""
        return tuple(output.name for output in optional_outputs_of(self))

    def output_names(self, relevance: bool = False) -> tuple[str, ...]:
        """The outputs one run of a path returns, in order: the fast path's, or with `relevance` the relevance
        path's (its map after the required outputs); the optional outputs last."""
        return (*OUTPUT_NAMES, *((RELEVANCE_NAME,) if relevance else ()), *self.extra_outputs)

    @property
    def explains_classes(self) -> bool:
        """Whether the graph has the relevance path (class-specific maps)."""
        return RELEVANCE_NAME in self.maps

    def temperature_for(self, logits: np.ndarray) -> float | np.ndarray:
        """The temperature /v1 divides these (..., K) logits by: one per row with a curve, else the file's one."""
        if self.temperature_by_entropy is None:
            return self.temperature
        return self.temperature_by_entropy.temperatures(logits)

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """(..., K) logits -> the calibrated probabilities /v1 serves, float64."""
        return softmax(logits, self.temperature_for(logits))

    def to_metadata(self) -> dict[str, str]:
        """The `metadata_props` that describe this model: every value a string."""
        props = {
            "format_version": str(self.format_version), "name": self.name, "version": self.version,
            "labels": json.dumps(list(self.labels)), "patch_size": str(self.patch_size),
            "image_height": str(self.image_size[0]), "image_width": str(self.image_size[1]),
            "channels": str(self.channels), "mean": json.dumps(list(self.mean)), "std": json.dumps(list(self.std)),
            "architecture": json.dumps(self.architecture), "precision": self.precision,
            "exporter": self.exporter, "weights_sha256": self.weights_sha256, "maps": json.dumps(list(self.maps)),
        }
        if self.test_accuracy is not None:
            props["test_accuracy"] = str(float(self.test_accuracy))
        if self.calibration:
            props["temperature"] = repr(float(self.temperature))
            props["calibration"] = json.dumps(self.calibration)
        if self.temperature_by_entropy is not None:
            props["temperature_by_entropy"] = json.dumps(self.temperature_by_entropy.to_json())
        if self.embedding_size:
            props["embedding_size"] = str(self.embedding_size)
        if self.ood:
            props["ood"] = json.dumps(self.ood)
        if self.budgets:
            props["budgets"] = ladder_to_json(self.budgets)
        return {METADATA_PREFIX + key: value for key, value in props.items()}

    @classmethod
    def from_metadata(cls, props: dict[str, str], opset: int | None = None) -> ModelInfo:
        """`metadata_props` -> ModelInfo; a missing, malformed or inconsistent value is an ArtifactError."""
        get = _metadata_reader(props)
        format_version = get("format_version", int)
        if format_version > FORMAT_VERSION:
            raise ArtifactError(f"model format_version {format_version} is newer than this reader ({FORMAT_VERSION})")
        info = cls(
            name=get("name"), version=get("version"), labels=[str(x) for x in get("labels", json.loads)],
            patch_size=get("patch_size", int), image_size=(get("image_height", int), get("image_width", int)),
            channels=get("channels", int), mean=[float(x) for x in get("mean", json.loads)],
            std=[float(x) for x in get("std", json.loads)], precision=get("precision", str, "fp32"),
            format_version=format_version, exporter=get("exporter", str, ""),
            weights_sha256=get("weights_sha256", str, ""), test_accuracy=get("test_accuracy", float, None),
            architecture=get("architecture", json.loads, {}), opset=opset,
            maps=tuple(str(m) for m in get("maps", json.loads, ["rollout"])),
            temperature=get("temperature", float, 1.0), calibration=get("calibration", json.loads, {}),
            temperature_by_entropy=get("temperature_by_entropy", _entropy_temperature, None),
            embedding_size=get("embedding_size", int, 0), ood=get("ood", json.loads, {}))
        budgets = props.get(METADATA_PREFIX + "budgets")
        if budgets is not None:
            try:
                info = replace(info, budgets=ladder_from_json(budgets, info.image_size, info.patch_size))
            except LadderError as e:
                raise ArtifactError(f"model metadata '{METADATA_PREFIX}budgets': {e}") from None
        info.check()
        return info

    def check(self) -> None:
        """The values agree with each other: one mean and std per channel, a patch, labels, a known precision."""
        consistent = (len(self.mean) == len(self.std) == self.channels and self.patch_size >= 1 and self.labels
                      and min(self.image_size) >= self.patch_size and all(s > 0 for s in self.std)
                      and self.precision in PRECISIONS and "rollout" in self.maps and set(self.maps) <= set(MAPS)
                      and math.isfinite(self.temperature) and self.temperature > 0
                      and isinstance(self.calibration, dict) and self.embedding_size >= 0
                      and isinstance(self.ood, dict) and (not self.ood or self.embedding_size > 0))
        if not consistent:
            raise ArtifactError(f"model metadata is inconsistent: channels={self.channels}, mean={self.mean}, "
                                f"std={self.std}, patch_size={self.patch_size}, image_size={self.image_size}, "
                                f"{len(self.labels)} labels, precision={self.precision!r}, maps={list(self.maps)}, "
                                f"temperature={self.temperature}")


def _entropy_temperature(text: str) -> EntropyTemperature:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ArtifactError(f"vitserve.temperature_by_entropy: {text!r} is not a JSON object")
    return EntropyTemperature.from_json(value)


def read_inspection(props: dict[str, str]) -> dict | None:
    """The inspection stored in a file's metadata, or None when it was exported without one."""
    raw = props.get(INSPECTION_KEY)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise ArtifactError(f"model metadata '{INSPECTION_KEY}' is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise ArtifactError(f"model metadata '{INSPECTION_KEY}' is not a JSON object")
    return data


_REQUIRED = object()


def _metadata_reader(props: dict[str, str]) -> Callable[..., Any]:
    def get(key: str, convert: Callable[[str], Any] = str, default: Any = _REQUIRED) -> Any:
        raw = props.get(METADATA_PREFIX + key)
        if raw is None:
            if default is not _REQUIRED:
                return default
            raise ArtifactError(f"model metadata lacks '{METADATA_PREFIX}{key}'; was it exported by `vitserve export`?")
        try:
            return convert(raw)
        except (ValueError, TypeError) as e:
            raise ArtifactError(f"model metadata '{METADATA_PREFIX}{key}' = {raw!r} is malformed: {e}") from e
    return get


def normalization_table(mean: list[float], std: list[float]) -> np.ndarray:
    """(C, 256) float32, read-only: what `normalize_pixels` makes of each 8-bit value per channel, with its
    arithmetic, so a gather from it is bit-identical to the reference (the service's preprocessing and the
    engine's, tested). Made once per model's mean and std: every image's preprocessing asks for it."""
    return _normalization_table(tuple(mean), tuple(std))


def lookup(table: np.ndarray, indices: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`table[indices]` for unsigned integer indices that cannot leave the table (uint8 pixels into 256 values),
    into `out` when given. numpy's `take` checks each index by default ("raise"); "clip" has nothing to clip here
    and is a quarter faster (a contiguous 224x224 channel: 49 against 68 us)."""
    if indices.dtype.kind != "u" or np.iinfo(indices.dtype).max >= table.shape[-1]:
        raise ValueError(f"{indices.dtype} indices could leave a table of {table.shape[-1]} values")
    return table.take(indices, out=out, mode="clip")


@functools.lru_cache(maxsize=64)
def _normalization_table(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    levels = np.arange(256, dtype=np.float32) / np.float32(255.0)  # (256,)
    table = (levels[None, :] - np.asarray(mean, np.float32)[:, None]) / np.asarray(std, np.float32)[:, None]
    table.flags.writeable = False  # shared by every caller
    return table


def normalize_pixels(pixels: np.ndarray, mean: list[float], std: list[float], channel_axis: int = 1) -> np.ndarray:
    """uint8 pixels -> the graph's float32 input: `(x / 255 - mean) / std` per channel, in float32 arithmetic.

    The reference every other path is tested equal to (the service's lookup table, training's torch version).
    `channel_axis` says which axis holds the channels: 1 for (N, C, H, W), 0 for (C, H, W), -1 for (H, W, C).
    """
    shape = [1] * pixels.ndim
    shape[channel_axis] = -1
    m, s = np.asarray(mean, np.float32).reshape(shape), np.asarray(std, np.float32).reshape(shape)
    return (np.asarray(pixels).astype(np.float32) / np.float32(255.0) - m) / s
