"""ONNX Runtime: one session per process, the model's metadata as a typed `ModelInfo`, warm-up.

The server talks to a model only through `InferenceModel` (the whole contract: `info`, `provider`,
`run`), so tests can wrap the real session to make it slow or make it fail.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from service.errors import ModelLoadError
from service.settings import Settings

log = logging.getLogger("vitserve.runtime")

INPUT_NAME = "pixel_values"
OUTPUT_NAMES = ("logits", "rollout")
SUPPORTED_FORMAT_VERSION = 1
_ORT_PROVIDER_NAMES = {"tensorrt": "TensorrtExecutionProvider", "cuda": "CUDAExecutionProvider",
                       "cpu": "CPUExecutionProvider"}


@dataclass(frozen=True)
class ModelInfo:
    """Everything the service knows about the model, read from the artifact's `vitserve.*` metadata."""

    name: str
    version: str
    labels: list[str]
    patch_size: int
    image_size: tuple[int, int]  # (height, width) it was trained at
    channels: int
    mean: list[float]
    std: list[float]
    precision: str = "fp32"
    opset: int | None = None
    format_version: int = 1
    exporter: str = ""
    weights_sha256: str = ""
    test_accuracy: float | None = None
    architecture: dict = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return len(self.labels)


class InferenceModel(Protocol):
    """The contract between the server and a model: pixels (B, C, H, W) -> (logits (B, K), rollout (B, h, w))."""

    info: ModelInfo
    provider: str

    def run(self, pixel_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


_REQUIRED = object()


def parse_metadata(props: dict[str, str], opset: int | None = None) -> ModelInfo:
    """`vitserve.*` metadata_props -> ModelInfo; a missing or malformed key is a ModelLoadError."""
    def get(key: str, convert=str, default=_REQUIRED):
        raw = props.get(f"vitserve.{key}")
        if raw is None:
            if default is not _REQUIRED:
                return default
            raise ModelLoadError(f"model metadata lacks 'vitserve.{key}'; was it exported by `vitserve export`?")
        try:
            return convert(raw)
        except (ValueError, TypeError) as e:
            raise ModelLoadError(f"model metadata 'vitserve.{key}' = {raw!r} is malformed: {e}") from e

    version = get("format_version", int)
    if version > SUPPORTED_FORMAT_VERSION:
        raise ModelLoadError(f"model format_version {version} is newer than this server ({SUPPORTED_FORMAT_VERSION})")
    info = ModelInfo(
        name=get("name"), version=get("version"), labels=[str(x) for x in get("labels", json.loads)],
        patch_size=get("patch_size", int), image_size=(get("image_height", int), get("image_width", int)),
        channels=get("channels", int), mean=[float(x) for x in get("mean", json.loads)],
        std=[float(x) for x in get("std", json.loads)], precision=get("precision", str, "fp32"), opset=opset,
        format_version=version, exporter=get("exporter", str, ""), weights_sha256=get("weights_sha256", str, ""),
        test_accuracy=get("test_accuracy", float, None), architecture=get("architecture", json.loads, {}))
    if not (len(info.mean) == len(info.std) == info.channels) or info.patch_size < 1 or not info.labels:
        raise ModelLoadError(f"model metadata is inconsistent: channels={info.channels}, mean={info.mean}, "
                             f"std={info.std}, patch_size={info.patch_size}, {len(info.labels)} labels")
    return info


@dataclass
class ModelFileHeader:
    opset: int | None
    metadata: dict[str, str]


def scan_model_file(path: Path) -> ModelFileHeader:
    """Read a ModelProto's top-level `opset_import` (field 8) and `metadata_props` (field 14) without `onnx`.

    Seeks past every other field (the graph), so checking a multi-gigabyte model costs a few reads;
    anything that is not a well-formed protobuf message is a ModelLoadError.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    opset, metadata, size = None, {}, path.stat().st_size
    if size == 0:
        raise ModelLoadError(f"model file is empty: {path}")
    with open(path, "rb") as f:
        while (key := _read_varint(f)) is not None:
            number, wire = key >> 3, key & 7
            if wire == 0:
                _read_varint(f)
            elif wire == 2:
                length = _read_varint(f)
                if length is None or f.tell() + length > size:
                    raise ModelLoadError(f"{path} is not an ONNX model (truncated or corrupt protobuf)")
                if number in (8, 14):
                    fields = _parse_message(f.read(length))
                    if number == 8 and fields.get(1, b"") in (b"", b"ai.onnx"):
                        opset = fields.get(2)
                    elif number == 14:
                        metadata[fields.get(1, b"").decode()] = fields.get(2, b"").decode()
                else:
                    f.seek(length, 1)
            elif wire in (1, 5):
                f.seek(8 if wire == 1 else 4, 1)
            else:
                raise ModelLoadError(f"{path} is not an ONNX model (wire type {wire} at offset {f.tell()})")
    return ModelFileHeader(opset, metadata)


def _read_varint(f) -> int | None:
    result, shift = 0, 0
    while True:
        byte = f.read(1)
        if not byte:
            return None
        result |= (byte[0] & 0x7F) << shift
        if not byte[0] & 0x80:
            return result
        shift += 7
        if shift > 63:
            raise ModelLoadError("not an ONNX model (malformed varint)")


def _parse_message(buf: bytes) -> dict[int, bytes | int]:
    """A flat message of varint and length-delimited fields -> {field number: value}."""
    import io
    f, fields = io.BytesIO(buf), {}
    while (key := _read_varint(f)) is not None:
        if key & 7 == 0:
            fields[key >> 3] = _read_varint(f)
        elif key & 7 == 2:
            fields[key >> 3] = f.read(_read_varint(f) or 0)
        else:
            raise ModelLoadError("not an ONNX model (unexpected field in a small message)")
    return fields


def provider_chain(settings: Settings, available: list[str]) -> list[tuple[str, dict]]:
    """The configured providers that this onnxruntime build has, each with its options; CPU always last."""
    chain = []
    for name in settings.providers:
        ort_name = _ORT_PROVIDER_NAMES[name]
        if ort_name not in available:
            log.warning("execution provider %s requested but not in this onnxruntime build (%s); skipped",
                        ort_name, ", ".join(available))
            continue
        chain.append((ort_name, _provider_options(name, settings)))
    if all(name != "CPUExecutionProvider" for name, _ in chain):
        chain.append(("CPUExecutionProvider", {}))
    return chain


def _provider_options(name: str, s: Settings) -> dict:
    if name == "cuda":
        options = {"device_id": s.cuda_device_id, "cudnn_conv_algo_search": s.cudnn_conv_algo_search,
                   "arena_extend_strategy": "kSameAsRequested", "do_copy_in_default_stream": True}
        if s.cuda_mem_limit_bytes:
            options["gpu_mem_limit"] = s.cuda_mem_limit_bytes
        return options
    if name == "tensorrt":
        options = {"device_id": s.cuda_device_id, "trt_fp16_enable": s.tensorrt_fp16}
        if s.tensorrt_cache_dir:
            options.update(trt_engine_cache_enable=True, trt_engine_cache_path=str(s.tensorrt_cache_dir))
        return options
    return {}


def intra_op_threads(settings: Settings) -> int:
    """The configured count; by default ORT's (one per core) for one worker, the cores shared out for several."""
    if settings.intra_op_threads or settings.workers == 1:
        return settings.intra_op_threads
    return max(1, (os.cpu_count() or 1) // settings.workers)


def session_options(settings: Settings):
    import onnxruntime as ort
    levels = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
              "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
    opts = ort.SessionOptions()
    opts.graph_optimization_level = levels[settings.graph_optimization]
    opts.intra_op_num_threads = intra_op_threads(settings)
    opts.inter_op_num_threads = settings.inter_op_threads
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if settings.intra_op_spinning else "0")
    return opts


class OnnxModel:
    """One ONNX Runtime session over a vitserve artifact."""

    def __init__(self, session, info: ModelInfo):
        self.session = session
        self.info = info
        self.provider = session.get_providers()[0]  # the provider actually in use, after any fallback

    @classmethod
    def load(cls, settings: Settings) -> "OnnxModel":
        import onnxruntime as ort
        path = Path(settings.model_path)
        header = scan_model_file(path)
        parse_metadata(header.metadata)  # fail on a foreign ONNX file before paying for a session
        chain = provider_chain(settings, ort.get_available_providers())
        try:
            session = ort.InferenceSession(str(path), sess_options=session_options(settings),
                                           providers=[name for name, _ in chain],
                                           provider_options=[options for _, options in chain])
        except Exception as e:  # ORT raises its own Fail/InvalidProtobuf/... types
            raise ModelLoadError(f"cannot load ONNX model {path}: {e}") from e
        info = parse_metadata(session.get_modelmeta().custom_metadata_map, header.opset)
        _check_signature(session, info, path)
        model = cls(session, info)
        log.info("loaded %s %s (%s, opset %s) from %s on %s", info.name, info.version, info.precision,
                 info.opset, path, model.provider)
        preferred = settings.providers[0]
        if model.provider != _ORT_PROVIDER_NAMES[preferred]:
            # ORT falls back silently when a provider cannot start (no GPU visible, no driver, missing CUDA libraries).
            log.warning("%s was requested first but the model runs on %s (no GPU visible, or its driver or "
                        "CUDA/cuDNN libraries are missing)", preferred, model.provider)
        return model

    def run(self, pixel_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits, rollout = self.session.run(list(OUTPUT_NAMES), {INPUT_NAME: pixel_values})
        return logits, rollout


def _check_signature(session, info: ModelInfo, path: Path) -> None:
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name for o in session.get_outputs()}
    if INPUT_NAME not in inputs or not set(OUTPUT_NAMES) <= outputs:
        raise ModelLoadError(f"{path} must take '{INPUT_NAME}' and return {list(OUTPUT_NAMES)}; it takes "
                             f"{sorted(inputs)} and returns {sorted(outputs)}")
    shape = inputs[INPUT_NAME].shape
    if len(shape) != 4 or shape[1] not in (info.channels, None, "channels"):
        raise ModelLoadError(f"{path}: input shape {shape} does not match {info.channels} channels")


def warm_up(model: InferenceModel, batch_sizes: list[int]) -> None:
    """Run each batch size once at the trained resolution, so the first real request pays no set-up cost."""
    height, width = model.info.image_size
    for batch in batch_sizes:
        model.run(np.zeros((batch, model.info.channels, height, width), np.float32))
