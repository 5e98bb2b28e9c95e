"""One inference call's way through the service, whatever transport brought it:

    admit -> deadline -> resolve the model version -> (the transport reads its body) -> decode -> submit -> encode

The deadline is made once, by `admit`: the server's (request_timeout_s), or the client's own when that is sooner
(gRPC's deadline; later the protocol's `timeout` parameter, through `Call.shorten`). Every wait on the call's work
honours it through `Call.run`: the use cases' (service/usecases/inference.py) and the transport's read of its body.

Every transport enters it the same way, with `admit`: the handlers of HTTP's inference route table (/v1/classify,
/v1/classify/batch, /v1/embed, /v2/.../infer; service/http/inference_routes.py), and gRPC's
ModelInfer. What each transport still owns is its protocol: reading its body, its error shapes and codes, its
request metrics and server span (the HTTP middleware's and the gRPC frame's, over every route, not only these).

    with admit(state, model_named_by_the_request, on_route=remember, client_seconds_left=...) as call:
        call.route(name, version)            # ModelNotFound, ModelUnavailable, ...: before any body byte is read
        body = await call.run(reading, on_timeout=RequestTimeout(...), watch=False)
        answer = await inference.classify_image(call, body, options)  # or classify_images, embed_..., infer
    call.served                              # (name, version) of the version that ran it, also given to on_route

The use cases (service/usecases/inference.py) take the `Call` and record the stages' metrics and spans once, for every
transport. The early refusal (`would_refuse`) lets a transport refuse from its first bytes what `admit` would
refuse (HTTP's connection does, before the app), counted as a refused answer.
"""
from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from vitserve.service.engine import ModelHandle
from vitserve.service.ground.deadlines import Deadline, run_within
from vitserve.service.ground.errors import ServiceError
from vitserve.service.usecases.state import ServiceState


@dataclass
class Call:
    """An admitted inference call: in flight from `admit` until its `with` block ends."""

    state: ServiceState
    requested: str | None  # the model the request named (None: the only one), for Retry-After and routing
    deadline: Deadline
    on_route: Callable[[str, str], None] | None = None  # the transport's record of the version for its metrics
    watch_client: Callable[[], Awaitable] | None = None  # completes when the client hangs up (the transport's)
    started: float = field(default_factory=time.perf_counter)
    served: tuple[str, str] = ("", "")
    # where the call's time went, (stage, seconds) in order: the pipeline's, the use cases' and the transport's
    # (docs/latency-budget.md); HTTP sends them as a Server-Timing header with the server_timing setting
    stages: list[tuple[str, float]] = field(default_factory=list)
    received: float = 0.0  # when the transport took the request in (time.perf_counter)
    images_decoded: int = 0  # images whose decode this call began (only its first may be decoded on the loop)
    # the version `route` chose (set there, read by the use cases, which run after it): a plain attribute, not a
    # property with a check, on the path every request takes
    handle: ModelHandle = field(init=False)

    def route(self, name: str | None, version: str | None) -> ModelHandle:
        """The version this call runs on (None: the only model; its newest ready version)."""
        started = time.perf_counter()
        self.handle = self.state.engine.route(name, version)
        self.ran_on(self.handle.name, self.handle.version)
        self.stages.append(("route", time.perf_counter() - started))
        return self.handle

    @property
    def alone(self) -> bool:
        """Whether it is the only call in flight in this process, from the only client connected: nobody waits
        behind work it does on the event loop (its first image's decode, a light model's batch of one)."""
        return self.state.admission.alone

    def ran_on(self, name: str, version: str) -> None:
        """The version that answered (the routed one, unless it was retired while the call waited)."""
        self.served = (name, version)
        if self.on_route is not None:
            self.on_route(name, version)

    def shorten(self, seconds_left: float | None) -> None:
        """The client's own deadline (seconds from the call's start) can only make the server's earlier."""
        if seconds_left is not None:
            self.deadline = Deadline(min(self.deadline.at, self.started + seconds_left))

    async def run(self, awaitable, *, on_timeout: ServiceError | None = None, watch: bool = True):
        """`awaitable` within the call's deadline and the server's drain; with `watch`, also cancelled when the
        client hangs up (once its body has been read: until then the transport's read sees it)."""
        disconnected = self.watch_client() if watch and self.watch_client is not None else None
        return await run_within(awaitable, self.deadline, self.state.drain.stopping, disconnected=disconnected,
                                on_timeout=on_timeout)


@contextmanager
def admit(state: ServiceState, requested: str | None, *, on_route: Callable[[str, str], None] | None = None,
          watch_client: Callable[[], Awaitable] | None = None, received: float | None = None,
          client_seconds_left: float | None = None) -> Iterator[Call]:
    """The call, once admitted: NotReady (warming up, shutting down) or Overloaded at once otherwise, before its
    body is read. The queued work it is measured against is its own model's: an overloaded big model does not
    refuse a small one's requests. The deadline starts here: request_timeout_s, or `client_seconds_left` (the
    client's own deadline, as its transport carries one) when sooner. `received`: when the transport took the
    request in (time.perf_counter), for the call's first stage, `accept`."""
    entered = time.perf_counter()
    state.require_ready()
    admission = state.admission
    admission.enter(state.engine.predicted_wait_s(requested), state.queue_wait_limit_s)
    try:
        call = Call(state, requested, Deadline.after(state.request_timeout_s), on_route, watch_client)
        call.shorten(client_seconds_left)
        call.received = received or entered
        call.stages += (("accept", entered - call.received), ("admit", call.started - entered))
        yield call
    finally:
        admission.leave()


def would_refuse(state: ServiceState, endpoint: str, requested: str | None) -> tuple[ServiceError, int] | None:
    """The error and Retry-After seconds of a call that `admit` would refuse now for overload, or None; a refusal
    is counted here as a refused answer on `endpoint`. For a transport that can answer before it has the request
    (HTTP's connection, from the request line): under overload a refusal must cost far less than an answer."""
    if not state.ready:
        return None
    wait_s = state.engine.predicted_wait_s(requested)
    refused = state.admission.refusal(wait_s, state.queue_wait_limit_s)
    if refused is None:
        return None
    state.metrics.refused_at_once(endpoint, refused.code)
    return refused, _retry_after(state, wait_s)


def retry_after_s(state: ServiceState, requested: str | None = None) -> int:
    """Seconds a refused client should wait: the time the model's queued work needs to run (at least the
    setting)."""
    return _retry_after(state, state.engine.predicted_wait_s(requested))


def _retry_after(state: ServiceState, predicted_wait_s: float) -> int:
    return max(state.settings.retry_after_s, math.ceil(predicted_wait_s))
