"""`engine_choice`: where `vitserve serve --engine auto` (the default) puts the model, decided once before any worker
starts: a session in each HTTP worker (inline), or one engine process that every worker feeds (process).

A light model on the CPU is served faster from inside the HTTP workers. For it the engine process is a large share
of an answer: the way there and back (ZeroMQ's I/O threads, shared memory, the engine's loop and runner thread)
took 1.06 ms of a 4.7 ms answer at one client, and the engine runs such a model on one thread, so its batches use
one core while the other waits on the HTTP work. With a session of one thread in each worker both cores run the
model and no image leaves its process. On 2 cores, the default model on ONNX Runtime, beside the engine process in
the same runs: one client's p50 4.65 against 5.34 ms (docs/results/latency-budget.md); 1.49-1.66x the req/s at 8
clients and 1.05-1.32x at 32 on the image, OIP JSON and OIP binary paths (docs/results/bench-peers-triton.md). On
OpenVINO bf16, whose one-thread call is cheap enough that the engine's thread was not the bottleneck: 1.25-1.51x at
one client, 0.87-1.04x at 8 and 0.95-1.04x at 32 (docs/results/bench-peers-topology.md).

The engine process stays where it earns its hop: a GPU (one CUDA context and one session per device, fed by every
worker), a heavy model (in a worker its session would get a share of the cores; in the engine a lone request gets
all of them), and a model repository (versions loaded and unloaded on request, shadows, one registry that every
worker routes with).

What `auto` decides at load by timing (the runtime and precision, the maps-free graph) is decided here once and
handed to every worker pinned: workers that each raced would disagree start to start, and two workers' answers
to the same image would differ in their last bits.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import onnxruntime as ort

from vitserve.service.engine.onnx_runtime import provider_chain
from vitserve.service.engine.providers import CPU, runs_on_cpu
from vitserve.service.engine.runtime import LIGHT_MODEL_MS, batch_one_ms, chosen_model, on_one_thread, runtime_of
from vitserve.service.ground.processes import usable_cores
from vitserve.service.ground.settings import Settings


@dataclass(frozen=True)
class EngineChoice:
    engine: str  # "process" or "inline"
    why: str
    # settings every process of the server takes (names without the VITSERVE_ prefix): what auto chose, pinned
    pinned: dict[str, str] = field(default_factory=dict)

    @property
    def environment(self) -> dict[str, str]:
        return {"ENGINE": self.engine, **self.pinned}


def engine_choice(settings: Settings) -> EngineChoice | None:
    """Where the model runs, for `settings.engine` auto (None for process or inline: as set). Loads the model
    file here where the answer depends on it (on the CPU, a single file): `vitserve serve` runs this in a child
    process, so the memory goes with it."""
    if settings.engine != "auto":
        return None
    if settings.model_repository is not None:
        return EngineChoice("process", "a model repository: one registry that every HTTP worker routes with")
    if provider_chain(settings, ort.get_available_providers())[0][0] != CPU:
        return EngineChoice("process", "a GPU provider: one session per device, fed by every HTTP worker")
    if settings.intra_op_threads:
        # A thread count set for the server sizes one shared session (docs/kubernetes.md: the CPU limit); in each
        # of N workers it would put N times as many threads on the cores.
        return EngineChoice("process", f"--intra-op-threads {settings.intra_op_threads}: the threads of one shared "
                                       f"session")
    # Without its maps-free graph: a heavy model's engine times that graph itself, at its own load and on its own
    # threads, and a light model's is timed below on the one thread the workers will have. Timed here too, it
    # doubled the wait for a heavy model (ViT-S/16 on the Xeon: 27 s of a 71 s start). And on one batch runner:
    # the runners' wide copy of each candidate (service/engine/inference_model.py `wide_settings`) would be loaded
    # here only to be dropped.
    model, _ = chosen_model(settings.model_copy(update={"maps_free": "off", "batch_runners": 1}))
    pinned = {} if settings.runtime != "auto" else {name.upper(): value for name, value in runtime_of(model).items()}
    if not runs_on_cpu(model.provider):
        return EngineChoice("process", f"the model runs on {model.provider}", pinned)
    milliseconds = batch_one_ms(model)
    if milliseconds >= LIGHT_MODEL_MS:
        return EngineChoice("process", f"a heavy model ({milliseconds:.1f} ms at batch 1): one session with every "
                                       f"core", pinned)
    # one thread in each worker: the engine's own rule for a light model (service/engine/runtime.py)
    pinned["INTRA_OP_THREADS"] = "1"
    pinned["WORKERS"] = str(settings.workers or usable_cores())
    if settings.maps_free == "auto":  # timed at load: decided here, on the thread the workers will have
        maps_free = getattr(on_one_thread(model, settings), "run_maps_free", None) is not None
        pinned["MAPS_FREE"] = "on" if maps_free else "off"
    return EngineChoice("inline", f"a light model on the CPU ({milliseconds:.2f} ms at batch 1): a session of "
                                  f"{pinned['INTRA_OP_THREADS']} thread(s) in each of the {pinned['WORKERS']} HTTP "
                                  f"workers", pinned)
