"""One request's record, whatever transport brought it: in flight from its start; then its duration, status and the
model version that ran it in `vitserve_request_duration_seconds`, and its outcome on its server span (when traced).
HTTP's middleware (service/app.py `RequestRecordMiddleware`) and gRPC's frame (service/grpc/servicer.py `rpc`) each
make one per request and call `done` once, so that both transports count and trace in the same words.
"""
from __future__ import annotations

import time

from vitserve.service.ground import tracing
from vitserve.service.ground.metrics import ServiceMetrics


class RequestRecord:
    __slots__ = ("metrics", "span", "started")

    def __init__(self, metrics: ServiceMetrics, span=None):
        self.metrics, self.span, self.started = metrics, span, time.perf_counter()
        metrics.request_started()

    def done(self, endpoint: str, status: int | str, *, fault: bool, model: str = "", version: str = "",
             protocol: str = "http") -> None:
        """The request's end: `status` is its transport's (an HTTP status, a gRPC code's name); `fault` says the
        server failed it (5xx, INTERNAL, ...), marked as an error on its span."""
        self.metrics.request_done(endpoint, status, time.perf_counter() - self.started, model, version,
                                  protocol=protocol)
        tracing.record_outcome(self.span, status, fault, model, version)
