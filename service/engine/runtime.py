"""ONNX Runtime: one session per process over a vitserve artifact (vitserve/artifact.py), warm-up.

The server talks to a model only through `InferenceModel` (the whole contract: `info`, `provider`,
`run`), so tests can wrap the real session to make it slow or make it fail.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx

from service.core.errors import ModelLoadError
from service.engine.graph_paths import ModelPaths, split_paths, symbolic_dims
from service.settings import Settings
from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES, RELEVANCE_NAME, TARGET_NAME, ArtifactError, ModelInfo
from vitserve.onnx_header import read_model_info

log = logging.getLogger("vitserve.runtime")

_GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
_ORT_PROVIDER_NAMES = {"tensorrt": "TensorrtExecutionProvider", "cuda": "CUDAExecutionProvider",
                       "cpu": "CPUExecutionProvider"}


class InferenceModel(Protocol):
    """The contract between the server and a model: pixels (B, C, H, W) -> (logits (B, K), rollout (B, h, w));
    and, for a model whose `info.explains_classes`, the relevance path: pixels and a target class per image (B,)
    (-1: the top-1) -> (logits, rollout, relevance (B, h, w))."""

    info: ModelInfo
    provider: str

    def run(self, pixel_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def explain(self, pixel_values: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


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
        ort_name = _ORT_PROVIDER_NAMES[name]
        if ort_name not in available:
            if named:
                log.warning("execution provider %s requested but not in this onnxruntime build (%s); skipped",
                            ort_name, ", ".join(available))
            continue
        chain.append((ort_name, _provider_options(name, settings)))
    if all(name != "CPUExecutionProvider" for name, _ in chain):
        chain.append(("CPUExecutionProvider", {}))
    return chain


def _provider_options(name: str, s: Settings) -> dict:
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
    return max(1, (os.cpu_count() or 1) // settings.http_workers)


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
        self.io_binding = self.provider in _GPU_PROVIDERS if io_binding is None else io_binding
        self._device = "cuda" if self.provider in _GPU_PROVIDERS else "cpu"
        self._make_relevance, self._relevance, self._relevance_lock = make_relevance, None, threading.Lock()
        self.captured = captured  # CudaGraphBuckets or None

    @classmethod
    def load(cls, settings: Settings) -> "OnnxModel":
        import onnxruntime as ort
        path = Path(settings.model_path)
        info = read_model_file_info(path)  # fail on a foreign ONNX file before paying for a session
        chain = provider_chain(settings, ort.get_available_providers())
        paths = _read_paths(path)
        fast, dims, split = paths.fast.SerializeToString(), symbolic_dims(paths), paths.relevance is not None
        session = new_session(fast, settings, chain, path, from_branch=split)
        _check_signature(session, info, path, paths.relevance is not None)
        relevance = None if paths.relevance is None else functools.partial(_relevance_session, path, settings,
                                                                            chain)
        del paths  # the relevance graph is read again from the file if a request ever asks for it
        model = cls(session, info, make_relevance=relevance)
        warn_on_fallback(model, chain)
        if model.provider == "CUDAExecutionProvider" and settings.cuda_graphs:
            model.captured = _capture(model, fast, dims, settings, chain, path, split)
        log.info("loaded %s %s (%s, opset %s) from %s on %s%s", info.name, info.version, info.precision,
                 info.opset, path, model.provider, " with CUDA graphs" if model.captured else "")
        return model

    def run(self, pixel_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.captured is not None and self.captured.covers(pixel_values):
            logits, rollout = self.captured.run(pixel_values)
            return logits, rollout
        logits, rollout = self._run(self.session, OUTPUT_NAMES, {INPUT_NAME: pixel_values})
        return logits, rollout

    def explain(self, pixel_values: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The relevance path: `targets` (B,) int64 names the class to explain per image, -1 its top-1."""
        logits, rollout, relevance = self._run(self.relevance_session(), (*OUTPUT_NAMES, RELEVANCE_NAME),
                                               {INPUT_NAME: pixel_values, TARGET_NAME: targets.astype(np.int64)})
        return logits, rollout, relevance

    def relevance_session(self):
        """The relevance path's session, made on first use: a server whose clients never ask for relevance holds
        no memory for it."""
        if self._make_relevance is None:
            raise ModelLoadError(f"{self.info.name} has no relevance path")
        with self._relevance_lock:
            if self._relevance is None:
                started = time.perf_counter()
                self._relevance = self._make_relevance()
                log.info("relevance path of %s %s ready in %.2f s", self.info.name, self.info.version,
                         time.perf_counter() - started)
            return self._relevance

    def _run(self, session, outputs: tuple[str, ...], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if not self.io_binding:
            return session.run(list(outputs), feeds)
        # One call through an IOBinding: the inputs bound from host memory, the outputs left on the device until
        # the one copy back.
        binding = session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name in outputs:
            binding.bind_output(name, self._device)
        session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()


def _read_paths(path: Path) -> ModelPaths:
    try:
        return split_paths(onnx.load(str(path)))
    except Exception as e:  # protobuf's DecodeError, onnx's own
        raise ModelLoadError(f"cannot read ONNX model {path}: {e}") from e


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
    provider_options = [{**opts, **(extra_options or {})} if name in _GPU_PROVIDERS else opts for name, opts in chain]
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


def _capture(model: OnnxModel, fast: bytes, dims: tuple[str | None, ...], settings: Settings,
             chain: list[tuple[str, dict]], path: Path, from_branch: bool):
    """The fast path's CUDA graphs, one per batch bucket at the trained size where it beats the dynamic session;
    None (with a warning) where ORT will not capture this graph."""
    from service.engine.cuda_graphs import CudaGraphBuckets, bucket_sizes

    image = (model.info.channels, *model.info.image_size)
    probe = model._run(model.session, OUTPUT_NAMES, {INPUT_NAME: np.zeros((1, *image), np.float32)})
    outputs = [(name, value.shape[1:], value.dtype.type) for name, value in zip(OUTPUT_NAMES, probe)]
    try:
        return CudaGraphBuckets.build(
            lambda overrides, extra: new_session(fast, settings, chain, path, overrides, extra, from_branch),
            INPUT_NAME,
            dims, image, outputs, bucket_sizes(settings.max_batch_size), settings.cuda_device_id,
            run_dynamic=lambda pixels: model._run(model.session, OUTPUT_NAMES, {INPUT_NAME: pixels}))
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
    if INPUT_NAME not in inputs or not set(OUTPUT_NAMES) <= outputs:
        raise ModelLoadError(f"{path} must take '{INPUT_NAME}' and return {list(OUTPUT_NAMES)}; it takes "
                             f"{sorted(inputs)} and returns {sorted(outputs)}")
    if info.explains_classes and not has_relevance_path:
        raise ModelLoadError(f"{path}: its metadata lists the relevance map, but the graph has no relevance path "
                             f"(an If on '{TARGET_NAME}' whose branch returns '{RELEVANCE_NAME}')")
    shape = inputs[INPUT_NAME].shape
    if len(shape) != 4 or shape[1] not in (info.channels, None, "channels"):
        raise ModelLoadError(f"{path}: input shape {shape} does not match {info.channels} channels")


# A model whose batch-1 call at its trained size takes less than this with every core is light: a server of it is
# HTTP-bound, and on the CPU its engine is better off leaving the cores to the HTTP workers (service/engine).
LIGHT_MODEL_MS = 10.0


def load_engine_model(settings: Settings) -> OnnxModel:
    """The model for an engine process: `OnnxModel.load`, and with the intra-op thread count left to us (0) on the
    CPU, a light model reloaded on one thread. The HTTP workers share the cores with the engine, and an ORT call
    spread over every core waits for the one a worker holds: vit-fmnist on 2 cores, 2 workers, served 315-525
    requests/s with 2 intra-op threads against 590-620 with one. A heavy model (ViT-S/16: 72 ms) keeps every core
    for its one-client latency."""
    model = OnnxModel.load(settings)
    if settings.intra_op_threads or model.provider != "CPUExecutionProvider" or (os.cpu_count() or 1) == 1:
        return model
    milliseconds = batch_one_ms(model)
    if milliseconds >= LIGHT_MODEL_MS:
        return model
    log.info("a light model (%.2f ms at batch 1 on every core): one intra-op thread, the other cores for the HTTP "
             "workers (--intra-op-threads sets it)", milliseconds)
    return OnnxModel.load(settings.model_copy(update={"intra_op_threads": 1}))


def batch_one_ms(model: InferenceModel, calls: int = 5) -> float:
    """The median time of a batch-1 call at the trained size (the first call, which sets things up, not counted)."""
    height, width = model.info.image_size
    pixels = np.zeros((1, model.info.channels, height, width), np.float32)
    model.run(pixels)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        model.run(pixels)
        times.append((time.perf_counter() - started) * 1000)
    return float(np.median(times))


def warm_up(model: InferenceModel, batch_sizes: list[int]) -> None:
    """Run each batch size once at the trained resolution, so the first real request pays no set-up cost."""
    height, width = model.info.image_size
    for batch in batch_sizes:
        model.run(np.zeros((batch, model.info.channels, height, width), np.float32))
