"""`Shadow`: a model's shadow version, and how far it agrees with the versions that answer.

A model's config.json may name a shadow version (service/repository/layout.py `ShadowConfig`). The registry loads
it beside the served versions, but routing never sends it a request the client did not pin to it. Instead, after a
served version has answered a fast-path request, a sampled share of those requests (`fraction`) is offered here: a
copy of the image and the primary's outputs go into a bounded queue, and a worker runs the copy on the shadow
version afterwards. The answer has already gone, so the copy cannot fail it; and the copy cannot delay the answers
that come after it either: copies are sent to the shadow only while no served version of the model has work
queued or running (then as many as one shadow batch holds, at once), and the shadow's compute threads run at a
lower CPU priority (`cpu_priority`, idle by default). A busy model lets its copies wait; its bounded queue then
fills and drops new copies (counted), as does a copy that waited longer than `timeout_s`. Under saturation a shadow
therefore sees a sample of the traffic, never a cost (docs/results/bench-shadow.md measures both).

Every compared copy gives, per (served version, shadow version) pair:
- top-1 agreement: both name the same class (compared by label, so a version with other labels still compares);
- the probability shift: the Jensen-Shannon divergence (base 2, between 0 and 1) of the two versions' served
  probabilities (each file's own calibration, what /v1 answers), when both have the same labels;
- map agreement: Spearman's rank correlation of the two rollout maps, when both maps have the same grid;
- the shadow's latency: from the offer to the shadow's result (its queue wait included).
The counts and sums are kept exactly here (`report`, GET /v1/models/{name}/shadow) and exported to Prometheus
(the vitserve_shadow_* series of service/ground/metrics.py). docs/shadow.md says how to read them before promoting a
version.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from vitserve.artifact import ModelInfo
from vitserve.service.engine import same_geometry
from vitserve.service.engine.served_model import ServedModel
from vitserve.service.ground.errors import ServiceError
from vitserve.service.ground.metrics import ServiceMetrics
from vitserve.service.repository.layout import ShadowConfig

log = logging.getLogger("vitserve.engine")

LATENCIES_KEPT = 10_000  # per pair, for the report's quantiles: the recent past, in bounded memory
IDLE_POLL_S = 0.005  # how often waiting copies look whether the served versions are idle: a gap shorter than
# this is rarely headroom, and a busy engine is not woken hundreds of times a second to find it still busy


def js_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen-Shannon divergence in bits: 0 for the same distribution, 1 for disjoint ones."""
    m = (p + q) / 2

    def kl(a: np.ndarray) -> float:
        present = a > 0
        return float(np.sum(a[present] * np.log2(a[present] / m[present])))
    return max(0.0, (kl(p) + kl(q)) / 2)


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float | None:
    """Spearman's rank correlation of two maps of the same shape (ties ranked by position: a rollout map's values
    are continuous); None when either map is constant, where no ranking exists."""
    ranks = [np.argsort(np.argsort(np.ravel(m), kind="stable"), kind="stable").astype(np.float64) for m in (a, b)]
    if np.ptp(np.ravel(a)) == 0 or np.ptp(np.ravel(b)) == 0:
        return None
    ra, rb = (r - r.mean() for r in ranks)
    return float(np.dot(ra, rb) / np.sqrt(np.dot(ra, ra) * np.dot(rb, rb)))


@dataclass(frozen=True)
class Comparison:
    agreed: bool
    js_divergence: float | None
    map_rank_correlation: float | None


def compare(primary: dict[str, np.ndarray], primary_info: ModelInfo, shadow: dict[str, np.ndarray],
            shadow_info: ModelInfo) -> Comparison:
    """One image's outputs on the two versions (by output name)."""
    agreed = primary_info.labels[int(np.argmax(primary["logits"]))] == \
        shadow_info.labels[int(np.argmax(shadow["logits"]))]
    divergence = None
    if list(primary_info.labels) == list(shadow_info.labels):
        divergence = js_divergence(primary_info.probabilities(primary["logits"]),
                                   shadow_info.probabilities(shadow["logits"]))
    primary_map, shadow_map = primary.get("rollout"), shadow.get("rollout")
    correlation = None
    if primary_map is not None and shadow_map is not None and np.shape(primary_map) == np.shape(shadow_map):
        correlation = rank_correlation(primary_map, shadow_map)
    return Comparison(agreed, divergence, correlation)


@dataclass
class PairStats:
    """Exact counts and sums for one (served version, shadow version) pair."""

    offered: int = 0  # sampled copies
    dropped: int = 0  # the queue was full, or the copy waited past timeout_s
    failed: int = 0  # the shadow could not run it (not ready, an error, a timeout, another input geometry)
    compared: int = 0
    agreed: int = 0
    divergence_sum: float = 0.0
    divergences: int = 0
    correlation_sum: float = 0.0
    correlations: int = 0
    latencies_s: deque = field(default_factory=lambda: deque(maxlen=LATENCIES_KEPT))

    def report(self) -> dict:
        latencies = np.asarray(self.latencies_s, np.float64)
        quantiles = ({f"p{q}": round(float(np.percentile(latencies, q)) * 1000, 3) for q in (50, 90, 99)}
                     if len(latencies) else {})
        return {"offered": self.offered, "dropped": self.dropped, "failed": self.failed, "compared": self.compared,
                "top1_agreement": self.agreed / self.compared if self.compared else None,
                "mean_js_divergence": self.divergence_sum / self.divergences if self.divergences else None,
                "mean_map_rank_correlation": self.correlation_sum / self.correlations if self.correlations else None,
                "shadow_latency_ms": quantiles}


