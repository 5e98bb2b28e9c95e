"""The runtimes a model can be served on, registered once (`RUNTIMES`), and the load on a plan: `load_model` serves
a file as its `ServingPlan` says (service/engine/serving_plan.py: the settings, a record of measurements made once by
`vitserve tune` (service/engine/tuning.py), or declared facts), and reports each stage of the load;
`load_engine_model` gives a light model one thread.

A new runtime is one file that defines its model (`InferenceModel`, service/engine/inference_model.py) and a
`RuntimeSpec`, and one line in `RUNTIMES`.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from vitserve.artifact import ModelInfo
from vitserve.machine import has_int8_dot_product
from vitserve.service.engine import openvino_runtime
from vitserve.service.engine.inference_model import Artifact, InferenceModel, RuntimeSpec, disagrees
from vitserve.service.engine.onnx_runtime import ONNX_RUNTIME, provider_chain, read_artifact
from vitserve.service.engine.providers import GPU_PROVIDERS
from vitserve.service.engine.serving_plan import ServingPlan, plan_key, read_record, serving_plan
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


def load_model(settings: Settings) -> InferenceModel:
    """The model of `settings.model_path` served as its plan says (`plan_for`: the settings, a record of this file
    on this machine, or declared facts; never a stopwatch), its capabilities carrying the plan and what each stage
    of the load took. The same file, machine and settings load the same way every time, and answer bit for bit
    the same."""
    return load_on_plan(settings)


def load_engine_model(settings: Settings) -> InferenceModel:
    """`load_model` for an engine process: a light model (its plan says so) on one intra-op thread where the count
    is left to us. The HTTP workers share the cores with the engine, and an ORT call spread over every core waits for
    the one a worker holds: vit-fmnist on 2 cores, 2 workers, served 315-525 requests/s with 2 intra-op threads
    against 590-620 with one. A heavy model (ViT-S/16: 72 ms) keeps every core for its one-client latency."""
    return load_on_plan(settings, light_on_one_thread=True)


class LoadStages:
    """The seconds each stage of a load took, in order: what the log line that says a version is ready reports."""

    def __init__(self) -> None:
        self.seconds: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def stage(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds.append((name, time.perf_counter() - started))


def load_on_plan(settings: Settings, light_on_one_thread: bool = False) -> InferenceModel:
    stages = LoadStages()
    with stages.stage("read"):
        artifact = read_artifact(Path(settings.model_path))
    with stages.stage("plan"):
        plan = plan_for(settings, artifact)
    served = settings.model_copy(update=plan.settings_update)
    if light_on_one_thread and plan.light and not settings.intra_op_threads and usable_cores() > 1:
        served = served.model_copy(update={"intra_op_threads": 1})
    with stages.stage("sessions"):
        model = runtime_named(plan.runtime).load(served, artifact)
    if plan.source == "declared" and plan.runtime != ONNX_RUNTIME.name:
        with stages.stage("check"):
            model, plan = checked_against_onnx_runtime(model, plan, served, artifact)
    model.capabilities = replace(model.capabilities, plan=plan, load_stages=tuple(stages.seconds))
    log.info("%s %s on %s (%s: %s; plan %s), %.0fM multiply-adds an image%s", artifact[0].name, artifact[0].version,
             model.provider, plan.source, plan.why, plan.key or "unrecorded", plan.multiply_adds / 1e6,
             ": light, one intra-op thread" if served.intra_op_threads == 1 and plan.light else "")
    return model


def plan_for(settings: Settings, artifact: Artifact) -> ServingPlan:
    """The file's plan on this machine (service/engine/serving_plan.py); with `tuning write-when-idle` and no record
    yet, the record made first where the machine is idle."""
    from vitserve.service.engine import tuning
    info, paths = artifact
    on_gpu = provider_chain(settings, available_providers())[0][0] in GPU_PROVIDERS
    key = plan_key(Path(settings.model_path), settings) if settings.tuning != "off" else None
    record = read_record(settings, key) if key is not None else None
    if key is not None and settings.tuning == "write-when-idle" and settings.runtime == "auto" and not on_gpu \
            and record is None:
        tuning.record_when_idle(settings, artifact, key)
        record = read_record(settings, key)
    # the other runtimes' facts only where they decide: a runtime named or recorded loads no other runtime's library
    # (OpenVINO's, with its telemetry process, into a server that serves on ONNX Runtime)
    if settings.runtime != "auto" or on_gpu or record is not None:
        bf16 = int8 = None
    else:
        bf16 = runtime_that(lambda spec: spec.computes_bf16())
        int8 = runtime_that(lambda spec: spec.computes_int8())
    return serving_plan(settings, info, paths.fast, on_gpu, bf16, record, int8, key.digest if key is not None else "")


def runtime_that(fact: Callable[[RuntimeSpec], bool]) -> str | None:
    """The first registered runtime installed here for which `fact` holds (`computes_bf16`, `computes_int8`)."""
    return next((spec.name for spec in RUNTIMES.values() if spec.available() and fact(spec)), None)


def available_providers() -> list[str]:
    import onnxruntime as ort
    return ort.get_available_providers()


def checked_against_onnx_runtime(model: InferenceModel, plan: ServingPlan, settings: Settings,
                                 artifact: Artifact) -> tuple[InferenceModel, ServingPlan]:
    """A declared plan's model on another runtime or precision than the file's own, checked against ONNX Runtime on
    the file's own precision on the probe images (`disagrees`: deterministic, no timing); where it disagrees, ONNX
    Runtime serves the file, with a warning."""
    reference = ONNX_RUNTIME.load(settings.model_copy(update={"runtime": ONNX_RUNTIME.name, "precision_hint": "auto",
                                                              "maps_free": "off", "batch_runners": 1}), artifact)
    disagreement = disagrees(model, reference)
    if not disagreement:
        return model, plan
    log.warning("%s left out: %s; ONNX Runtime serves the file's own precision", model.provider, disagreement)
    fallback = replace(plan, runtime=ONNX_RUNTIME.name, precision_hint="auto",
                       why=f"{model.provider} disagreed with the file's own precision ({disagreement})")
    return ONNX_RUNTIME.load(settings.model_copy(update=fallback.settings_update), artifact), fallback


def warn_if_int8_does_not_pay(info: ModelInfo, has_dot_product: Callable[[], bool] = has_int8_dot_product) -> bool:
    """Says so (and returns True) when an int8 file is served on a CPU without int8 dot-product units (VNNI, AMX),
    where its integer products are emulated and the float32 file is as fast or faster (docs/int8.md)."""
    if info.precision != "int8" or has_dot_product():
        return False
    log.warning("%s %s is int8, but this CPU has no int8 dot-product units (AVX512-VNNI, AVX-VNNI or AMX): int8 does "
                "not pay here, and the model's float32 file is likely as fast or faster (docs/int8.md)", info.name,
                info.version)
    return True


def warm_up(model: InferenceModel, batch_sizes: list[int]) -> list[int]:
    """Run each batch size once at the trained resolution, so the first real request pays no set-up cost: in the
    pixels' type the frontends will send (a model that takes raw pixels gets uint8 ones), on each graph the
    model serves (the maps-free one too, where it has one); the sizes a model pads its batches to on a GPU
    (`padded_batch_sizes`) too, twice. Returns the sizes run."""
    height, width = model.info.image_size
    capabilities = model.capabilities
    dtype = np.uint8 if capabilities.raw_pixels else np.float32
    maps_free, padded = capabilities.maps_free, capabilities.padded_batch_sizes
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
