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
