"""`engine_choice`: where `vitserve serve --engine auto` (the default) puts the model, decided once before any worker
starts: one engine process that every HTTP worker feeds (process), for a light model on the CPU with each worker also
running a lone request on a session of its own (the lone-request path, service/engine/lone_path.py).

Each plain topology wins at one end for a light model on the CPU, where an answer is mostly HTTP work. A session in
each HTTP worker (inline) serves a lone request with no hop, but under load the kernel's accept race splits the
connections unevenly between the workers and a worker cannot lend its work to the other's session; one engine process
batches every worker's images on one queue whatever the split, but a lone request pays the way there and back. The
lone-request path keeps both: on a 2-core AMD EPYC with AVX512-BF16, the default model on OpenVINO bf16, medians of
two alternating rounds (docs/results/bench-peers-topology.md): at one client p50 3.1 / 1.8 / 2.2 ms on the image,
OIP JSON and OIP binary paths (inline 3.1 / 3.3 / 2.6, the engine alone 4.7 / 4.3 / 3.8); at 32 clients 918 / 1,104 /
992 req/s (inline 711 / 787 / 836, the engine alone 808 / 990 / 1,007), 1.70-1.89x Triton's Python backend with a
p99 below Triton's.

The engine process, without the lone path, is where the model is not light: a GPU (one CUDA context and one session
per device, fed by every worker), a heavy model (in a worker its session would get a share of the cores; in the
engine a lone request gets all of them), and a model repository (versions loaded and unloaded on request, shadows,
one registry that every worker routes with).

The choice reads the file's plan (service/engine/serving_plan.py: a tuning record, else declared facts; nothing is
timed here), the same plan the engine and every worker then load: they serve the file alike, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from vitserve.service.engine.onnx_runtime import provider_chain, read_artifact
from vitserve.service.engine.providers import CPU
from vitserve.service.engine.runtime import available_providers, plan_for
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
    # every batch in the engine, a lone request in its worker, each on one thread (service/engine/lone_path.py)
    return EngineChoice("process", f"a light model on the CPU ({plan.multiply_adds / 1e6:.0f}M multiply-adds an "
                                   f"image, {plan.source}): one engine process batches every worker's requests on 1 "
                                   f"thread, and each HTTP worker runs a lone request on its own session of 1 thread",
                        {"LONE_REQUEST_PATH": "true"})
