"""`ServedModel`: one model version being served: its ONNX Runtime session, its own dynamic batcher (shape groups,
queue limit, learnt speed) and its warm-up. The registry (service/engine/registry.py) loads, routes to and
unloads these; nothing here knows of other versions.

Its life: `load` (the session, in a thread; a bad file is a ModelLoadError) -> `warm_up` (every warm-up batch
size at the trained resolution; only then `ready`, and only then does the registry route to it) -> requests
(`submit`, each inside `admitted()`) -> `close` (stop being routed to, let the admitted requests finish, run what
is queued, then drop the session).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace

import numpy as np

from vitserve.artifact import ModelInfo
from vitserve.budgets import Rung, resample
from vitserve.service.engine import InferenceResult
from vitserve.service.engine.batcher import DynamicBatcher
from vitserve.service.engine.budgets import FULL, BudgetController, served_ladder
from vitserve.service.engine.inference_model import Capabilities, InferenceModel
from vitserve.service.engine.pixels import PixelTable
from vitserve.service.engine.providers import runs_on_cpu
from vitserve.service.engine.runtime import load_model, warm_up, warn_if_int8_does_not_pay
from vitserve.service.engine.threads import CpuPriority, run_on_new_thread
from vitserve.service.ground.deadlines import InUse
from vitserve.service.ground.errors import InferenceError, VersionRetired
from vitserve.service.ground.metrics import ModelMetrics
from vitserve.service.ground.settings import Settings

log = logging.getLogger("vitserve.engine")

Loader = Callable[[Settings], InferenceModel]
BATCHING_LIMITS = ("max_batch_size", "max_queue_delay_ms", "max_queue_size")


class ServedModel:
    def __init__(self, name: str, version: str, settings: Settings, metrics: ModelMetrics,
                 model: InferenceModel | None = None, loader: Loader = load_model, maps: Sequence[str] | None = None,
                 cpu_priority: CpuPriority = "normal", version_policy: dict | None = None):
        self.name, self.version = name, version
        self.version_policy = version_policy or {}  # its model's, for its Triton configuration ({}: Triton's default)
        self.settings, self.metrics = settings, metrics  # settings: the server's with this model's file and limits
        self.model = model  # given (tests) or loaded from settings.model_path by `loader`
        self._loader = loader
        self._maps = maps  # the maps this model offers (its config), None: all its file computes
        self.cpu_priority = cpu_priority  # of the threads that load and run it (service/engine/threads.py)
        self._info: ModelInfo | None = None
        self.capabilities = Capabilities()  # the loaded model's, read once at load: what run_batch may ask of it
        self._load_started, self._ready_s = 0.0, 0.0
        self._stages: list[tuple[str, float]] = []
        self._pixel_table: PixelTable | None = None
        self.ladder: tuple[Rung, ...] = ()  # the token budgets it serves (service/engine/budgets.py), full first
        self.batcher: DynamicBatcher | None = None
        self.ready = False
        self.closing = False
        self.requests = InUse()  # requests admitted to this version and not yet answered

    @property
    def info(self) -> ModelInfo:
        """The file's metadata, under the name and version it is served as."""
        assert self._info is not None, "load() reads it"
        return self._info

    @property
    def batching(self) -> dict:
        """Its batching limits where they differ from the server's (its model's config.json)."""
        return {k: getattr(self.settings, k) for k in BATCHING_LIMITS if k in self.settings.model_fields_set}

    @property
    def serving(self) -> dict:
        """How this version is served and why, as the model card and /v2 config show it: its plan
        (service/engine/serving_plan.py) and what each stage of its load took; {} before it is ready."""
        if not self.ready:
            return {}
        plan = self.capabilities.plan
        described = plan.describe() if plan is not None else {"source": "given", "why": "a model object handed over"}
        return {**described, "provider": self.provider, "ready_s": round(self._ready_s, 3),
                "load_stages_s": {name: round(seconds, 3) for name, seconds in self._stages}}

    @property
    def provider(self) -> str:
        return self.loaded_model.provider

    @property
    def loaded_model(self) -> InferenceModel:
        """The model, from `load` until `close`."""
        assert self.model is not None, "load() made the model; close() drops it"
        return self.model

    async def load(self) -> None:
        """The session (unless given) and the batcher; ModelLoadError if the file cannot be served."""
        self._load_started = time.perf_counter()
        if self.model is None:
            # ONNX Runtime starts a session's intra-op threads when it creates the session, and a Linux thread
            # starts with its creator's priority: a session created on a lowered thread computes lowered.
            self.model = await run_on_new_thread(lambda: self._loader(self.settings), self.cpu_priority)
        info, self.capabilities = self.model.info, self.model.capabilities
        maps = tuple(m for m in info.maps if self._maps is None or m in self._maps) or ("rollout",)
        self._info = replace(info, name=self.name, version=self.version, maps=maps)
        # The repository's name and version, which clients use; the file's own (its metadata) only beside them
        log.info("loaded %s version %s (file: %s %s, %s, opset %s) from %s on %s%s", self.name, self.version,
                 info.name, info.version, info.precision, info.opset, self.settings.model_path, self.provider,
                 " with CUDA graphs" if self.capabilities.cuda_graphs else "")
        if runs_on_cpu(self.provider):  # once per served version (an engine may load a light model twice)
            warn_if_int8_does_not_pay(info)
        s = self.settings
        trained_cost = info.channels * info.image_size[0] * info.image_size[1]  # input values of one image
        self.ladder = served_ladder(self._info, s)
        # A light model's server is bound by its HTTP path, not by the model (docs/token-budgets.md: the default
        # model degrading at 2x answered 1.02x the refusing server's 200s): it refuses rather than answer cheaper.
        light = self.capabilities.plan is not None and self.capabilities.plan.light
        under_load = s.degrade_under_load and len(self.ladder) > 1 and not light
        budgets = BudgetController([r.cost for r in self.ladder], s.budget_queue_batches) if under_load else None
        self.batcher = DynamicBatcher(self.run_batch, max_batch_size=s.max_batch_size,
                                      max_queue_delay_s=s.max_queue_delay_s, max_queue_size=s.max_queue_size,
                                      max_batches_in_flight=s.batches_in_flight,
                                      dispatch_when_idle=s.dispatch_when_idle,
                                      max_batch_cost=s.max_batch_cost or s.max_batch_size * trained_cost,
                                      observer=self.metrics, max_targeted_batch_size=s.max_relevance_batch_size,
                                      runner_priority=self.cpu_priority, runners=s.batch_runners,
                                      maps_free_batches=self.capabilities.maps_free is not None,
                                      wide_lone_batches=self.capabilities.wide is not None, budgets=budgets,
                                      resizable_shape=(info.channels, *info.image_size),
                                      trace_attributes={"vitserve.model": self.name, "vitserve.version": self.version})
        self.batcher.start()

    async def warm_up(self) -> None:
        """Run the warm-up batches; ready afterwards. An exception here means the version must not be served."""
        started = time.perf_counter()
        sizes = await asyncio.to_thread(warm_up, self.loaded_model, self.settings.warmup_batch_sizes)
        stages = [*self.capabilities.load_stages, ("warm-up", time.perf_counter() - started)]
        self._stages, self._ready_s = stages, time.perf_counter() - self._load_started
        self.ready = True
        self.metrics.set_ready(True)
        plan = self.capabilities.plan
        self.metrics.service.set_model(self.name, self.version, self.provider, self.info.opset,
                                       plan.source if plan else "given", plan.key if plan else "")
        log.info("ready: %s version %s on %s in %.2f s (%s), warmed up at batch sizes %s", self.name, self.version,
                 self.provider, self._ready_s,
                 ", ".join(f"{name} {seconds:.2f}" for name, seconds in stages), sizes)

    @asynccontextmanager
    async def admitted(self):
        """A request's hold on this version from routing to answer: `close` waits for every hold to end."""
        self.check_open()
        async with self.requests.held():
            yield self

    def check_open(self) -> None:
        if self.closing:
            raise VersionRetired(f"{self.name} version {self.version} was unloaded before this request reached it")

    async def submit(self, pixels: np.ndarray, timeout_s: float, target: int | None = None,
                     maps_free: bool = False) -> InferenceResult:
        assert self.batcher is not None, "load() starts the batcher before the version is routed to"
        return self.result_of(await self.batcher.submit(pixels, timeout_s, target, maps_free=maps_free))

    def result_of(self, batched) -> InferenceResult:
        """The batcher's BatchResult as the image's InferenceResult, naming this version."""
        return InferenceResult(batched.output, batched.queue_s, batched.inference_s, batched.batch_size,
                               version=self.version, batch_span=batched.batch_span, rung=batched.rung,
                               reason=batched.reason)

    @property
    def busy(self) -> bool:
        """Whether it has work queued or running now."""
        return self.batcher is not None and self.batcher.busy

    def predicted_wait_s(self) -> float:
        return self.batcher.predicted_wait_s() if self.batcher else 0.0

    def run_batch(self, pixel_values: np.ndarray, targets: np.ndarray | None = None, maps_free: bool = False,
                  wide: bool = False, rung: int = FULL) -> list:
        """The batcher's callback (runner thread): (B, C, H, W) -> B (logits (K,), rollout (h, w)) pairs, or with
        `targets` (B,) (the class to explain per image) the relevance path's (logits, rollout, relevance (h, w)).
        `maps_free`: no image of the batch needs its rollout (the batcher forms such batches only for a model with a
        maps-free graph); that graph runs them (the rollout then empty, (0,), the other outputs as ever).
        `wide`: the batch runs with no other beside it (the batcher asks so only for a model with a `wide`): the
        model loaded with every core's thread runs it.
        `rung`: the token budget to run at (an index into `ladder`): each image resampled to its grid first.
        An item whose outputs are not finite gets its own InferenceError; its batch-mates are unaffected."""
        model, capabilities = self.loaded_model, self.capabilities
        wide_model = capabilities.wide if wide else None  # the batcher asks for it only where the model has one
        if wide_model is not None and (not maps_free or wide_model.capabilities.maps_free is not None):
            model, capabilities = wide_model, wide_model.capabilities
        if pixel_values.dtype == np.uint8 and (targets is not None or not capabilities.raw_pixels or rung != FULL):
            # a frontend sent raw pixels (the pixel_transport setting) to a path that takes them normalised
            self._pixel_table = self._pixel_table or PixelTable(model.info.mean, model.info.std)
            pixel_values = self._pixel_table.host(pixel_values)
        if rung != FULL:
            pixel_values = resample(pixel_values, self.ladder[rung].grid)
        if targets is not None:
            outputs = model.explain(pixel_values, targets)
        elif maps_free:
            run_maps_free = capabilities.maps_free
            assert run_maps_free is not None, "the batcher forms maps-free batches only for a model with that graph"
            outputs = run_maps_free(pixel_values)
        else:
            outputs = model.run(pixel_values)
        if any(output.shape[0] != len(pixel_values) for output in outputs):
            raise InferenceError(f"model returned {outputs[0].shape[0]} results for {len(pixel_values)} images")
        # NaN and inf carry into a sum (in float64, which float32 values cannot overflow): a finite sum, all finite,
        # one reduction per output instead of a check per image
        if np.isfinite(sum(float(o.sum(dtype=np.float64)) for o in outputs)):
            return list(zip(*outputs))
        finite = np.logical_and.reduce([np.isfinite(o.reshape(len(o), -1)).all(axis=1) for o in outputs])
        return [tuple(o[i] for o in outputs) if finite[i] else InferenceError("model output is not finite")
                for i in range(len(pixel_values))]

    async def close(self, timeout_s: float) -> None:
        """Stop taking requests; wait (up to `timeout_s`) for the admitted ones, run what is queued, stop the
        batcher and drop the session, so its memory goes back."""
        self.closing, self.ready = True, False
        self.metrics.set_ready(False)
        if not await self.requests.released(timeout_s):
            log.warning("%s version %s: %d request(s) still in flight after %.0f s; closing it anyway", self.name,
                        self.version, self.requests.count, timeout_s)
        if self.batcher:
            await self.batcher.close(timeout_s)
        self.model = None
