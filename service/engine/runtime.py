"""ONNX Runtime: one session per process over a vitserve artifact (vitserve/artifact.py), warm-up.

The server talks to a model only through `InferenceModel` (the whole contract: `info`, `provider`,
`run`), so tests can wrap the real session to make it slow or make it fail.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx

from vitserve.artifact import INPUT_NAME, RELEVANCE_NAME, TARGET_NAME, ArtifactError, ModelInfo
from vitserve.machine import has_int8_dot_product
from vitserve.onnx_header import read_model_info
from vitserve.service.engine.attention_fusion import count_fused, maps_free
from vitserve.service.engine.cuda_graphs import CudaGraphBuckets, bucket_sizes, call_times_ms, median_ms
from vitserve.service.engine.graph_paths import ModelPaths, split_paths, symbolic_dims
from vitserve.service.engine.openvino_runtime import OpenVinoModel
from vitserve.service.engine.pixels import DeviceNormaliser, PixelTable, engine_normalises
from vitserve.service.engine.providers import CPU, CUDA, GPU_PROVIDERS, ORT_PROVIDERS, runs_on_cpu
from vitserve.service.ground.errors import ModelLoadError
from vitserve.service.ground.processes import usable_cores
from vitserve.service.ground.settings import Provider, Settings

log = logging.getLogger("vitserve.runtime")


Outputs = tuple[np.ndarray, ...]  # the arrays `info.output_names()` names, in its order, each (B, ...)


class InferenceModel(Protocol):
    """The contract between the server and a model: pixels (B, C, H, W) -> (logits (B, K), rollout (B, h, w), then
    the file's optional outputs); and, for a model whose `info.explains_classes`, the relevance path: pixels and a
    target class per image (B,) (-1: the top-1) -> (logits, rollout, relevance (B, h, w), then the optional ones).
    Pixels are float32, normalised; a model whose `takes_raw_pixels` is true also takes them uint8 on the fast path
    (service/engine/pixels.py). `run_maps_free`: `run`'s outputs with the rollout empty (B, 0), for batches that
    need no map (None: `run` serves them). The server reads those two with getattr, so a model without them (a
    test's wrapper) takes float32 and runs every batch with its maps."""

    info: ModelInfo
    provider: str

    @property
    def takes_raw_pixels(self) -> bool: ...

    @property
    def run_maps_free(self) -> Callable[[np.ndarray], Outputs] | None: ...

    def run(self, pixel_values: np.ndarray) -> Outputs: ...

    def explain(self, pixel_values: np.ndarray, targets: np.ndarray) -> Outputs: ...


def read_model_file_info(path: Path) -> ModelInfo:
    """The artifact's ModelInfo from the file alone (no session): a foreign or broken file is a ModelLoadError."""
    try:
        return read_model_info(path)
    except ArtifactError as e:
        raise ModelLoadError(str(e)) from e


def provider_chain(settings: Settings, available: list[str]) -> list[tuple[str, dict]]:
    """The configured providers that this onnxruntime build has, each with its options; CPU always last.

    The default list (cuda, cpu) means "the best this build has": on a CPU-only build CUDA is left out without a
    word. Providers the user named (VITSERVE_PROVIDERS, --providers) and this build lacks get a warning."""
    named = "providers" in settings.model_fields_set
    chain = []
    for name in settings.providers:
        ort_name = ORT_PROVIDERS[name]
        if ort_name not in available:
            if named:
                log.warning("execution provider %s requested but not in this onnxruntime build (%s); skipped",
                            ort_name, ", ".join(available))
            continue
        chain.append((ort_name, _provider_options(name, settings)))
    if all(name != CPU for name, _ in chain):
        chain.append((CPU, {}))
    return chain


def _provider_options(name: Provider, s: Settings) -> dict:
    if name == "cuda":
        options = {"device_id": s.cuda_device_id, "cudnn_conv_algo_search": s.cudnn_conv_algo_search,
                   "arena_extend_strategy": "kSameAsRequested", "do_copy_in_default_stream": True}
        if s.cuda_mem_limit_bytes:
            options["gpu_mem_limit"] = s.cuda_mem_limit_bytes
        return options
    if name == "tensorrt":
        options = {"device_id": s.cuda_device_id, "trt_fp16_enable": s.tensorrt_fp16}
        if s.tensorrt_cache_dir:
            options.update(trt_engine_cache_enable=True, trt_engine_cache_path=str(s.tensorrt_cache_dir))
        return options
    return {}


def intra_op_threads(settings: Settings) -> int:
    """The configured count; by default ORT's (one per core) for an engine process or a single worker, the cores
    shared out among inline workers (each has its own session)."""
    if settings.intra_op_threads or settings.engine == "process" or settings.http_workers == 1:
        return settings.intra_op_threads
    return max(1, usable_cores() // settings.http_workers)


def session_options(settings: Settings):
    import onnxruntime as ort
    levels = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
              "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
    opts = ort.SessionOptions()
    opts.graph_optimization_level = levels[settings.graph_optimization]
    opts.intra_op_num_threads = intra_op_threads(settings)
    opts.inter_op_num_threads = settings.inter_op_threads
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # Errors only: ORT's load-time warnings are about choices made on purpose (the optional `target_class` input,
    # "not treated as constant"; shape nodes placed on the CPU) and reach stderr unformatted. What matters, a
    # provider that did not start, the service logs itself (`OnnxModel.load`).
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if settings.intra_op_spinning else "0")
    return opts


class OnnxModel:
    """ONNX Runtime sessions over a vitserve artifact: the fast path's session (service/engine/graph_paths.py), on
    CUDA its captured buckets (service/engine/cuda_graphs.py), and the relevance path's session, made the first time
    a request asks for relevance."""

    def __init__(self, session, info: ModelInfo, io_binding: bool | None = None, *, make_relevance=None,
                 captured=None):
        self.session = session  # the fast path
        self.info = info
        self.provider = session.get_providers()[0]  # the provider actually in use, after any fallback
        # On a GPU, bind the input and outputs (ORT's CUDA EP docs, "IOBinding"): ORT copies the input to the
        # device once, before the graph runs, and the outputs back once, instead of per node that needs them on
        # the host. On the CPU there is nothing to copy. None: decide by the provider.
        self.io_binding = self.provider in GPU_PROVIDERS if io_binding is None else io_binding
        self._device = "cuda" if self.provider in GPU_PROVIDERS else "cpu"
        self.relevance = RelevancePath(make_relevance, info, self._device if self.io_binding else None)
        self.captured = captured  # CudaGraphBuckets or None
        # where this model takes uint8 pixels (service/engine/pixels.py)
        self.normaliser: DeviceNormaliser | None = None
        self.maps_free_path: MapsFreePath | None = None  # the maps-free graph, where this model serves one

    @property
    def run_maps_free(self) -> Callable[[np.ndarray], Outputs] | None:
        """`MapsFreePath.run` (`run`'s outputs, the rollout empty) where this model serves the maps-free graph, else
        None: what the engine calls for a batch that needs no map."""
        return self.maps_free_path.run if self.maps_free_path is not None else None

    @property
    def takes_raw_pixels(self) -> bool:
        """`run` takes (B, C, H, W) uint8 pixels and normalises them on the model's device."""
        return self.normaliser is not None

    @classmethod
    def load(cls, settings: Settings, artifact: tuple[ModelInfo, ModelPaths] | None = None) -> OnnxModel:
        """`artifact`: the file's info and graphs, when the caller has read them already (`read_artifact`)."""
        import onnxruntime as ort
        path = Path(settings.model_path)
        info, paths = artifact or read_artifact(path)
        chain = provider_chain(settings, ort.get_available_providers())
        fast, dims, split = paths.fast.SerializeToString(), symbolic_dims(paths), paths.relevance is not None
        session = new_session(fast, settings, chain, path, from_branch=split)
        _check_signature(session, info, path, split)
        relevance = None if paths.relevance is None else functools.partial(_relevance_session, path, settings,
                                                                            chain)
        model = cls(session, info, make_relevance=relevance)
        warn_on_fallback(model, chain)
        if engine_normalises(settings.pixel_transport, model.provider):
            model.normaliser = _normaliser(info, settings, chain, path, model._device)
        if model.provider == CUDA and settings.cuda_graphs:
            model.captured = _capture(model, fast, dims, settings, chain, path, split)
        if serves_maps_free(settings.maps_free, model.provider):
            model.maps_free_path = MapsFreePath.load(model, info, paths.fast, dims, settings, chain, path, split)
        del paths  # the relevance graph is read again from the file if a request ever asks for it
        log.debug("read %s %s (%s, opset %s) from %s on %s%s", info.name, info.version, info.precision,
                  info.opset, path, model.provider, " with CUDA graphs" if model.captured else "")
        return model

    def run(self, pixel_values: np.ndarray) -> Outputs:
        """The fast path: the outputs `info.output_names()` names (logits, rollout, then the file's optional ones).
        `pixel_values` float32 normalised, or uint8 where the model `takes_raw_pixels`."""
        return tuple(self.run_graph(self.session, self.info.output_names(), self.captured, pixel_values))

    def run_graph(self, session, names: tuple[str, ...], captured, pixel_values: np.ndarray) -> list[np.ndarray]:
        """`names` of one of this model's graphs (its dynamic `session`, its `captured` buckets or None), on pixels
        as `run` takes them."""
        normaliser = None  # set for raw pixels
        if pixel_values.dtype == np.uint8:
            normaliser = self.normaliser
            if normaliser is None:
                raise TypeError("this model takes normalised float32 pixels (it has no device normaliser)")
        if captured is not None and captured.covers(pixel_values):
            return captured.run(pixel_values, normaliser.to_device if normaliser is not None else None)
        if normaliser is not None:  # normalised into device memory and bound there: nothing float32 crosses over
            return run_session(session, names, {INPUT_NAME: normaliser.to_device(pixel_values)}, self._device)
        return self._run(session, names, {INPUT_NAME: pixel_values})

    def explain(self, pixel_values: np.ndarray, targets: np.ndarray) -> Outputs:
        """The relevance path: `targets` (B,) int64 names the class to explain per image, -1 its top-1."""
        return self.relevance.explain(pixel_values, targets)

    def relevance_session(self):
        return self.relevance.session()

    def _run(self, session, outputs: tuple[str, ...], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return run_session(session, outputs, feeds, self._device if self.io_binding else None)


def serves_maps_free(setting: str, provider: str) -> bool:
    """Whether a model on `provider` gets the maps-free graph (the `maps_free` setting: auto means on a GPU)."""
    return setting == "on" or (setting == "auto" and provider in GPU_PROVIDERS)


class MapsFreePath:
    """The fast graph without the rollout, attention fused (service/engine/attention_fusion.py), for batches that
    need no map: its own session and, on CUDA, its own captured buckets. `run` returns what `OnnxModel.run` does,
    the rollout empty ((B, 0)), so every consumer indexes the outputs as ever; pixels as `OnnxModel.run` takes
    them (uint8 where the model normalises on the device)."""

    def __init__(self, model: OnnxModel, session, names: tuple[str, ...], captured=None):
        self.model, self.session, self.names, self.captured = model, session, names, captured

    @classmethod
    def load(cls, model: OnnxModel, info: ModelInfo, fast: onnx.ModelProto, dims, settings: Settings,
             chain: list[tuple[str, dict]], path: Path, from_branch: bool) -> MapsFreePath | None:
        """The path, checked against the fast graph on probe images; None (with a warning) where the graph cannot
        be made or its answers differ: the fast graph then runs every batch, as without it."""
        started = time.perf_counter()
        rollout = info.output_names()[1]
        names = tuple(name for name in info.output_names() if name != rollout)
        try:
            graph = maps_free(fast, (rollout,))
            graph_bytes = graph.SerializeToString()
            session = new_session(graph_bytes, settings, chain, path, from_branch=from_branch)
            lean = cls(model, session, names)
            pixels = probe_pixels(info)
            disagreement = logits_disagree(lean.run(pixels)[0], model.run(pixels)[0])
        except Exception as e:  # noqa: BLE001 - the rewrite's or the runtime's: an optimisation never stops a load
            log.warning("no maps-free graph for %s: %s", path, str(e).splitlines()[0][:300] if str(e) else repr(e))
            return None
        if disagreement:
            log.warning("no maps-free graph for %s: its answers differ from the rollout graph's: %s", path,
                        disagreement)
            return None
        if model.captured is not None:
            lean.captured = _capture(model, graph_bytes, dims, settings, chain, path, from_branch, names,
                                     lean.run_dynamic)
        log.info("maps-free graph for %s: %d blocks' attention fused, ready in %.2f s%s", path, count_fused(graph),
                 time.perf_counter() - started, " with CUDA graphs" if lean.captured else "")
        return lean

    def run(self, pixel_values: np.ndarray) -> Outputs:
        outputs = self.model.run_graph(self.session, self.names, self.captured, pixel_values)
        rollout = np.empty((len(pixel_values), 0), np.float32)
        return (outputs[0], rollout, *outputs[1:])

    def run_dynamic(self, pixel_values: np.ndarray) -> list[np.ndarray]:
        return self.model.run_graph(self.session, self.names, None, pixel_values)


def run_session(session, outputs: tuple[str, ...], feeds: dict[str, np.ndarray], device: str | None) -> list:
    """One ORT call; with a `device` ("cuda"), through an IOBinding: the inputs bound from host memory (or, given as
    OrtValues, where they already are), the outputs left on the device until the one copy back."""
    if device is None:
        return session.run(list(outputs), feeds)
    binding = session.io_binding()
    for name, array in feeds.items():
        if isinstance(array, np.ndarray):
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        else:
            binding.bind_ortvalue_input(name, array)
    for name in outputs:
        binding.bind_output(name, device)
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()


class RelevancePath:
    """The relevance path's ONNX Runtime session, made the first time a request asks for relevance: a server whose
    clients never do holds no memory for it. `make`: a callable that makes the session; None: the file has no
    relevance path. Shared by every runtime (OpenVINO cannot take this graph)."""

    def __init__(self, make, info: ModelInfo, device: str | None):
        self._make, self.info, self._session, self._lock = make, info, None, threading.Lock()
        self._device = device  # bind inputs and outputs to this device ("cuda"); None: a plain run

    @property
    def made(self) -> bool:
        return self._session is not None

    def session(self):
        if self._make is None:
            raise ModelLoadError(f"{self.info.name} has no relevance path")
        with self._lock:
            if self._session is None:
                started = time.perf_counter()
                self._session = self._make()
                log.info("relevance path of %s %s ready in %.2f s", self.info.name, self.info.version,
                         time.perf_counter() - started)
            return self._session

    def explain(self, pixel_values: np.ndarray, targets: np.ndarray) -> Outputs:
        """The outputs `info.output_names(relevance=True)` names: logits, rollout, relevance, the optional ones."""
        return tuple(run_session(self.session(), self.info.output_names(relevance=True),
                                 {INPUT_NAME: pixel_values, TARGET_NAME: targets.astype(np.int64)}, self._device))


def read_artifact(path: Path) -> tuple[ModelInfo, ModelPaths]:
    """The file's ModelInfo (from its header first: a foreign ONNX file fails before the whole file is read) and its
    fast and relevance graphs."""
    info = read_model_file_info(path)
    return info, _read_paths(path)


def _read_paths(path: Path) -> ModelPaths:
    """The file's fast and relevance graphs. The whole file is checked first (onnx's checker: every node an
    operator of its opset, both branches included), so a file broken in the path a session is not made for yet
    (the relevance path, made on first use) is refused at load, not on a client's request."""
    try:
        proto = onnx.load(str(path))
    except Exception as e:  # protobuf's DecodeError, onnx's own
        raise ModelLoadError(f"cannot read ONNX model {path}: {e}") from e
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as e:
        raise ModelLoadError(f"cannot load ONNX model {path}: {str(e).splitlines()[0]}") from e
    return split_paths(proto)


def new_session(model: bytes, settings: Settings, chain: list[tuple[str, dict]], path: Path,
                 overrides: dict[str, int] | None = None, extra_options: dict | None = None, from_branch: bool = False):
    """A session of `model` (a serialized graph) with the server's options; `overrides` fix named dimensions,
    `extra_options` go to the GPU providers. `from_branch`: the graph was an If's branch in the file. ORT applies
    its NCHWc layout transform to a top-level graph and not inside a branch: left on, the split fast path's patch
    Conv would round differently from the file's (6e-7 in a logit) for a gain that is nil in a ViT (one Conv). Off,
    the split paths answer as the file does, bit for bit."""
    import onnxruntime as ort
    options = session_options(settings)
    for name, value in (overrides or {}).items():
        options.add_free_dimension_override_by_name(name, value)
    provider_options = [{**opts, **(extra_options or {})} if name in GPU_PROVIDERS else opts for name, opts in chain]
    try:
        return ort.InferenceSession(model, sess_options=options, providers=[name for name, _ in chain],
                                    provider_options=provider_options,
                                    disabled_optimizers=["NchwcTransformer"] if from_branch else None)
    except Exception as e:  # ORT raises its own Fail/InvalidProtobuf/... types
        raise ModelLoadError(f"cannot load ONNX model {path}: {e}") from e


def _relevance_session(path: Path, settings: Settings, chain: list[tuple[str, dict]]):
    relevance = _read_paths(path).relevance
    if relevance is None:
        raise ModelLoadError(f"{path} no longer has the relevance path (the file changed since it was loaded)")
    return new_session(relevance.SerializeToString(), settings, chain, path, from_branch=True)


def _normaliser(info: ModelInfo, settings: Settings, chain: list[tuple[str, dict]], path: Path,
                device: str) -> DeviceNormaliser | None:
    """The session that normalises uint8 pixels on the model's device; None (with a warning) where the runtime
    will not take its graph: the engine then normalises raw pixels on the host, slower but the same answers."""
    try:
        graph = PixelTable(info.mean, info.std).graph().SerializeToString()
        session = new_session(graph, settings, chain, path)
    except ModelLoadError as e:
        log.warning("uint8 pixels of %s are normalised on the host: %s", path, str(e).splitlines()[0][:300])
        return None
    return DeviceNormaliser(session, device, settings.cuda_device_id if device == "cuda" else 0)


def _capture(model: OnnxModel, fast: bytes, dims: tuple[str | None, str | None, str | None], settings: Settings,
             chain: list[tuple[str, dict]], path: Path, from_branch: bool, names: tuple[str, ...] | None = None,
             run_dynamic=None):
    """The fast path's CUDA graphs (or, with `names` and `run_dynamic`, another graph's of the same input: the
    maps-free one), one per batch bucket at the trained size where it beats the dynamic session; None (with a
    warning) where ORT will not capture this graph."""
    image = (model.info.channels, *model.info.image_size)
    names = names or model.info.output_names()
    run_dynamic = run_dynamic or (lambda pixels: model._run(model.session, names, {INPUT_NAME: pixels}))
    probe = run_dynamic(np.zeros((1, *image), np.float32))
    outputs = [(name, value.shape[1:], value.dtype.type) for name, value in zip(names, probe)]
    try:
        return CudaGraphBuckets.build(
            lambda overrides, extra: new_session(fast, settings, chain, path, overrides, extra, from_branch),
            INPUT_NAME,
            dims, image, outputs, bucket_sizes(settings.max_batch_size), settings.cuda_device_id,
            run_dynamic=run_dynamic)
    except Exception as e:  # noqa: BLE001 - ORT's refusal: the dynamic session still serves every batch
        log.warning("CUDA graphs not used for %s: %s", path, str(e).splitlines()[0][:300])
        return None


def warn_on_fallback(model: OnnxModel, chain: list[tuple[str, dict]]) -> None:
    """ORT falls back silently when a provider of its build cannot start (no GPU visible, no driver, missing
    CUDA libraries): say so when the model does not run on the first provider of the chain."""
    preferred = chain[0][0]
    if model.provider != preferred:
        log.warning("%s is in this onnxruntime build but the model runs on %s (no GPU visible, or its driver or "
                    "CUDA/cuDNN libraries are missing)", preferred, model.provider)


def _check_signature(session, info: ModelInfo, path: Path, has_relevance_path: bool) -> None:
    """`session` is the fast path's."""
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name for o in session.get_outputs()}
    if INPUT_NAME not in inputs or not set(info.output_names()) <= outputs:
        raise ModelLoadError(f"{path} must take '{INPUT_NAME}' and return {list(info.output_names())} (its "
                             f"metadata says so); it takes {sorted(inputs)} and returns {sorted(outputs)}")
    if info.explains_classes and not has_relevance_path:
        raise ModelLoadError(f"{path}: its metadata lists the relevance map, but the graph has no relevance path "
                             f"(an If on '{TARGET_NAME}' whose branch returns '{RELEVANCE_NAME}')")
    shape = inputs[INPUT_NAME].shape
    if len(shape) != 4 or shape[1] not in (info.channels, None, "channels"):
        raise ModelLoadError(f"{path}: input shape {shape} does not match {info.channels} channels")


# A model whose batch-1 call at its trained size takes less than this with every core is light: a server of it is
# HTTP-bound, and on the CPU its engine is better off leaving the cores to the HTTP workers (service/engine).
LIGHT_MODEL_MS = 10.0


def load_engine_model(settings: Settings) -> InferenceModel:
    """The model for an engine process: `load_model`, and with the intra-op thread count left to us (0) on the
    CPU, a light model reloaded on one thread. The HTTP workers share the cores with the engine, and an ORT call
    spread over every core waits for the one a worker holds: vit-fmnist on 2 cores, 2 workers, served 315-525
    requests/s with 2 intra-op threads against 590-620 with one. A heavy model (ViT-S/16: 72 ms) keeps every core
    for its one-client latency."""
    model = load_model(settings)
    if settings.intra_op_threads or not runs_on_cpu(model.provider) or usable_cores() == 1:
        return model
    milliseconds = batch_one_ms(model)
    if milliseconds >= LIGHT_MODEL_MS:
        return model
    log.info("a light model (%.2f ms at batch 1 on every core): one intra-op thread, the other cores for the HTTP "
             "workers (--intra-op-threads sets it)", milliseconds)
    # the runtime `auto` chose stays: choosing again would cost the load as much again
    chosen = {"runtime": "openvino", "precision_hint": model.precision} if isinstance(model, OpenVinoModel) else \
        {"runtime": "onnxruntime"}
    return load_model(settings.model_copy(update={"intra_op_threads": 1, **chosen}))


# ------------------------------------------------------------------------------------------ choosing the runtime

# OpenVINO must beat ONNX Runtime by this much to be chosen: near a tie the choice would flip between restarts with
# the machine's noise, and with it the answers' last bits.
AUTO_MARGIN = 0.9


def load_model(settings: Settings) -> InferenceModel:
    """The model on the runtime and precision `settings.runtime` and `settings.precision_hint` name.

    `onnxruntime`: `OnnxModel` (CUDA when there, else the CPU). `openvino`: the fast path compiled by OpenVINO for
    the CPU, the relevance path on ONNX Runtime. `auto`: ONNX Runtime on a GPU (the CUDA session is the mission's
    engine); on the CPU each candidate this machine can run (ONNX Runtime on the file's own precision, OpenVINO fp32,
    OpenVINO bf16 where the CPU has bfloat16 arithmetic) that agrees with ONNX Runtime on probe images, timed at
    batch 1 and at the largest batch, the fastest kept, ONNX Runtime unless another is at least 10% faster. What it
    chose and why is logged; the model's provider (the card, /v2 config, metrics) names it."""
    from vitserve.service.engine import openvino_runtime

    if settings.runtime == "onnxruntime" or (settings.runtime == "auto" and not openvino_runtime.available()):
        if settings.precision_hint == "bf16":
            raise ModelLoadError("precision bf16 needs the openvino runtime (ONNX Runtime's CPU provider computes "
                                 "float32): --runtime openvino or auto, with the openvino package installed")
        return OnnxModel.load(settings)
    if settings.runtime == "openvino":
        precision: str = "fp32" if settings.precision_hint == "auto" else settings.precision_hint
        return openvino_model(settings, precision)
    artifact = read_artifact(Path(settings.model_path))  # once, for every candidate
    reference = OnnxModel.load(settings, artifact)
    if not runs_on_cpu(reference.provider):
        return reference
    own = reference.info.precision  # the file's: int8 runs as int8 on every candidate, fp32 is what OpenVINO adds
    # first: the reference the others must beat
    candidates: dict[str, InferenceModel] = {f"onnxruntime/{own}": reference}
    for precision in auto_precisions(settings.precision_hint, openvino_runtime.cpu_capabilities()):
        try:
            model = openvino_model(settings, precision, reference.relevance, artifact)
        except ModelLoadError as e:
            log.warning("runtime auto: OpenVINO %s left out: %s", precision, e)
            continue
        disagreement = disagrees(model, reference)
        if disagreement:
            log.warning("runtime auto: OpenVINO %s left out: %s", precision, disagreement)
            continue
        candidates[candidate_name("openvino", own, precision)] = model
    return choose_fastest(candidates, settings.max_batch_size)


def candidate_name(runtime: str, file_precision: str, compute_precision: str) -> str:
    """What a candidate computes in: `openvino/fp32`, `openvino/bf16` for a float32 file; an int8 file's layers
    stay int8 whatever the hint, which sets the precision of the rest (`openvino/int8`, `openvino/int8+bf16`)."""
    if file_precision == "fp32" or compute_precision == file_precision:
        return f"{runtime}/{compute_precision}"
    return f"{runtime}/{file_precision}" if compute_precision == "fp32" else \
        f"{runtime}/{file_precision}+{compute_precision}"


def warn_if_int8_does_not_pay(info: ModelInfo, has_dot_product: Callable[[], bool] = has_int8_dot_product) -> bool:
    """Says so (and returns True) when an int8 file is served on a CPU without int8 dot-product units (VNNI, AMX),
    where its integer products are emulated and the float32 file is as fast or faster (docs/int8.md)."""
    if info.precision != "int8" or has_dot_product():
        return False
    log.warning("%s %s is int8, but this CPU has no int8 dot-product units (AVX512-VNNI, AVX-VNNI or AMX): int8 does "
                "not pay here, and the model's float32 file is likely as fast or faster (docs/int8.md)", info.name,
                info.version)
    return True


def auto_precisions(hint: str, capabilities: set[str]) -> list[str]:
    """OpenVINO's candidates for `auto`: fp32, and bf16 where the CPU computes it natively; a hint keeps one."""
    precisions = ["fp32", "bf16"] if "BF16" in capabilities else ["fp32"]
    return precisions if hint == "auto" else [p for p in precisions if p == hint]


def openvino_model(settings: Settings, precision: str, relevance: RelevancePath | None = None,
                   artifact: tuple[ModelInfo, ModelPaths] | None = None) -> OpenVinoModel:
    path = Path(settings.model_path)
    info, paths = artifact or read_artifact(path)
    if relevance is None and paths.relevance is not None:
        chain: list[tuple[str, dict]] = [(CPU, {})]
        relevance = RelevancePath(functools.partial(_relevance_session, path, settings, chain), info, None)
    model = OpenVinoModel.compile(paths.fast.SerializeToString(), info, precision, intra_op_threads(settings),
                                  relevance)
    log.debug("read %s %s (%s) from %s on %s", info.name, info.version, info.precision, path, model.provider)
    return model


def probe_pixels(info: ModelInfo, count: int = 16) -> np.ndarray:
    """Deterministic images at the trained size (smooth patterns plus noise, normalised as the server does)."""
    rng = np.random.default_rng(0)
    height, width = info.image_size
    yy, xx = np.mgrid[0:height, 0:width] / max(height, width)
    images = [np.sin(2 * np.pi * (rng.uniform(0.5, 3) * xx + rng.uniform(0.5, 3) * yy) + rng.uniform(0, 6))
              for _ in range(count * info.channels)]
    pixels = (np.stack(images).reshape(count, info.channels, height, width) * 100 + 128
              + rng.normal(0, 20, (count, info.channels, height, width))).clip(0, 255)
    mean, std = np.asarray(info.mean)[:, None, None], np.asarray(info.std)[:, None, None]
    return ((pixels / 255 - mean) / std).astype(np.float32)


def disagrees(model: InferenceModel, reference: InferenceModel) -> str:
    """Why `model` may not stand in for `reference` (ONNX Runtime float32), or "" (`logits_disagree` on the probe
    images)."""
    pixels = probe_pixels(model.info)
    return logits_disagree(model.run(pixels)[0], reference.run(pixels)[0])


def logits_disagree(got: np.ndarray, want: np.ndarray) -> str:
    """Why logits `got` may not stand in for `want`, or "": the same top-1 on every image whose reference top-2
    margin is clear (over 5% of its largest |logit|), logits within 5% of the largest."""
    scale = max(1.0, float(np.abs(want).max()))
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.05 * scale
    changed = int((got.argmax(1) != want.argmax(1))[clear].sum())
    worst = float(np.abs(got - want).max()) / scale
    if changed or worst > 0.05:
        return f"{changed} of {int(clear.sum())} clear probe images change class, logits {worst:.2%} apart"
    return ""


def choose_fastest(candidates: dict[str, InferenceModel], max_batch: int, rounds: int = 3) -> InferenceModel:
    """The candidate with the least time per image at batch 1 plus at `max_batch` (rounds alternate), the first
    (ONNX Runtime on the file's own precision) unless another is faster by more than AUTO_MARGIN: auto never serves
    a candidate slower than the file as it is."""
    if len(candidates) == 1:
        return next(iter(candidates.values()))
    info = next(iter(candidates.values())).info
    batches = {size: np.resize(probe_pixels(info), (size, info.channels, *info.image_size)).astype(np.float32)
               for size in sorted({1, max_batch})}
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, model in candidates.items():
            times[name].append(sum(batch_ms(model, pixels) / len(pixels) for pixels in batches.values()))
    cost = {name: float(np.median(t)) for name, t in times.items()}
    reference = next(iter(candidates))  # ONNX Runtime on the file's own precision
    best = min(cost, key=cost.__getitem__)
    if best != reference and cost[best] > AUTO_MARGIN * cost[reference]:
        best = reference
    log.info("runtime auto chose %s: ms per image at batch 1 plus at batch %d: %s", best, max_batch,
             ", ".join(f"{name} {ms:.3f}" for name, ms in cost.items()))
    return candidates[best]


def batch_ms(model: InferenceModel, pixels: np.ndarray, calls: int = 3) -> float:
    """The median ms of `calls` calls on `pixels`, after one that is not counted (it sets things up)."""
    return median_ms(lambda: model.run(pixels), calls)


def batch_one_ms(model: InferenceModel, calls: int = 9) -> float:
    """The fastest batch-1 call at the trained size (the first call, which sets things up, not counted): nearer the
    model's own cost than a median, which measures the machine's load as much. With both cores of this 2-core
    machine kept busy by other processes, the default model's median of 5 came to 6.5-9.4 ms (2.7 ms idle), near
    LIGHT_MODEL_MS; the fastest of 9, 3.0 and 7.8 ms. A server that misjudges takes the other thread count, and
    answers that differ in their last bits from another start's (1.9e-6 in a logit)."""
    pixels = np.zeros((1, model.info.channels, *model.info.image_size), np.float32)
    return min(call_times_ms(lambda: model.run(pixels), calls))


def warm_up(model: InferenceModel, batch_sizes: list[int]) -> None:
    """Run each batch size once at the trained resolution, so the first real request pays no set-up cost: in the
    pixels' type the frontends will send (a model that `takes_raw_pixels` gets uint8 ones), on each graph the
    model serves (the maps-free one too, where it has one)."""
    height, width = model.info.image_size
    dtype = np.uint8 if getattr(model, "takes_raw_pixels", False) else np.float32
    maps_free = getattr(model, "run_maps_free", None)
    for batch in batch_sizes:
        pixels = np.zeros((batch, model.info.channels, height, width), dtype)
        model.run(pixels)
        if maps_free is not None:
            maps_free(pixels)
