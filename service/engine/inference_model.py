"""The contract between the server and a model, whatever runtime computes it: `InferenceModel` (what the engine
calls), `RuntimeSpec` (what a runtime registers to be chosen by name: service/engine/runtime.py's `RUNTIMES`), and
what every runtime's load shares (the thread count it is given, the probe images a stand-in must agree on).

A runtime is one file: ONNX Runtime's is service/engine/onnx_runtime.py, OpenVINO's service/engine/openvino_runtime.py.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from vitserve.artifact import ArtifactError, ModelInfo
from vitserve.onnx_header import read_model_info
from vitserve.service.engine.graph_paths import ModelPaths
from vitserve.service.engine.serving_plan import ServingPlan
from vitserve.service.ground.errors import ModelLoadError
from vitserve.service.ground.processes import usable_cores

if TYPE_CHECKING:  # pydantic's settings stay out of the runtimes: the peers' venvs compile models without them
    from vitserve.service.ground.settings import Settings

log = logging.getLogger("vitserve.runtime")

Artifact = tuple[ModelInfo, ModelPaths]  # a file's info and graphs, read once for every runtime that loads it
Outputs = tuple[np.ndarray, ...]  # the arrays `info.output_names()` names, in its order, each (B, ...)


@dataclass(frozen=True)
class Capabilities:
    """What a loaded model offers the engine beside `run` and `explain`, declared by its runtime at load (never
    probed): the batcher and `ServedModel.run_batch` read this one object.

    `raw_pixels`: `run` also takes (B, C, H, W) uint8 pixels and normalises them on the model's device
    (service/engine/pixels.py). `maps_free`: `run`'s outputs with the rollout empty (B, 0), for batches that need no
    map (None: `run` serves them). `wide`: the same model loaded with every core's thread, for a batch of one with
    nothing beside it where the batcher's runners share the cores out (None: the runners run every batch).
    `padded_batch_sizes`: the batch sizes a GPU session pads to, each run at warm-up. `cuda_graphs`: batches at the
    trained size run as captured CUDA graphs. `plan`: how it came to be served so (service/engine/serving_plan.py;
    None for a model handed over whole, as tests do), `load_stages`: what each stage of its load took, in seconds."""

    raw_pixels: bool = False
    maps_free: Callable[[np.ndarray], Outputs] | None = None
    wide: InferenceModel | None = None
    padded_batch_sizes: tuple[int, ...] = ()
    cuda_graphs: bool = False
    plan: ServingPlan | None = None
    load_stages: tuple[tuple[str, float], ...] = ()


class InferenceModel(Protocol):
    """The contract between the server and a model: pixels (B, C, H, W) -> (logits (B, K), rollout (B, h, w), then
    the file's optional outputs); and, for a model whose `info.explains_classes`, the relevance path: pixels and a
    target class per image (B,) (-1: the top-1) -> (logits, rollout, relevance (B, h, w), then the optional ones).
    Pixels are float32, normalised, or uint8 where `capabilities.raw_pixels`; what else the model offers is its
    `capabilities`."""

    info: ModelInfo
    provider: str
    runtime: str  # the registered name of the runtime that computes it (service/engine/runtime.py's RUNTIMES)
    precision_hint: str  # the settings' precision_hint that loads it again as it is

    capabilities: Capabilities  # declared by its runtime at load; `load_model` adds the plan and the load's stages

    def run(self, pixel_values: np.ndarray) -> Outputs: ...

    def explain(self, pixel_values: np.ndarray, targets: np.ndarray) -> Outputs: ...


def read_model_file_info(path: Path) -> ModelInfo:
    """The artifact's ModelInfo from the file alone (no session): a foreign or broken file is a ModelLoadError."""
    try:
        return read_model_info(path)
    except ArtifactError as e:
        raise ModelLoadError(str(e)) from e


def intra_op_threads(settings: Settings) -> int:
    """The configured count; by default ORT's (one per core) for an engine process or a single worker running one
    batch at a time, else the cores shared out among inline workers (each has its own session) and among the
    batches each runs at once (`batch_runners`)."""
    if settings.intra_op_threads:
        return settings.intra_op_threads
    workers = settings.http_workers if settings.engine == "inline" else 1
    sharing = workers * settings.batch_runners
    return 0 if sharing == 1 else max(1, usable_cores() // sharing)


def wide_settings(settings: Settings, on_cpu: bool) -> Settings | None:
    """The settings of the model loaded a second time with every core's thread (each runtime's `wide`), or None
    where the model has them already. Only where the batcher's runners share the cores out (`batch_runners`) on the
    CPU: there a batch of one with nothing beside it would run on one core of two. Runners
    each on one thread serve more under load than one call on every core: a thread of an ONNX Runtime call that
    loses its core to a decoder or an HTTP worker holds the call up, and its caller busy-waits at the end of each
    parallel loop (`python -m vitserve.bench.interference`, docs/results.md); so the wide copy runs only the
    batches that have the cores to themselves."""
    if settings.batch_runners == 1 or not on_cpu or settings.intra_op_threads:
        return None
    wide = settings.model_copy(update={"batch_runners": 1})
    threads = [intra_op_threads(s) or usable_cores() for s in (wide, settings)]  # 0: the runtime's own, every core
    return wide if threads[0] > threads[1] else None


def probe_pixels(info: ModelInfo, count: int = 16) -> np.ndarray:
    """Deterministic images at the trained size (smooth patterns plus noise, normalised as the server does)."""
    rng = np.random.default_rng(0)
    height, width = info.image_size
    yy, xx = np.mgrid[0:height, 0:width] / max(height, width)
    images = [np.sin(2 * np.pi * (rng.uniform(0.5, 3) * xx + rng.uniform(0.5, 3) * yy) + rng.uniform(0, 6))
              for _ in range(count * info.channels)]
    pixels = (np.stack(images).reshape(count, info.channels, height, width) * 100 + 128
              + rng.normal(0, 20, (count, info.channels, height, width))).clip(0, 255)
    mean, std = np.asarray(info.mean)[:, None, None], np.asarray(info.std)[:, None, None]
    return ((pixels / 255 - mean) / std).astype(np.float32)


def disagrees(model: InferenceModel, reference: InferenceModel) -> str:
    """Why `model` may not stand in for `reference` (ONNX Runtime float32), or "" (`logits_disagree` on the probe
    images)."""
    pixels = probe_pixels(model.info)
    return logits_disagree(model.run(pixels)[0], reference.run(pixels)[0])


def logits_disagree(got: np.ndarray, want: np.ndarray) -> str:
    """Why logits `got` may not stand in for `want`, or "": the same top-1 on every image whose reference top-2
    margin is clear (over 5% of its largest |logit|), logits within 5% of the largest."""
    scale = max(1.0, float(np.abs(want).max()))
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.05 * scale
    changed = int((got.argmax(1) != want.argmax(1))[clear].sum())
    worst = float(np.abs(got - want).max()) / scale
    if changed or worst > 0.05:
        return f"{changed} of {int(clear.sum())} clear probe images change class, logits {worst:.2%} apart"
    return ""


@dataclass(frozen=True)
class RuntimeSpec:
    """A runtime the server can serve a model on, by the name `--runtime` and a repository config's `runtime` give.

    `load(settings, artifact)`: the model of `settings.model_path` at `settings.precision_hint` (`artifact`: the
    file's info and graphs when the caller has read them, else None). `available()`: whether this machine has the
    runtime's package. `computes_bf16()`: whether it computes bfloat16 on this machine's units (a declared fact:
    `--runtime auto` serves such a runtime in bf16 where no record says otherwise, service/engine/serving_plan.py);
    `computes_int8()`: whether it runs an int8 file's quantized layers as integer products on this machine's units
    (declared the same way, for int8 files).
    `candidates(settings, artifact, reference)`: the models this runtime offers `vitserve tune` to measure against
    ONNX Runtime on the file's own precision (`reference`), each by the name the record gives it; None: it takes no
    part."""

    name: str
    load: Callable[[Settings, Artifact | None], InferenceModel]
    available: Callable[[], bool] = lambda: True
    computes_bf16: Callable[[], bool] = lambda: False
    computes_int8: Callable[[], bool] = lambda: False
    candidates: Callable[[Settings, Artifact, InferenceModel], Iterator[tuple[str, InferenceModel]]] | None = None
