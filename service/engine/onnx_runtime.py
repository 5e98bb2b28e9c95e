"""ONNX Runtime: the sessions over a vitserve artifact (vitserve/artifact.py): the fast path, on CUDA its captured
CUDA graphs, the maps-free graph where it pays, and the relevance path made on first use. Registered as
`onnxruntime` (`ONNX_RUNTIME`); the reference `--runtime auto` measures every other runtime against.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from vitserve.artifact import INPUT_NAME, RELEVANCE_NAME, TARGET_NAME, ModelInfo
from vitserve.service.engine.attention_fusion import count_fused, maps_free
from vitserve.service.engine.cuda_graphs import CudaGraphBuckets, bucket_sizes, pad_rows, padded_size
from vitserve.service.engine.graph_paths import ModelPaths, split_paths, symbolic_dims
from vitserve.service.engine.inference_model import (
    Artifact,
    Capabilities,
    Outputs,
    RuntimeSpec,
    intra_op_threads,
    logits_disagree,
    probe_pixels,
    read_model_file_info,
    wide_settings,
)
from vitserve.service.engine.pixels import DeviceNormaliser, PixelTable, engine_normalises
from vitserve.service.engine.providers import CPU, CUDA, GPU_PROVIDERS, ORT_PROVIDERS
from vitserve.service.ground.errors import ModelLoadError

if TYPE_CHECKING:  # pydantic's settings stay out of the runtimes: the peers' venvs compile models without them
    from vitserve.service.ground.settings import Provider, Settings

log = logging.getLogger("vitserve.runtime")


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
        # The arena grows by powers of two (ORT's default): growing by exactly what a call asks for left ViT-B/16's
        # sessions holding 9.3 GB after ten batch sizes against 3.8 GB, each size's second call as slow as its first
        # (an H200, docs/results/bench-gpu.md).
        options = {"device_id": s.cuda_device_id, "cudnn_conv_algo_search": s.cudnn_conv_algo_search,
                   "arena_extend_strategy": "kNextPowerOfTwo", "do_copy_in_default_stream": True}
        if s.cuda_mem_limit_bytes:
            options["gpu_mem_limit"] = s.cuda_mem_limit_bytes
        return options
    if name == "tensorrt":
        options = {"device_id": s.cuda_device_id, "trt_fp16_enable": s.tensorrt_fp16}
        if s.tensorrt_cache_dir:
            options.update(trt_engine_cache_enable=True, trt_engine_cache_path=str(s.tensorrt_cache_dir))
        return options
    return {}


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

    runtime = "onnxruntime"
    precision_hint = "auto"  # the file's own precision: ONNX Runtime's CPU provider computes what the file holds

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
        # The model loaded again with every core's thread, where the batcher's runners share the cores out (one
        # thread each on two cores): what a batch of one runs on while nothing else does (`wide_settings`).
        self.wide: OnnxModel | None = None
        # On a GPU, what a batch on a dynamic session is padded to (`gpu_batch_step`): each new batch size's first
        # call there costs far more than the call itself, so the sizes are few and all run at load.
        self.batch_step, self.max_batch_size = 0, 0
        self.capabilities = Capabilities()  # what `load` made, declared once it has (`declared_capabilities`)

    def declared_capabilities(self) -> Capabilities:
        return Capabilities(raw_pixels=self.takes_raw_pixels, maps_free=self.run_maps_free, wide=self.wide,
                            padded_batch_sizes=tuple(self.padded_batch_sizes), cuda_graphs=self.captured is not None)

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
    def load(cls, settings: Settings, artifact: tuple[ModelInfo, ModelPaths] | None = None,
             probe: bool = True) -> OnnxModel:
        """`artifact`: the file's info and graphs, when the caller has read them already (`read_artifact`).
        `probe`: check the maps-free graph's answers on probe images (off for a wide copy: its model checked the
        same graph, and a batch of probes would grow the arena of sessions that run one image)."""
        import onnxruntime as ort
        path = Path(settings.model_path)
        info, paths = artifact or read_artifact(path)
        chain = provider_chain(settings, ort.get_available_providers())
        fast, dims, split = paths.fast.SerializeToString(), symbolic_dims(paths), paths.relevance is not None
        session = new_session(fast, settings, chain, path, from_branch=split)
        _check_signature(session, info, path, split)
        relevance = None if paths.relevance is None else functools.partial(make_relevance_session, path, settings,
                                                                            chain)
        model = cls(session, info, make_relevance=relevance)
        warn_on_fallback(model, chain)
        if engine_normalises(settings.pixel_transport, model.provider):
            model.normaliser = _normaliser(info, settings, chain, path, model._device)
        if model.provider == CUDA:  # measured there; TensorRT's engine covers a range of batch sizes at once
            model.batch_step, model.max_batch_size = settings.gpu_batch_step, settings.max_batch_size
        if model.provider == CUDA and settings.cuda_graphs:
            model.captured = _capture(model, fast, dims, settings, chain, path, split)
        if settings.maps_free != "off":
            model.maps_free_path = MapsFreePath.load(model, info, paths.fast, dims, settings, chain, path, split, probe)
        wide = wide_settings(settings, on_cpu=model.provider == CPU)
        if wide is not None:  # the fast graph, and the maps-free one where this model has it
            model.wide = cls.load(wide.model_copy(update={"maps_free": "on" if model.maps_free_path else "off"}),
                                  (info, paths), probe=False)
        del paths  # the relevance graph is read again from the file if a request ever asks for it
        model.capabilities = model.declared_capabilities()
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
        count = len(pixel_values)
        pixel_values = pad_rows(pixel_values, padded_size(count, self.batch_step, self.max_batch_size))
        if normaliser is not None:  # normalised into device memory and bound there: nothing float32 crosses over
            outputs = run_session(session, names, {INPUT_NAME: normaliser.to_device(pixel_values)}, self._device)
        else:
            outputs = self._run(session, names, {INPUT_NAME: pixel_values})
        return outputs if len(pixel_values) == count else [output[:count] for output in outputs]

    @property
    def padded_batch_sizes(self) -> list[int]:
        """The batch sizes a dynamic session runs at the trained size on a GPU (`gpu_batch_step`; none where it is
        0): what `warm_up` runs before the model serves, so no client pays a size's first call."""
        if not self.batch_step:
            return []
        graphs = [self.captured] + ([self.maps_free_path.captured] if self.maps_free_path is not None else [])
        return sorted({padded_size(count, self.batch_step, self.max_batch_size)
                       for count in range(1, self.max_batch_size + 1)
                       if any(c is None or c.bucket_for(count) not in c.buckets for c in graphs)})

    def explain(self, pixel_values: np.ndarray, targets: np.ndarray) -> Outputs:
        """The relevance path: `targets` (B,) int64 names the class to explain per image, -1 its top-1."""
        return self.relevance.explain(pixel_values, targets)

    def relevance_session(self):
        return self.relevance.session()

    def _run(self, session, outputs: tuple[str, ...], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return run_session(session, outputs, feeds, self._device if self.io_binding else None)


class MapsFreePath:
    """The fast graph without the rollout, attention fused (service/engine/attention_fusion.py), for batches that
    need no map: its own session and, on CUDA, its own captured buckets. `run` returns what `OnnxModel.run` does,
    the rollout empty ((B, 0)), so every consumer indexes the outputs as ever; pixels as `OnnxModel.run` takes
    them (uint8 where the model normalises on the device)."""

    def __init__(self, model: OnnxModel, session, names: tuple[str, ...], captured=None):
        self.model, self.session, self.names, self.captured = model, session, names, captured

    @classmethod
    def load(cls, model: OnnxModel, info: ModelInfo, fast: onnx.ModelProto, dims, settings: Settings,
             chain: list[tuple[str, dict]], path: Path, from_branch: bool, probe: bool = True) -> MapsFreePath | None:
        """The path, checked against the fast graph on probe images (unless not `probe`); None (with a warning)
        where the graph cannot be made or its answers differ: the fast graph then runs every batch, as without it."""
        started = time.perf_counter()
        rollout = info.output_names()[1]
        names = tuple(name for name in info.output_names() if name != rollout)
        try:
            graph = maps_free(fast, (rollout,))
            graph_bytes = graph.SerializeToString()
            session = new_session(graph_bytes, settings, chain, path, from_branch=from_branch)
            lean = cls(model, session, names)
            pixels = probe_pixels(info)
            disagreement = logits_disagree(lean.run(pixels)[0], model.run(pixels)[0]) if probe else ""
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


def make_relevance_session(path: Path, settings: Settings, chain: list[tuple[str, dict]]):
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


def load_onnx_model(settings: Settings, artifact: Artifact | None = None) -> OnnxModel:
    if settings.precision_hint == "bf16":
        raise ModelLoadError("precision bf16 needs the openvino runtime (ONNX Runtime's CPU provider computes "
                             "float32): --runtime openvino or auto, with the openvino package installed")
    return OnnxModel.load(settings, artifact)


ONNX_RUNTIME = RuntimeSpec("onnxruntime", load_onnx_model)
