"""vitserve on Ray Serve: the same FastAPI app in every replica, behind Ray's HTTP proxy.

    vitserve serve --ray --model MODEL.onnx --ray-replicas 2              # a local Ray cluster, or
    vitserve serve --ray --ray-address auto ...                           # the cluster this node is in
    serve run service.ray_serve:build_app model_path=/abs/MODEL.onnx ray_replicas=2    # Ray's own CLI
    serve deploy deploy/ray/serve-config.yaml                             # a cluster, or KubeRay's RayService

Each replica is one Ray actor holding one ONNX Runtime session and its dynamic batcher (engine=inline). Ray's
proxy routes requests to replicas, its controller starts, replaces and autoscales them; admission, limits,
deadlines and errors stay the app's own, per replica. Ray's router holds at most `ray_max_queued_requests`
requests when every replica has `max_requests_in_flight`, and answers 429 beyond that.

Metrics: every series of `ServiceMetrics` is also recorded into Ray's metrics under the same name, labels and
buckets (`RayMetrics`), with Ray's application/deployment/replica tags added; each node's metrics agent exports
them with a `ray_` prefix (docs/ray.md: the scrape config that takes it off, so the rules and the dashboard
work unchanged). `/metrics` through the proxy is the view of whichever replica answered.

Ray is imported only by this module (`pip install "vitserve[ray]"`); `service.app` knows nothing of it.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import threading
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qsl

from fastapi import FastAPI
from ray import serve
from ray.serve.metrics import Counter, Gauge, Histogram

from vitserve.service.app import create_app
from vitserve.service.ground.deadlines import InUse
from vitserve.service.ground.errors import ServiceError
from vitserve.service.ground.metrics import Recorder, ServiceMetrics
from vitserve.service.ground.model_names import check_model_name
from vitserve.service.ground.settings import Settings
from vitserve.service.repository.layout import ModelRepository
from vitserve.service.schemas.paths import PROTOCOL_ROOT, model_in_protocol_path

log = logging.getLogger("vitserve.ray")

APP_NAME = "vitserve"
REPLICA_HEADER = "x-vitserve-replica"
# Ray gives a replica this long after the drain before it kills it (the drain's 503s must get out first)
SHUTDOWN_MARGIN_S = 2.0


class RayMetrics:
    """`service.ground.metrics.MetricMirror` into Ray's metrics: one Ray metric per vitserve metric, made in the
    replica."""

    def recorder(self, kind: str, name: str, documentation: str, labelnames: tuple[str, ...],
                 buckets: tuple[float, ...] | None) -> Recorder:
        tag_keys = labelnames or None
        # ray.serve.metrics types tag_keys as a 1-tuple (Tuple[str]); ray.util.metrics, under it, as Tuple[str, ...]
        if kind == "counter":
            return Counter(name, documentation, tag_keys=tag_keys).inc  # type: ignore[arg-type]
        if kind == "gauge":
            return Gauge(name, documentation, tag_keys=tag_keys).set  # type: ignore[arg-type]
        assert buckets is not None, "every histogram of service.ground.metrics declares its buckets"
        boundaries = list(buckets)
        return Histogram(name, documentation, boundaries=boundaries, tag_keys=tag_keys).observe  # type: ignore[arg-type]


class ReplicaHeader:
    """Pure ASGI middleware: every response says which replica answered (what an operator asks first when one
    replica misbehaves; the tests read it to see requests spread)."""

    def __init__(self, app, replica: str):
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)


class MultiplexedModels:
    """Pure ASGI middleware of a replica with `ray_models_per_replica` (Ray's model multiplexing): before a request
    that names a model reaches the app, `hold(name)` makes sure this replica has it loaded (Ray's LRU of at most N
    per replica, `serve.multiplexed`), and holds it until the answer is sent, so an eviction waits for it. The
    repository's load and unload API is refused: Ray decides what each replica holds."""

    def __init__(self, app, hold, only_model: str | None):
        self.app, self.hold, self.only_model = app, hold, only_model

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] == "POST" and _REPOSITORY_CONTROL.match(scope["path"]):
            return await _refuse(send, 403, "this server's models are loaded on demand by Ray's model "
                                            "multiplexing (ray_models_per_replica); the repository API cannot "
                                            "load or unload them")
        name = requested_model(scope) or self.only_model
        held = None
        if name is not None:
            try:
                held = await self.hold(check_model_name(name))
            except ServiceError:  # an unknown or unloadable model: the app answers it in its protocol's shape
                held = None
        if held is None:
            return await self.app(scope, receive, send)
        async with held.requests.held():
            await self.app(scope, receive, send)


class HeldModel:
    """A model one replica holds for Ray's multiplexing; Ray calls `__del__` (an instance attribute, so that
    garbage collection never calls it) when it evicts the model: the requests using it finish, then it unloads."""

    def __init__(self, engine, name: str, drain_timeout_s: float):
        self.engine, self.name, self.drain_timeout_s = engine, name, drain_timeout_s
        self.requests = InUse()
        self.__del__ = self._unload

    async def _unload(self) -> None:
        if not await self.requests.released(self.drain_timeout_s):
            log.warning("evicting %s with %d request(s) still using it", self.name, self.requests.count)
        await self.engine.unload(self.name)


