"""`engine_choice`: where `vitserve serve --engine auto` (the default) puts the model, decided once before any worker
starts: a session in each HTTP worker (inline), or one engine process that every worker feeds (process).

A light model on the CPU is served faster from inside the HTTP workers, at one client and at 32. For it the engine
process is a large share of an answer (the way there and back: ZeroMQ, shared memory, the engine's loop), and a
session of one thread in each worker puts every core on the model with no image leaving its process. What once made
this topology lose under load was OpenVINO pinning each process's inference thread to the same first core (both
workers' inferences on one core, the other serving HTTP alone); unpinned where a model does not own every core
(openvino_runtime.py `pins_cores`), on a 2-core AMD EPYC with AVX512-BF16, the default model on OpenVINO bf16,
alternating rounds (docs/results/bench-peers.md#topology), it serves 32 clients with more answers than the engine
process and the lone-request path (service/engine/lone_path.py, the engine for every batch and a lone request in its
worker: `--engine process --lone-request-path true`): 1,184 / 1,227 / 1,328 req/s on the image, OIP JSON and OIP
binary paths against 891 / 1,171 / 1,069 and 883 / 1,076 / 1,255 (Triton's Python backend: 491 / 664 / 583, its p99
above all three), and one client as fast (p50 2.5 / 3.0 / 2.0 ms against 4.0 / 4.4 / 4.5 and 2.9 / 2.4 / 1.8).

The engine process stays where it earns its hop: a GPU (one CUDA context and one session per device, fed by every
worker), a heavy model (in a worker its session would get a share of the cores; in the engine a lone request gets
all of them), and a model repository (versions loaded and unloaded on request, shadows, one registry that every
worker routes with).

The choice reads the file's plan (service/engine/serving_plan.py: a tuning record, else declared facts; nothing is
timed here), the same plan every worker then loads: the workers serve the file alike, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from vitserve.service.engine.onnx_runtime import provider_chain, read_artifact
from vitserve.service.engine.providers import CPU
from vitserve.service.engine.runtime import available_providers, plan_for
from vitserve.service.ground.processes import usable_cores
from vitserve.service.ground.settings import Settings


@dataclass(frozen=True)
class EngineChoice:
    engine: str  # "process" or "inline"
    why: str
    # settings every process of the server takes (names without the VITSERVE_ prefix)
    pinned: dict[str, str] = field(default_factory=dict)

    @property
    def environment(self) -> dict[str, str]:
        return {"ENGINE": self.engine, **self.pinned}


def engine_choice(settings: Settings) -> EngineChoice | None:
    """Where the model runs, for `settings.engine` auto (None for process or inline: as set). Reads the file and its
    plan (no session is made): `vitserve serve` runs this in a child process, so the runtimes' libraries it imports
    go with it."""
    if settings.engine != "auto":
        return None
    if settings.model_repository is not None:
        return EngineChoice("process", "a model repository: one registry that every HTTP worker routes with")
    if settings.intra_op_threads:
        # A thread count set for the server sizes one shared session (docs/kubernetes.md: the CPU limit); in each
        # of N workers it would put N times as many threads on the cores.
        return EngineChoice("process", f"--intra-op-threads {settings.intra_op_threads}: the threads of one shared "
                                       f"session")
    if provider_chain(settings, available_providers())[0][0] != CPU:
        return EngineChoice("process", "a GPU provider: one session per device, fed by every HTTP worker")
    plan = plan_for(settings, read_artifact(Path(settings.model_path)))
    if not plan.light:
        return EngineChoice("process", f"a heavy model ({plan.multiply_adds / 1e6:.0f}M multiply-adds an image, "
                                       f"{plan.source}): one session with every core")
    # one thread in each worker: the engine's own rule for a light model (service/engine/runtime.py)
    pinned = {"INTRA_OP_THREADS": "1", "WORKERS": str(settings.workers or usable_cores())}
    return EngineChoice("inline", f"a light model on the CPU ({plan.multiply_adds / 1e6:.0f}M multiply-adds an "
                                  f"image, {plan.source}): a session of 1 thread in each of the {pinned['WORKERS']} "
                                  f"HTTP workers", pinned)
