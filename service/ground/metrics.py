"""Every Prometheus metric of the service, defined once; the rest of the code reports plain numbers.

With `PROMETHEUS_MULTIPROC_DIR` set (always, when uvicorn runs several workers: `vitserve serve` calls
`service.ground.metrics_files.prepare_multiprocess_dir`), values live in per-process files and a scrape aggregates
them with prometheus-client's `MultiProcessCollector`; gauges say how they combine across processes. prometheus-client
reads the variable when it is first imported: the parent sets it, and uvicorn's workers are new (spawned)
processes that inherit it before they import anything.
"""
from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    multiprocess,
)

from vitserve.service.ground.metrics_files import multiprocess_dir
from vitserve.service.ground.processes import pid_alive

# 100 us .. 60 s: resolves sub-millisecond stages and multi-second overloads alike.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1,
                   0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
# Jensen-Shannon divergence in bits (0 same, 1 disjoint): a retrained version moves most images by under 0.01
JS_DIVERGENCE_BUCKETS = (0.0001, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# Rank correlation of two maps: at or below 0.25 (negative ones too) is no agreement worth telling apart. Ray's
# histograms (service/ray_serve.py mirrors every metric into them) take positive boundaries only.
RANK_CORRELATION_BUCKETS = (0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 1.0)
OOD_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)


