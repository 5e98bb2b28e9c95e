"""The per-process serving state, made in the app's lifespan and reached by routes through dependencies
(service/http/dependencies.py) and by the gRPC servicer directly: the settings, the metrics, the engine, and one
object per concern beside them: `admission` (what is let in), `images` (where images are decoded:
service/usecases/image_pools.py), `drain` (shutdown: service/ground/drain.py), `inspections` (the inspection cache).

`ServiceState.start` starts the engine (`service/engine/`: in this process, a bad model stops startup; or
the connection to an engine process); the service reports ready only while the engine is ready (warmed up) and
the process is not draining.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

from vitserve.service.engine import Engine
from vitserve.service.engine.pixels import engine_normalises
from vitserve.service.ground.drain import Drain
from vitserve.service.ground.errors import NotReady
from vitserve.service.ground.memory import return_large_frees_to_the_os
from vitserve.service.ground.metrics import ServiceMetrics, mark_process_dead
from vitserve.service.ground.settings import Settings
from vitserve.service.usecases.admission import Admission
from vitserve.service.usecases.image_pools import ImagePools
from vitserve.service.usecases.inspection import InspectionCache

log = logging.getLogger("vitserve.service")


@dataclass
class ServiceState:
    settings: Settings
    metrics: ServiceMetrics
    engine: Engine  # the session and batcher: in this process, or in an engine process every frontend feeds
    drain: Drain = field(init=False)
    admission: Admission = field(init=False)  # made by start(), before the first call
    images: ImagePools = field(init=False)  # made by start(), before the first call
    inspections: InspectionCache = field(default_factory=InspectionCache)  # GET /v1/models/{name}/inspect

    def __post_init__(self) -> None:
        self.drain = Drain(self.settings.drain_timeout_s, on_begin=lambda: self.metrics.set_worker_ready(False))

    @property
    def ready(self) -> bool:
        """Serving: the engine is ready (loaded, warmed up, reachable) and this process is not shutting down."""
        return self.engine.ready and not self.drain.draining

    def require_ready(self) -> None:
        """NotReady (503, UNAVAILABLE) unless `ready`: warming up or shutting down."""
        if not self.ready:
            raise NotReady("the model is not ready (warming up or shutting down)")

    async def start(self) -> None:
        s = self.settings
        self.engine.on_ready = lambda ready: self.metrics.set_worker_ready(ready and not self.drain.draining)
        self.metrics.set_workers(s.http_workers)
        await self.engine.start()  # the engine that holds the model reports it (metrics.set_model)
        self.images = ImagePools(s, lambda: engine_normalises(s.pixel_transport, self.engine.provider))
        self.admission = Admission(s.max_requests_in_flight, s.max_loop_lag_ms / 1000 if s.max_loop_lag_ms else None,
                                   s.overload_queue_ms / 1000 if s.overload_queue_ms else None,
                                   min_shed_in_flight=shedding_floor(s))
        self.admission.loop_lag.start()
        return_large_frees_to_the_os()
        self.drain.install_signal_handlers()

    async def stop(self) -> None:
        self.drain.end()
        self.metrics.set_worker_ready(False)
        if hasattr(self, "admission"):  # a start that failed before making it
            self.admission.loop_lag.stop()
        await self.engine.close(self.settings.drain_timeout_s)
        if hasattr(self, "images"):
            self.images.stop()
        mark_process_dead(os.getpid())


def shedding_floor(s: Settings) -> int:
    """Requests a shedding process still admits: its share of the engine's batches (max_batches_in_flight of
    max_batch_size among the HTTP workers), since fewer leave the engine small batches that cost more per
    image (docs/reliability.md); 0 with overload_keeps_batches off."""
    if not s.overload_keeps_batches:
        return 0
    return math.ceil(s.max_batch_size * s.max_batches_in_flight / max(1, s.http_workers))
