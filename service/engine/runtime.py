"""The runtimes a model can be served on, registered once (`RUNTIMES`), and the choice among them: `load_model`
loads a file on the runtime the settings name, or with `auto` races each registered runtime's candidates against
ONNX Runtime and keeps the fastest that agrees with it; `load_engine_model` gives a light model one thread.

A new runtime is one file that defines its model (`InferenceModel`, service/engine/inference_model.py) and a
`RuntimeSpec`, and one line in `RUNTIMES`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from vitserve.artifact import ModelInfo
from vitserve.machine import has_int8_dot_product
from vitserve.service.engine import openvino_runtime
from vitserve.service.engine.cuda_graphs import call_times_ms, median_ms
from vitserve.service.engine.inference_model import InferenceModel, RuntimeSpec, disagrees, probe_pixels
from vitserve.service.engine.onnx_runtime import ONNX_RUNTIME, OnnxModel, read_artifact
from vitserve.service.engine.providers import runs_on_cpu
from vitserve.service.ground.errors import ModelLoadError
from vitserve.service.ground.processes import usable_cores
from vitserve.service.ground.settings import Settings

log = logging.getLogger("vitserve.runtime")

# The one registration of each runtime: its name is what --runtime and a repository config's `runtime` take.
RUNTIMES: dict[str, RuntimeSpec] = {spec.name: spec for spec in (ONNX_RUNTIME, openvino_runtime.OPENVINO)}


def runtime_named(name: str) -> RuntimeSpec:
    """The registered runtime `name`; a ModelLoadError naming those there are otherwise (as Triton refuses a model
    whose backend it does not have, at its load)."""
    spec = RUNTIMES.get(name)
    if spec is None:
        raise ModelLoadError(f"no runtime {name[:40]!r}: this server has {', '.join(['auto', *RUNTIMES])}")
    if not spec.available():
        raise ModelLoadError(f"runtime {name}: its package is not installed in this server")
    return spec


# A model whose batch-1 call at its trained size takes less than this with every core is light: a server of it is
# HTTP-bound, and on the CPU its engine is better off leaving the cores to the HTTP workers (service/engine).
LIGHT_MODEL_MS = 10.0


def load_engine_model(settings: Settings) -> InferenceModel:
    """The model for an engine process: `load_model`, and with the intra-op thread count left to us (0) on the
    CPU, a light model reloaded on one thread. The HTTP workers share the cores with the engine, and an ORT call
    spread over every core waits for the one a worker holds: vit-fmnist on 2 cores, 2 workers, served 315-525
    requests/s with 2 intra-op threads against 590-620 with one. A heavy model (ViT-S/16: 72 ms) keeps every core
    for its one-client latency. A light model is measured as `auto` left it (without its maps-free graph, when it
    raced), and loaded once, on one thread, with everything its settings ask for."""
    model, raced = chosen_model(settings)
    if settings.intra_op_threads or not runs_on_cpu(model.provider) or usable_cores() == 1:
        return with_maps_free(model, raced, settings)
    milliseconds = batch_one_ms(model)
    if milliseconds >= LIGHT_MODEL_MS:
        return with_maps_free(model, raced, settings)
    log.info("a light model (%.2f ms at batch 1 on every core): one intra-op thread, the other cores for the HTTP "
             "workers (--intra-op-threads sets it)", milliseconds)
    return on_one_thread(model, settings)


def on_one_thread(model: InferenceModel, settings: Settings) -> InferenceModel:
    """A light model loaded again on one intra-op thread, with everything its settings ask for, on the runtime and
    precision it has: choosing them again would cost the load as much again."""
    return load_model(settings.model_copy(update={"intra_op_threads": 1, **runtime_of(model)}))


def runtime_of(model: InferenceModel) -> dict[str, str]:
    """The runtime and precision `model` runs on, as the Settings fields that load it so again."""
    return {"runtime": model.runtime, "precision_hint": model.precision_hint}


# ------------------------------------------------------------------------------------------ choosing the runtime

# OpenVINO must beat ONNX Runtime by this much to be chosen: near a tie the choice would flip between restarts with
# the machine's noise, and with it the answers' last bits.
AUTO_MARGIN = 0.9


def load_model(settings: Settings) -> InferenceModel:
    """The model on the runtime and precision `settings.runtime` and `settings.precision_hint` name.

    A registered runtime's name: that runtime (`onnxruntime`: CUDA when there, else the CPU; `openvino`: the fast
    path compiled by OpenVINO for the CPU, the relevance path on ONNX Runtime). `auto`: ONNX Runtime on a GPU (the
    CUDA session is the mission's engine); on the CPU ONNX Runtime on the file's own precision and every candidate
    the other registered runtimes offer on this machine (OpenVINO: fp32, and bf16 where the CPU has bfloat16
    arithmetic) that agrees with it on probe images, timed at batch 1 and at the largest batch, the fastest kept,
    ONNX Runtime unless another is at least 10% faster. What it chose and why is logged; the model's provider (the
    card, /v2 config, metrics) names it."""
    return with_maps_free(*chosen_model(settings), settings)


def chosen_model(settings: Settings) -> tuple[InferenceModel, bool]:
    """The model `load_model` serves, and whether it won `auto`'s race, which the candidates other than ONNX Runtime
    run without their maps-free graphs (each would be built and timed for nothing)."""
    if settings.runtime != "auto":
        return runtime_named(settings.runtime).load(settings, None), False
    others = [spec for spec in RUNTIMES.values() if spec.candidates is not None and spec.available()]
    if not others:
        return ONNX_RUNTIME.load(settings, None), False
    artifact = read_artifact(Path(settings.model_path))  # once, for every candidate
    reference = OnnxModel.load(settings, artifact)
    if not runs_on_cpu(reference.provider):
        return reference, False
    racing = settings.model_copy(update={"maps_free": "off"})
    # first: the reference the others must beat
    candidates: dict[str, InferenceModel] = {f"onnxruntime/{reference.info.precision}": reference}
    for spec in others:
        assert spec.candidates is not None
        for name, model in spec.candidates(racing, artifact, reference):
            disagreement = disagrees(model, reference)
            if disagreement:
                log.warning("runtime auto: %s left out: %s", name, disagreement)
                continue
            candidates[name] = model
    chosen = choose_fastest(candidates, settings.max_batch_size)
    return chosen, chosen is not reference


def with_maps_free(model: InferenceModel, raced: bool, settings: Settings) -> InferenceModel:
    """`model`, or where it raced without its maps-free graph and the settings want one, the same runtime and
    precision loaded once more with it."""
    if not raced or settings.maps_free == "off":
        return model
    return load_model(settings.model_copy(update=runtime_of(model)))


def warn_if_int8_does_not_pay(info: ModelInfo, has_dot_product: Callable[[], bool] = has_int8_dot_product) -> bool:
    """Says so (and returns True) when an int8 file is served on a CPU without int8 dot-product units (VNNI, AMX),
    where its integer products are emulated and the float32 file is as fast or faster (docs/int8.md)."""
    if info.precision != "int8" or has_dot_product():
        return False
    log.warning("%s %s is int8, but this CPU has no int8 dot-product units (AVX512-VNNI, AVX-VNNI or AMX): int8 does "
                "not pay here, and the model's float32 file is likely as fast or faster (docs/int8.md)", info.name,
                info.version)
    return True


def choose_fastest(candidates: dict[str, InferenceModel], max_batch: int, rounds: int = 3) -> InferenceModel:
    """The candidate with the least time per image at batch 1 plus at `max_batch` (rounds alternate), the first
    (ONNX Runtime on the file's own precision) unless another is faster by more than AUTO_MARGIN: auto never serves
    a candidate slower than the file as it is."""
    if len(candidates) == 1:
        return next(iter(candidates.values()))
    info = next(iter(candidates.values())).info
    batches = {size: np.resize(probe_pixels(info), (size, info.channels, *info.image_size)).astype(np.float32)
               for size in sorted({1, max_batch})}
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, model in candidates.items():
            times[name].append(sum(batch_ms(model, pixels) / len(pixels) for pixels in batches.values()))
    cost = {name: float(np.median(t)) for name, t in times.items()}
    reference = next(iter(candidates))  # ONNX Runtime on the file's own precision
    best = min(cost, key=cost.__getitem__)
    if best != reference and cost[best] > AUTO_MARGIN * cost[reference]:
        best = reference
    log.info("runtime auto chose %s: ms per image at batch 1 plus at batch %d: %s", best, max_batch,
             ", ".join(f"{name} {ms:.3f}" for name, ms in cost.items()))
    return candidates[best]


def batch_ms(model: InferenceModel, pixels: np.ndarray, calls: int = 3) -> float:
    """The median ms of `calls` calls on `pixels`, after one that is not counted (it sets things up)."""
    return median_ms(lambda: model.run(pixels), calls)


def batch_one_ms(model: InferenceModel, calls: int = 9) -> float:
    """The fastest batch-1 call at the trained size (the first call, which sets things up, not counted): nearer the
    model's own cost than a median, which measures the machine's load as much. With both cores of this 2-core
    machine kept busy by other processes, the default model's median of 5 came to 6.5-9.4 ms (2.7 ms idle), near
    LIGHT_MODEL_MS; the fastest of 9, 3.0 and 7.8 ms. A server that misjudges takes the other thread count, and
    answers that differ in their last bits from another start's (1.9e-6 in a logit)."""
    pixels = np.zeros((1, model.info.channels, *model.info.image_size), np.float32)
    return min(call_times_ms(lambda: model.run(pixels), calls))


def warm_up(model: InferenceModel, batch_sizes: list[int]) -> list[int]:
    """Run each batch size once at the trained resolution, so the first real request pays no set-up cost: in the
    pixels' type the frontends will send (a model that `takes_raw_pixels` gets uint8 ones), on each graph the
    model serves (the maps-free one too, where it has one); the sizes a model pads its batches to on a GPU
    (`padded_batch_sizes`) too, twice. Returns the sizes run."""
    height, width = model.info.image_size
    dtype = np.uint8 if getattr(model, "takes_raw_pixels", False) else np.float32
    maps_free = getattr(model, "run_maps_free", None)
    padded = getattr(model, "padded_batch_sizes", [])
    # the sizes asked for first (1 and the largest by default: a runtime that plans for a range of sizes, as
    # TensorRT's engine does, then plans once for all of them), the padded ones after
    sizes = [*batch_sizes, *sorted(set(padded) - set(batch_sizes))]
    for batch in sizes:
        pixels = np.zeros((batch, model.info.channels, height, width), dtype)
        for _ in range(2 if batch in padded else 1):  # a size's second call on a GPU can still pay for its first
            model.run(pixels)
            if maps_free is not None:
                maps_free(pixels)
    return sorted(set(sizes))