class ServiceMetrics:
    """The service's metrics in their own registry (so several apps can live in one test process)."""

    def __init__(self, registry: CollectorRegistry | None = None, mirror: MetricMirror | None = None):
        disable_created_metrics()  # the *_created series double a scrape's size and nobody queries them
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self._mirror = mirror
        metric = self._metric
        # model and version on every inference metric: one series per version loaded, dropped when it is unloaded
        # (`retire`, and the scrape's filter in multiprocess mode), so the count of series stays bounded.
        per_model = ["model", "version"]
        # protocol http: endpoint is the route's template and status the HTTP status; protocol grpc: endpoint is
        # the RPC's full name and status its gRPC status code (OK, INVALID_ARGUMENT, ...)
        self.request_duration = metric(Histogram, "vitserve_request_duration_seconds", "Request duration, end to end "
                                       "(model and version empty on routes that run no model)",
                                       ["endpoint", "status", *per_model, "protocol"], buckets=LATENCY_BUCKETS)
        self.queue_wait_seconds = metric(Histogram, "vitserve_queue_wait_seconds", "Time an image waited in the batch "
                                         "queue", per_model, buckets=LATENCY_BUCKETS)
        self.preprocess = metric(Histogram, "vitserve_preprocess_seconds", "Preparing one image's input: decoding, "
                                 "resizing and normalising it, or its share of parsing a tensor request",
                                 per_model, buckets=LATENCY_BUCKETS)
        self.inference = metric(Histogram, "vitserve_inference_seconds", "One ONNX Runtime call (one batch) on the "
                                "fast path (logits and rollout)", per_model, buckets=LATENCY_BUCKETS)
        # Apart: a relevance call (forward and backward) takes several times a fast one, and mixed in it would
        # move the fast path's latency quantiles with the share of clients asking for explanations.
        self.relevance_inference = metric(Histogram, "vitserve_relevance_inference_seconds", "One ONNX Runtime call "
                                          "(one batch) on the relevance path (map=relevance)", per_model,
                                          buckets=LATENCY_BUCKETS)
        self.relevance_images = metric(Counter, "vitserve_relevance_images", "Images run through the relevance path",
                                       per_model)
        self.maps_free_images = metric(Counter, "vitserve_maps_free_images", "Images run through the maps-free graph "
                                       "(requests that asked for no map, on a model that has the graph)", per_model)
        self.lone_path_images = metric(Counter, "vitserve_lone_path_images", "Images an HTTP worker ran on its own "
                                       "session, alone, instead of sending them to the engine process "
                                       "(lone_request_path)", per_model)
        self.postprocess = metric(Histogram, "vitserve_postprocess_seconds", "Encoding one image's result: top-k and "
                                  "rollout rendering, or its share of a tensor response", per_model,
                                  buckets=LATENCY_BUCKETS)
        self.batch_size = metric(Histogram, "vitserve_batch_size", "Images per ONNX Runtime call", per_model,
                                 buckets=BATCH_SIZE_BUCKETS)
        # Each image's OOD score over its model's threshold (docs/ood.md): a ratio, so that one set of buckets fits
        # every model; above 1 is "outside", which about 1% of in-distribution images are. Drift is a window
        # whose share above 1 grows (docker/prometheus/rules/vitserve.rules.yml).
        self.ood_score = metric(Histogram, "vitserve_ood_score_ratio", "Each answered image's out-of-distribution "
                                "score divided by its model's threshold (the held-out images' 99th percentile)",
                                per_model, buckets=OOD_RATIO_BUCKETS)
        self.images = metric(Counter, "vitserve_images", "Images run through the model", per_model)
        # Token budgets (docs/token-budgets.md): every answered image by the tokens it ran on and why fewer than
        # the full budget's (reason "": the full budget); and, for the answers whose budget has a measured accuracy,
        # that accuracy summed: rate(accuracy sum) / rate(measured answers) is the estimated accuracy of what was
        # served. `tokens` has a value per rung of a model's ladder (at most five), plus an image's own at
        # resize=native.
        self.budget_answers = metric(Counter, "vitserve_budget_answers", "Answered images by the token budget they "
                                     "ran at (tokens) and why it was below the full budget (reason: asked, load; "
                                     "empty at the full budget)", [*per_model, "tokens", "reason"])
        self.estimated_accuracy = metric(Counter, "vitserve_budget_estimated_accuracy", "The accuracy of each answered "
                                         "image's budget (measured at export), summed; over "
                                         "vitserve_budget_measured_answers_total, the estimated accuracy served",
                                         per_model)
        self.measured_answers = metric(Counter, "vitserve_budget_measured_answers", "Answered images whose budget "
                                       "has a measured accuracy", per_model)
        # A shadow version (service/engine/shadow.py): labelled by the served version that answered and the shadow
        # that ran the copy, so a promotion's evidence is per pair. Retired with the served version's series.
        pair = [*per_model, "shadow_version"]
        self.shadow_copies = metric(Counter, "vitserve_shadow_copies", "Copies of answered requests offered to a "
                                    "shadow version, by outcome (compared, dropped: its queue was full, failed)",
                                    [*pair, "outcome"])
        self.shadow_agreements = metric(Counter, "vitserve_shadow_top1_agreements", "Compared copies whose top-1 "
                                        "class was the same on both versions", pair)
        self.shadow_js_divergence = metric(Histogram, "vitserve_shadow_js_divergence", "Jensen-Shannon divergence "
                                           "(bits) of the two versions' served probabilities", pair,
                                           buckets=JS_DIVERGENCE_BUCKETS)
        self.shadow_map_correlation = metric(Histogram, "vitserve_shadow_map_rank_correlation", "Spearman rank "
                                             "correlation of the two versions' rollout maps", pair,
                                             buckets=RANK_CORRELATION_BUCKETS)
        self.shadow_latency = metric(Histogram, "vitserve_shadow_latency_seconds", "From a copy's offer to the "
                                     "shadow's result (its queue wait included)", pair, buckets=LATENCY_BUCKETS)
        # By batch size, for the Open Inference Protocol's statistics extension (service/schemas/statistics.py); the
        # label has at most max_batch_size values.
        self.batches = metric(Counter, "vitserve_batches", "ONNX Runtime calls, by batch size",
                              [*per_model, "batch_size"])
        self.batch_seconds = metric(Counter, "vitserve_batch_seconds", "Time in ONNX Runtime calls, by batch size",
                                    [*per_model, "batch_size"])
        self.batch_stack_seconds = metric(Counter, "vitserve_batch_stack_seconds", "Time stacking batches' inputs, by "
                                          "batch size", [*per_model, "batch_size"])
        self.last_inference = metric(Gauge, "vitserve_last_inference_timestamp_seconds", "When the last batch ran "
                                     "(Unix time)", per_model, multiprocess_mode="max")
        self.rejected = metric(Counter, "vitserve_requests_rejected", "Requests (or files of a batch request) answered "
                               "with an error, by error code", ["reason"])
        self.queue_depth_gauge = metric(Gauge, "vitserve_queue_depth", "Images waiting in the batch queue",
                                        per_model, multiprocess_mode="livesum")
        self.in_flight = metric(Gauge, "vitserve_requests_in_flight", "Requests being handled (HTTP and gRPC)",
                                multiprocess_mode="livesum")
        self.ready = metric(Gauge, "vitserve_ready", "1 when the server is ready: its engine reachable and the models "
                            "it starts with loaded and warmed up (min over workers)", multiprocess_mode="livemin")
        # Workers start one by one (14 on a 16-core GPU machine, seconds apart): the first ready one makes the server
        # ready, while connections opened meanwhile all land on the workers already up. These two say how many
        # take requests, for an operator and for a benchmark that must not measure a server half started.
        self.workers_ready = metric(Gauge, "vitserve_http_workers_ready", "HTTP worker processes ready to take "
                                    "requests", multiprocess_mode="livesum")
        self.workers = metric(Gauge, "vitserve_http_workers", "HTTP worker processes the server runs",
                              multiprocess_mode="livemax")
        self.model_ready = metric(Gauge, "vitserve_model_ready", "1 while a model version is loaded, warmed up and "
                                  "routed to", per_model, multiprocess_mode="livemax")
        # By model only: a failed version is not loaded, so it has no series of its own to carry a 0
        self.model_load_failures = metric(Counter, "vitserve_model_load_failures", "Model versions whose load or "
                                          "warm-up failed (the repository index says why)", ["model"])
        # An Info metric has no multiprocess support; a constant-1 gauge with labels is the same series.
        # plan: what decided how it is served (settings, recorded, declared; given: a model handed over whole), and
        # plan_key the tuning record's name (service/engine/serving_plan.py): equal on every replica of one file and
        # machine, so a dashboard sees replicas that serve one file differently
        self.model_info = metric(Gauge, "vitserve_model_info", "A served model version and how it is served",
                                 ["name", "version", "provider", "opset", "plan", "plan_key"],
                                 multiprocess_mode="livemax")
        # (model, version) -> every (metric, label values) recorded for it, so `retire` can remove them through
        # prometheus-client's public `remove`
        self._children: dict[tuple[str, str], set[tuple]] = defaultdict(set)
        self._reporters: dict[tuple[str, str], ModelMetrics] = {}
        self._refusal_series: dict[tuple[str, str], tuple] = {}
        self.ready.set(0)

    def _metric(self, kind: type, name: str, documentation: str, labelnames=(), **options):
        """A prometheus-client metric in this registry; with a mirror, one whose every update also reaches it."""
        made = kind(name, documentation, labelnames, registry=self.registry, **options)
        if self._mirror is None:
            return made
        record = self._mirror.recorder(METRIC_KINDS[kind], name, documentation, tuple(labelnames),
                                       options.get("buckets"))
        return MirroredMetric(made, METRIC_KINDS[kind], record, tuple(labelnames))

    # --- what the rest of the service reports (plain numbers) ---
    def request_started(self) -> None:
        self.in_flight.inc()

    def request_done(self, endpoint: str, status: int | str, seconds: float, model: str = "", version: str = "",
                     protocol: str = "http") -> None:
        self.in_flight.dec()
        values = (endpoint, str(status), model, version, protocol)
        if model:
            self.labelled(model, version, self.request_duration, values).observe(seconds)
        else:
            self.request_duration.labels(*values).observe(seconds)

    def rejected_request(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def refused_at_once(self, endpoint: str, reason: str) -> None:
        """A request refused before it was read (HTTP, from its request line): counted as rejected and as an
        answer of 429 in no time, as a refused request's own path counts it. It was never in flight. The two
        series are made once per endpoint and reason: under overload half the requests come here."""
        series = self._refusal_series.get((endpoint, reason))
        if series is None:
            series = self._refusal_series[endpoint, reason] = (
                self.rejected.labels(reason), self.request_duration.labels(endpoint, "429", "", "", "http"))
        rejected, duration = series
        rejected.inc()
        duration.observe(0.0)

    def lone_path_image(self, model: str, version: str) -> None:
        self.labelled(model, version, self.lone_path_images, (model, version)).inc()

    def for_model(self, model: str, version: str) -> ModelMetrics:
        """What one model version reports: its batches, queue and images, under its labels (made once: every
        request reports through it)."""
        reporter = self._reporters.get((model, version))
        if reporter is None:
            reporter = self._reporters[model, version] = ModelMetrics(self, model, version)
        return reporter

    def set_ready(self, ready: bool) -> None:
        self.ready.set(1 if ready else 0)

    def set_worker_ready(self, ready: bool) -> None:
        """An HTTP worker's readiness: counted in `vitserve_http_workers_ready` too (an engine process's is not)."""
        self.set_ready(ready)
        self.workers_ready.set(1 if ready else 0)

    def set_workers(self, count: int) -> None:
        self.workers.set(count)

    def set_model(self, name: str, version: str, provider: str, opset: int | None, plan: str = "given",
                  plan_key: str = "") -> None:
        values = (name, version, provider, str(opset if opset is not None else ""), plan, plan_key)
        self.labelled(name, version, self.model_info, values).set(1)

    def load_failed(self, model: str) -> None:
        self.model_load_failures.labels(model).inc()

    def shadow_copy(self, model: str, version: str, shadow_version: str, outcome: str) -> None:
        """A copy for the shadow that was not compared: dropped or failed."""
        self.labelled(model, version, self.shadow_copies, (model, version, shadow_version, outcome)).inc()

    def shadow_compared(self, model: str, version: str, shadow_version: str, agreed: bool,
                        js_divergence: float | None, map_rank_correlation: float | None, latency_s: float) -> None:
        pair = (model, version, shadow_version)
        self.labelled(model, version, self.shadow_copies, (*pair, "compared")).inc()
        agreements = self.labelled(model, version, self.shadow_agreements, pair)
        agreements.inc(1 if agreed else 0)  # made even at 0: the ratio's numerator exists from the first copy
        if js_divergence is not None:
            self.labelled(model, version, self.shadow_js_divergence, pair).observe(js_divergence)
        if map_rank_correlation is not None:
            self.labelled(model, version, self.shadow_map_correlation, pair).observe(map_rank_correlation)
        self.labelled(model, version, self.shadow_latency, pair).observe(latency_s)

    def labelled(self, model: str, version: str, metric, values: tuple):
        """`metric.labels(*values)`, remembered as one of the (model, version)'s series."""
        self._children[model, version].add((metric, values))
        return metric.labels(*values)

    def retire(self, model: str, version: str) -> None:
        """A version was unloaded: its series stop exporting, and if it is loaded again they count from zero, as
        Triton's statistics do. In one process they are removed. In multiprocess mode a scrape leaves them out
        instead (`render(live=...)`) and the children stay, set to zero: prometheus-client keeps every value it
        ever made for a process in a module-level list, so removing and re-making the same children at each
        reload would leak them (measured: 0.1 MiB per load/unload cycle of one version), and a child made again
        would read its old value back from this process's file."""
        if multiprocess_dir():
            for metric, values in self._children.get((model, version), ()):
                _zero(metric.labels(*values))
            return
        self._reporters.pop((model, version), None)
        for metric, values in self._children.pop((model, version), ()):
            try:
                metric.remove(*values)
            except KeyError:
                pass

    # --- the scrape ---
    def render(self, live: set[tuple[str, str]] | None = None) -> tuple[bytes, str]:
        """The exposition text: this registry, or every process's files in multiprocess mode; with `live`, only
        the per-model series of those (model, version) pairs."""
        return generate_latest(self._scraped(live)), CONTENT_TYPE_LATEST

    def families(self, live: set[tuple[str, str]] | None = None) -> list:
        """The metric families as a scrape sees them (every process's, in multiprocess mode)."""
        return list(self._scraped(live).collect())

    def _scraped(self, live: set[tuple[str, str]] | None):
        directory = multiprocess_dir()
        if directory:
            forget_dead_workers(directory)
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        else:
            registry = self.registry
        return registry if live is None else _LiveVersionsOnly(registry, live)


def _zero(child) -> None:
    """One series back to zero. Counters and gauges have a public way; a histogram has none, so its buckets and
    sum (prometheus-client's own value objects, each with `set`) are set here, the one place that reaches in."""
    if isinstance(child, Counter):
        child.reset()
    elif isinstance(child, Gauge):
        child.set(0)
    elif isinstance(child, Histogram):
        for value in (child._sum, *child._buckets):
            value.set(0)


class _LiveVersionsOnly:
    """A registry's families without the samples of unloaded versions: in multiprocess mode their values stay in
    the files of the processes that recorded them, and a scrape must not export them forever."""

    def __init__(self, registry, live: set[tuple[str, str]]):
        self._registry, self._live = registry, live

    def collect(self):
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if _is_live(s.labels, self._live)]
            yield family