@dataclass(frozen=True)
class Copy:
    version: str  # the served version that answered
    pixels: np.ndarray
    outputs: dict[str, np.ndarray]
    info: ModelInfo
    offered_at: float


ServingLookup = Callable[[str, str], ServedModel]  # (model, version) -> its ServedModel, or VersionRetired


class Shadow:
    def __init__(self, name: str, config: ShadowConfig, serving: ServingLookup, metrics: ServiceMetrics,
                 batch_size: int, busy: Callable[[], bool] = lambda: False, seed: int | None = None):
        self.name, self.version, self.config = name, str(config.version), config
        self._serving, self._metrics, self._busy = serving, metrics, busy  # busy: the served versions have work
        self._queue: asyncio.Queue[Copy] = asyncio.Queue(config.max_queue_size)
        self._random = random.Random(seed)
        self._batch_size = max(1, batch_size)  # copies sent at once: as many as one shadow batch holds
        self._worker: asyncio.Task | None = None
        self.pairs: dict[str, PairStats] = {}

    def offer(self, version: str, pixels: np.ndarray, outputs: tuple, info: ModelInfo) -> None:
        """After `version` answered a fast-path request: maybe queue a copy. Never raises, never waits."""
        if version == self.version or self._random.random() >= self.config.fraction:
            return
        stats = self.pairs.setdefault(version, PairStats())
        stats.offered += 1
        if self._queue.full():
            stats.dropped += 1
            self._metrics.shadow_copy(self.name, version, self.version, "dropped")
            return
        # The pixels may be a view of a frontend's shared memory, reused once the answer has gone: copied
        copy = Copy(version, np.array(pixels), dict(zip(info.output_names(), outputs)), info, time.perf_counter())
        self._queue.put_nowait(copy)
        if self._worker is None:
            self._worker = asyncio.create_task(self._work(), name=f"shadow-{self.name}")

    async def _work(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while self._busy():
                await asyncio.sleep(IDLE_POLL_S)
            while len(batch) < self._batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            await asyncio.gather(*(self._one(copy) for copy in batch))

    async def _one(self, copy: Copy) -> None:
        if time.perf_counter() - copy.offered_at > self.config.timeout_s:  # stale: it waited out a busy spell
            self.pairs.setdefault(copy.version, PairStats()).dropped += 1
            self._metrics.shadow_copy(self.name, copy.version, self.version, "dropped")
            return
        try:
            await self._run(copy)
        except (TimeoutError, ServiceError) as e:
            self._failed(copy, str(e) or type(e).__name__)
        except Exception:  # a bug in one comparison must not end the worker
            log.exception("shadow copy of %s version %s failed", self.name, copy.version)
            self._failed(copy, "internal error")

    async def _run(self, copy: Copy) -> None:
        served = self._serving(self.name, self.version)
        if not same_geometry(copy.info, served.info):
            raise ServiceError(f"shadow version {self.version} takes another input geometry than version "
                               f"{copy.version}")
        async with served.admitted():
            result = await served.submit(copy.pixels, self.config.timeout_s)
        latency_s = time.perf_counter() - copy.offered_at
        shadow_outputs = dict(zip(served.info.output_names(), result.output))
        comparison = compare(copy.outputs, copy.info, shadow_outputs, served.info)
        stats = self.pairs.setdefault(copy.version, PairStats())
        stats.compared += 1
        stats.agreed += comparison.agreed
        if comparison.js_divergence is not None:
            stats.divergence_sum += comparison.js_divergence
            stats.divergences += 1
        if comparison.map_rank_correlation is not None:
            stats.correlation_sum += comparison.map_rank_correlation
            stats.correlations += 1
        stats.latencies_s.append(latency_s)
        self._metrics.shadow_compared(self.name, copy.version, self.version, comparison.agreed,
                                      comparison.js_divergence, comparison.map_rank_correlation, latency_s)

    def _failed(self, copy: Copy, why: str) -> None:
        self.pairs.setdefault(copy.version, PairStats()).failed += 1
        self._metrics.shadow_copy(self.name, copy.version, self.version, "failed")
        log.debug("shadow copy of %s version %s on version %s failed: %s", self.name, copy.version, self.version, why)

    def report(self) -> dict:
        return {"model": self.name, "shadow_version": self.version, "fraction": self.config.fraction,
                "queued": self._queue.qsize(), "max_queue_size": self.config.max_queue_size,
                "pairs": [{"version": v, "shadow_version": self.version, **stats.report()}
                          for v, stats in sorted(self.pairs.items(), key=lambda kv: kv[0])]}

    async def close(self) -> None:
        """Stop comparing: queued copies are dropped (the answers they copy went long ago)."""
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None
