"""The contract between the server and a model, whatever runtime computes it: `InferenceModel` (what the engine
calls), `RuntimeSpec` (what a runtime registers to be chosen by name: service/engine/runtime.py's `RUNTIMES`), and
what every runtime's load shares (the thread count it is given, the probe images a stand-in must agree on).

A runtime is one file: ONNX Runtime's is service/engine/onnx_runtime.py, OpenVINO's service/engine/openvino_runtime.py.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from vitserve.artifact import ArtifactError, ModelInfo
from vitserve.onnx_header import read_model_info
from vitserve.service.engine.cuda_graphs import call_times_ms
from vitserve.service.engine.graph_paths import ModelPaths
from vitserve.service.ground.errors import ModelLoadError
from vitserve.service.ground.processes import usable_cores
from vitserve.service.ground.settings import Settings

log = logging.getLogger("vitserve.runtime")

Artifact = tuple[ModelInfo, ModelPaths]  # a file's info and graphs, read once for every runtime that loads it
Outputs = tuple[np.ndarray, ...]  # the arrays `info.output_names()` names, in its order, each (B, ...)


class InferenceModel(Protocol):
    """The contract between the server and a model: pixels (B, C, H, W) -> (logits (B, K), rollout (B, h, w), then
    the file's optional outputs); and, for a model whose `info.explains_classes`, the relevance path: pixels and a
    target class per image (B,) (-1: the top-1) -> (logits, rollout, relevance (B, h, w), then the optional ones).
    Pixels are float32, normalised; a model whose `takes_raw_pixels` is true also takes them uint8 on the fast path
    (service/engine/pixels.py). `run_maps_free`: `run`'s outputs with the rollout empty (B, 0), for batches that
    need no map (None: `run` serves them). `wide`: the same model loaded with every core's thread, for a batch of one
    with nothing beside it where the batcher's runners share the cores out (None: the runners run every batch). The
    server reads those three with getattr, so a model without them (a test's wrapper) takes float32 and runs every
    batch with its maps on its runners."""

    info: ModelInfo
    provider: str
    runtime: str  # the registered name of the runtime that computes it (service/engine/runtime.py's RUNTIMES)
    precision_hint: str  # the settings' precision_hint that loads it again as it is

    @property
    def takes_raw_pixels(self) -> bool: ...

    @property
    def run_maps_free(self) -> Callable[[np.ndarray], Outputs] | None: ...

    @property
    def wide(self) -> InferenceModel | None: ...

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
    runtime's package. `candidates(settings, artifact, reference)`: for `--runtime auto` on the CPU, the models this
    runtime offers to race ONNX Runtime on the file's own precision (`reference`), each by the name the log gives
    it; None: it takes no part in `auto`."""

    name: str
    load: Callable[[Settings, Artifact | None], InferenceModel]
    available: Callable[[], bool] = lambda: True
    candidates: Callable[[Settings, Artifact, InferenceModel], Iterator[tuple[str, InferenceModel]]] | None = None


# On a CPU a maps-free graph is kept under `maps_free: auto` when it costs at most this share of the rollout graph's
# time: a smaller gain is within the load-time measurement's noise, and not worth the second graph's memory.
MAPS_FREE_CPU_SHARE = 0.95
# Each size's cost in a round is the fastest of MAPS_FREE_CALLS calls, or of as many as fit in MAPS_FREE_ROUND_MS
# (at least MAPS_FREE_MIN_CALLS) for a graph whose calls are long: such a call's own noise is small beside the
# share's 5%, and 7 calls of ViT-S/16 at batch 8 in each of 3 rounds for both graphs took 26 s of its 38 s start on a
# 2-core Xeon. A light model (milliseconds a call) keeps its 7.
MAPS_FREE_CALLS, MAPS_FREE_MIN_CALLS, MAPS_FREE_ROUND_MS = 7, 3, 1000.0


def maps_free_pays(run_with_maps: Callable[[np.ndarray], Outputs], run_maps_free: Callable[[np.ndarray], Outputs],
                   info: ModelInfo, max_batch: int, rounds: int = 3) -> bool:
    """Whether the maps-free graph costs at most MAPS_FREE_CPU_SHARE of the rollout graph's time per image at batch 1
    plus at batch min(max_batch, 8), the two timed alternately at load (each size's fastest call of a round, the
    median of the rounds: nearer the graphs' own cost than a median of calls on a machine others share): on a CPU
    the gain depends on the chip and the runtime (the default model on a Xeon with AVX-512: 5-15%; none measured on
    an EPYC with AVX2). Near the share the choice can differ between starts, and with it a map=none answer's last
    bits (1e-6 of a logit), as the light model's thread count can (service/engine/runtime.py). Logged."""
    sizes = sorted({1, max(1, min(max_batch, 8))})
    batches = [np.resize(probe_pixels(info), (size, info.channels, *info.image_size)).astype(np.float32)
               for size in sizes]
    graphs = {"rollout": run_with_maps, "maps-free": run_maps_free}
    # one call of each graph and size sets it up (not counted) and says how many of its calls a round can afford
    calls = {}
    for name, run in graphs.items():
        for i, x in enumerate(batches):
            set_up_ms = max(call_times_ms(functools.partial(run, x), 1, set_up=False)[0], 1e-3)
            calls[name, i] = max(MAPS_FREE_MIN_CALLS, min(MAPS_FREE_CALLS, int(MAPS_FREE_ROUND_MS // set_up_ms)))
    costs: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, run in graphs.items():
            costs[name].append(sum(min(call_times_ms(functools.partial(run, x), calls[name, i], set_up=False))
                                   / len(x) for i, x in enumerate(batches)))
    with_maps, without = (float(np.median(costs[name])) for name in ("rollout", "maps-free"))
    pays = without <= MAPS_FREE_CPU_SHARE * with_maps
    log.info("maps-free graph of %s %s %s on this CPU: %.3f ms per image at batch %s against the rollout graph's %.3f",
             info.name, info.version, "kept" if pays else "left out", without, " plus ".join(map(str, sizes)),
             with_maps)
    return pays