def _is_live(labels: dict, live: set[tuple[str, str]]) -> bool:
    model = labels.get("model", labels.get("name") if "provider" in labels else None)
    if not model or "version" not in labels:  # not a per-version series, or a request that ran no model
        return True
    return (model, labels.get("version", "")) in live


class ModelMetrics:
    """One model version's metrics, labels bound: the batcher's observer (service.engine.batcher.BatchObserver) and the
    stages of its images."""

    def __init__(self, metrics: ServiceMetrics, model: str, version: str):
        self.service, self.model, self.version = metrics, model, version
        m, labels = metrics, (model, version)

        def child(metric):
            return m.labelled(model, version, metric, labels)
        self._queue_wait, self._preprocess = child(m.queue_wait_seconds), child(m.preprocess)
        self._postprocess, self._inference = child(m.postprocess), child(m.inference)
        self._relevance, self._relevance_images = child(m.relevance_inference), child(m.relevance_images)
        self._maps_free_images = child(m.maps_free_images)
        self._batch_size, self._images = child(m.batch_size), child(m.images)
        self._last, self._depth = child(m.last_inference), child(m.queue_depth_gauge)
        self._ready = child(m.model_ready)
        self._ood = child(m.ood_score)
        self._estimated_accuracy, self._measured_answers = child(m.estimated_accuracy), child(m.measured_answers)
        self._budgets: dict[tuple[int, str], Any] = {}  # (tokens, reason) -> its Counter child
        self._of_size: dict[int, tuple] = {}  # batch size -> its series (`_size_series`)

    def ood_score(self, ratio: float) -> None:
        """One image's OOD score over its model's threshold."""
        self._ood.observe(ratio)

    def budget_answer(self, tokens: int, reason: str | None, accuracy: float | None) -> None:
        """One answered image's token budget, why, and its budget's measured accuracy (None: not measured)."""
        key = (tokens, reason or "")
        series = self._budgets.get(key)
        if series is None:
            m = self.service
            series = self._budgets[key] = m.labelled(self.model, self.version, m.budget_answers,
                                                     (self.model, self.version, str(tokens), reason or ""))
        series.inc()
        if accuracy is not None:
            self._estimated_accuracy.inc(accuracy)
            self._measured_answers.inc()

    def image_stages(self, preprocess_s: float, postprocess_s: float) -> None:
        """One image's input prepared, and its result encoded."""
        self._preprocess.observe(preprocess_s)
        self._postprocess.observe(postprocess_s)

    def tensor_stages(self, images: int, parse_s: float, encode_s: float) -> None:
        """A request of `images` pixel tensors parsed and its outputs encoded: each image's share."""
        for _ in range(images):
            self.image_stages(parse_s / images, encode_s / images)

    def batch_done(self, size: int, seconds: float, stack_seconds: float,
                   targeted: bool = False, maps_free: bool = False) -> None:  # service.engine.batcher.BatchObserver
        if targeted:
            self._relevance.observe(seconds)
            self._relevance_images.inc(size)
        else:
            self._inference.observe(seconds)
        if maps_free:
            self._maps_free_images.inc(size)
        self._batch_size.observe(size)
        self._images.inc(size)
        batches, batch_seconds, stack = self._of_size.get(size) or self._size_series(size)
        batches.inc()
        batch_seconds.inc(seconds)
        stack.inc(stack_seconds)
        self._last.set_to_current_time()

    def _size_series(self, size: int) -> tuple:
        """The series of batches of `size` images, made once (a version's sizes are at most its largest batch): a
        label lookup per series per batch was a third of a lone image's way through the engine."""
        m, labels = self.service, (self.model, self.version, str(size))
        series = tuple(m.labelled(self.model, self.version, metric, labels)
                       for metric in (m.batches, m.batch_seconds, m.batch_stack_seconds))
        self._of_size[size] = series
        return series

    def queue_wait(self, seconds: float) -> None:  # service.engine.batcher.BatchObserver
        self._queue_wait.observe(seconds)

    def queue_depth(self, depth: int) -> None:  # service.engine.batcher.BatchObserver
        self._depth.set(depth)

    def set_ready(self, ready: bool) -> None:
        self._ready.set(1 if ready else 0)