_REPOSITORY_CONTROL = re.compile(rf"^{re.escape(PROTOCOL_ROOT)}/repository/models/[^/]+/(load|unload)$")
MULTIPLEX_HEADER = b"serve_multiplexed_model_id"  # Ray's proxy routes by it


def requested_model(scope) -> str | None:
    """The model a request names: in its path (/v2/models/NAME/...), its `model` query parameter (/v1), or Ray's
    multiplexing header; None if none."""
    if name := model_in_protocol_path(scope["path"]):
        return name
    try:
        for key, value in parse_qsl(scope.get("query_string", b"").decode("latin-1"), max_num_fields=32):
            if key == "model":
                return value
    except ValueError:  # too many fields: the app refuses the request itself
        return None
    for key, value in scope.get("headers", []):
        if key == MULTIPLEX_HEADER:
            return value.decode("latin-1")
    return None


async def _refuse(send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@serve.deployment(name=APP_NAME)
@serve.ingress()
class VitServeReplica:
    """One replica: `service.app.create_app` with the model and batcher in this actor."""

    app: FastAPI  # set by Ray's ingress wrapper, from `__serve_build_asgi_app__`

    def __init__(self, settings: dict):
        self.settings = Settings(**settings)

    def __serve_build_asgi_app__(self) -> FastAPI:
        replica = serve.get_replica_context().replica_id.unique_id
        app = create_app(self.settings, metrics=ServiceMetrics(mirror=RayMetrics()))
        if self.settings.ray_models_per_replica:
            app.add_middleware(MultiplexedModels, hold=self._multiplexed_holder(app),
                               only_model=_only_model(self.settings.model_repository))
        app.add_middleware(ReplicaHeader, replica=replica)
        app.router.lifespan_context = warmed_up_first(app.router.lifespan_context)
        return app  # Ray's wrapper keeps it as `self.app`

    def _multiplexed_holder(self, app: FastAPI):
        """Ray's `serve.multiplexed` LRU over this replica's registry: loading a model it lacks (the engine's
        explicit load: the versions its policy names, warmed up), evicting the least recently used beyond N."""
        async def hold(name: str) -> HeldModel:
            engine = app.state.service.engine
            await engine.load(name)
            return HeldModel(engine, name, self.settings.drain_timeout_s)
        return serve.multiplexed(max_num_models_per_replica=self.settings.ray_models_per_replica)(hold)

    def check_health(self) -> None:
        """Ray's health check (every `health_check_period_s`, once the replica has started): a replica whose
        engine stopped is replaced."""
        state = self.app.state.service
        if not state.engine.ready and not state.drain.draining:
            raise RuntimeError("the model engine is not ready")


def warmed_up_first(lifespan):
    """The app's lifespan, its startup ending only once the engine has warmed up: Ray routes requests to a
    replica as soon as its startup ends (a `vitserve serve` process instead answers 503 on readiness until
    then), and a warm-up that fails fails the replica's start, which Ray reports."""
    @asynccontextmanager
    async def warmed_up(app: FastAPI):
        async with lifespan(app) as state:
            if not await app.state.service.engine.warmed_up():
                raise RuntimeError("the model's warm-up failed (the replica's log has why)")
            yield state
    return warmed_up


def replica_settings(settings: Settings) -> Settings:
    """The settings each replica runs with: the model and batcher in the replica's own process, one HTTP
    worker (Ray's proxy is the HTTP server), ONNX Runtime threads to match the CPUs Ray reserves for it (inside
    an actor, 0 = one per core would count every core of the node), and an absolute model path."""
    threads = settings.intra_op_threads or max(1, math.floor(settings.ray_replica_cpus))
    paths = {"model_path": settings.model_path.expanduser().absolute()}
    if settings.model_repository is not None:
        paths["model_repository"] = settings.model_repository.expanduser().absolute()
    # Multiplexed: a replica starts with no model and loads what its requests name (MultiplexedModels)
    control = {"model_control_mode": "explicit", "load_models": []} if settings.ray_models_per_replica else {}
    return settings.model_copy(update={"engine": "inline", "workers": 1, "intra_op_threads": threads, **paths,
                                       **control})


def deployment_options(settings: Settings) -> dict:
    """Ray Serve's deployment options from the service's settings."""
    s = settings
    options = {
        # Ray routes at most this many requests to a replica at once: the app's own admission limit, so
        # the app decides about each admitted request (its 429s, deadlines and limits).
        "max_ongoing_requests": s.max_requests_in_flight,
        "max_queued_requests": s.ray_max_queued_requests,
        "backpressure_config": {"status_code": 429, "retry_after_s": s.retry_after_s},
        "ray_actor_options": {"num_cpus": s.ray_replica_cpus, "num_gpus": s.ray_replica_gpus},
        "graceful_shutdown_timeout_s": s.drain_timeout_s + SHUTDOWN_MARGIN_S,
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 10.0,
    }
    if s.ray_max_replicas:
        options["autoscaling_config"] = {"min_replicas": s.ray_replicas, "max_replicas": s.ray_max_replicas,
                                         "target_ongoing_requests": s.ray_target_ongoing_requests}
    else:
        options["num_replicas"] = s.ray_replicas
    return options


def build_app(args: dict | None = None):
    """Ray Serve's application builder (`serve run service.ray_serve:build_app key=value ...`, or a Serve
    config's `import_path`): any `Settings` field as a key, over the `VITSERVE_*` environment."""
    settings = replica_settings(Settings(**(args or {})))
    # only what was set: a replica's defaults stay defaults (the providers' "best available", say)
    chosen = settings.model_dump(mode="json", exclude_unset=True)
    # serve.deployment made the class a Deployment; mypy keeps a decorated class's own type (python/mypy#3135)
    return VitServeReplica.options(**deployment_options(settings)).bind(chosen)  # type: ignore[attr-defined]


def run_on_ray(settings: Settings) -> int:
    """`vitserve serve --ray`: deploy on Ray (a local cluster, or `ray_address`'s), serve until SIGTERM or
    SIGINT, then take the application down (and the local cluster with it)."""
    import ray
    started_here = settings.ray_address is None and not os.environ.get("RAY_ADDRESS")
    options: dict[str, Any] = {"address": settings.ray_address, "include_dashboard": False,
                               "logging_level": logging.WARNING}
    if started_here:
        start_local_cluster(ray, {**options, "_metrics_export_port": settings.ray_metrics_export_port})
    else:
        ray.init(**options)
    if started_here and (shortfall := local_shortfall(settings, ray.cluster_resources())):
        log.error("cannot deploy: %s", shortfall)
        ray.shutdown()
        return 2
    stop = threading.Event()
    previous = {number: signal.signal(number, lambda *_: stop.set()) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        # Ray's end-to-end timeout only as a backstop: each replica answers its own deadlines first.
        serve.start(http_options={"host": settings.host, "port": settings.port,
                                  "request_timeout_s": settings.request_timeout_s + settings.drain_timeout_s})
        serve.run(build_app(settings.model_dump(mode="json", exclude_unset=True)), name=APP_NAME, route_prefix="/")
        log.info("serving on Ray Serve at http://%s:%d: %s", settings.host, settings.port,
                 _replicas_text(settings))
        while not stop.wait(1.0):
            pass
        log.info("shutting down: draining the replicas")
        serve.delete(APP_NAME)
        return 0
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if started_here:
            serve.shutdown()
        ray.shutdown()


LOCAL_START_ATTEMPTS = 3
_LOCAL_START_TIMEOUT = "timed out during startup"  # what Ray raises (a bare Exception) when its raylet is late


def start_local_cluster(ray, options: dict, attempts: int = LOCAL_START_ATTEMPTS) -> None:
    """`ray.init` of a local cluster, retried when the node misses its start: Ray waits a fixed 30 s for the new
    raylet to register with the GCS (`raylet_start_wait_time_s` in ray/_private/node.py, no setting), which a loaded
    machine can miss. What a failed attempt started (GCS, raylet, agents; Ray keeps no handle on them once its
    Node raised) is stopped before the next, so attempts never pile up."""
    import psutil
    me = psutil.Process()
    for attempt in range(1, attempts + 1):
        before = {child.pid for child in me.children(recursive=True)}
        try:
            ray.init(**options)
            return
        except Exception as error:  # noqa: BLE001 - Ray raises this one as a bare Exception; the rest re-raised
            if _LOCAL_START_TIMEOUT not in str(error) or attempt == attempts:
                raise
            log.warning("Ray's local cluster did not start (attempt %d of %d: %s); stopping what it started and "
                        "trying again", attempt, attempts, error)
            stop_processes([child for child in me.children(recursive=True) if child.pid not in before])


def stop_processes(processes, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL to whatever is still there after `grace_s`."""
    import psutil
    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def _only_model(repository) -> str | None:
    """The repository's model when it holds exactly one (a request naming none means it), else None."""
    names = ModelRepository(repository).names()
    return names[0] if len(names) == 1 else None


def local_shortfall(settings: Settings, resources: dict) -> str | None:
    """What this machine lacks for the minimum replicas, or None. (A cluster of several nodes may be waiting for
    nodes to join, or for its autoscaler: there Ray waits for the resources rather than failing.)"""
    for kind, per_replica in (("CPU", settings.ray_replica_cpus), ("GPU", settings.ray_replica_gpus)):
        needed, have = settings.ray_replicas * per_replica, resources.get(kind, 0)
        if needed > have:
            return (f"{settings.ray_replicas} replica(s) of {per_replica:g} {kind}(s) need {needed:g}; this machine "
                    f"has {have:g}: lower --ray-replicas or --ray-replica-{kind.lower()}s")
    return None


def _replicas_text(settings: Settings) -> str:
    if settings.ray_max_replicas:
        return (f"{settings.ray_replicas} to {settings.ray_max_replicas} replicas, autoscaled at "
                f"{settings.ray_target_ongoing_requests:g} ongoing requests each")
    return f"{settings.ray_replicas} replica(s)"