def forget_dead_workers(directory: str) -> None:
    """Drop the live gauges of workers that died without a clean stop (killed, crashed): their last queue
    depth and in-flight counts would stay in the totals forever. A worker's files end in its pid."""
    pids = {int(p.stem.rsplit("_", 1)[-1]) for p in Path(directory).glob("gauge_live*_*.db")
            if p.stem.rsplit("_", 1)[-1].isdigit()}
    for pid in pids - {os.getpid()}:
        if not pid_alive(pid):
            multiprocess.mark_process_dead(pid)


def mark_process_dead(pid: int) -> None:
    """Drop a stopped worker's live gauges from the aggregate (multiprocess mode only)."""
    if multiprocess_dir():
        multiprocess.mark_process_dead(pid)


METRIC_KINDS: dict[type, str] = {Counter: "counter", Gauge: "gauge", Histogram: "histogram"}
Recorder = Callable[[float, dict], None]  # one update: (amount or value, {label: value})


class MetricMirror(Protocol):
    """A second home for every metric, under the same name, labels and buckets: Ray's metrics under Ray Serve
    (service/ray_serve.py), whose agent on each node exports every replica's series."""

    def recorder(self, kind: str, name: str, documentation: str, labelnames: tuple[str, ...],
                 buckets: tuple[float, ...] | None) -> Recorder:
        """The function that records one update of this metric: a counter's increment, a gauge's new value, or
        a histogram's observation."""


class MirroredMetric:
    """A prometheus-client metric (or one labelled child of it) whose updates also go to a mirror's recorder.

    It offers just what ServiceMetrics calls. Gauges hand the mirror their value, not the change: a recorder
    sets, it cannot add.
    """

    def __init__(self, metric, kind: str, record: Recorder, labelnames: tuple[str, ...], tags: dict | None = None):
        self._metric, self._kind, self._record, self._labelnames = metric, kind, record, labelnames
        self._tags = tags or {}
        self._value = 0.0  # a gauge's value, as the mirror has it
        self._children: dict[tuple, MirroredMetric] = {}

    def remove(self, *values) -> None:
        """Forget a child here; the mirror keeps its last value (Ray's metrics have no removal)."""
        self._metric.remove(*values)
        self._children.pop(tuple(str(v) for v in values), None)

    def labels(self, *values) -> MirroredMetric:
        key = tuple(str(v) for v in values)
        if key not in self._children:
            self._children[key] = MirroredMetric(self._metric.labels(*key), self._kind, self._record, (),
                                                 dict(zip(self._labelnames, key)))
        return self._children[key]

    def inc(self, amount: float = 1) -> None:
        self._metric.inc(amount)
        if self._kind == "gauge":
            self._set_mirror(self._value + amount)
        elif amount > 0:  # a counter's recorder refuses zero (a batch may stack in no measurable time)
            self._record(amount, self._tags)

    def dec(self, amount: float = 1) -> None:
        self._metric.dec(amount)
        self._set_mirror(self._value - amount)

    def set(self, value: float) -> None:
        self._metric.set(value)
        self._set_mirror(value)

    def set_to_current_time(self) -> None:
        self.set(time.time())

    def observe(self, value: float) -> None:
        self._metric.observe(value)
        self._record(value, self._tags)

    def _set_mirror(self, value: float) -> None:
        self._value = value
        self._record(value, self._tags)
