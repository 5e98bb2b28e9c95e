"""ONNX Runtime: one session per process over a vitserve artifact (vitserve/artifact.py), warm-up.

The server talks to a model only through `InferenceModel` (the whole contract: `info`, `provider`,
`run`), so tests can wrap the real session to make it slow or make it fail.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Protocol

import numpy as np

from service.core.errors import ModelLoadError
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
    """One ONNX Runtime session over a vitserve artifact."""

    def __init__(self, session, info: ModelInfo, io_binding: bool | None = None):
        self.session = session
        self.info = info
        self.provider = session.get_providers()[0]  # the provider actually in use, after any fallback
        # On a GPU, bind the input and outputs (ORT's CUDA EP docs, "IOBinding"): ORT copies the input to the
        # device once, before the graph runs, and the outputs back once, instead of per node that needs them on
        # the host. On the CPU there is nothing to copy. None: decide by the provider.
        self.io_binding = self.provider in _GPU_PROVIDERS if io_binding is None else io_binding
        self._device = "cuda" if self.provider in _GPU_PROVIDERS else "cpu"

    @classmethod
    def load(cls, settings: Settings) -> "OnnxModel":
        import onnxruntime as ort
        path = Path(settings.model_path)
        info = read_model_file_info(path)  # fail on a foreign ONNX file before paying for a session
        chain = provider_chain(settings, ort.get_available_providers())
        try:
            session = ort.InferenceSession(str(path), sess_options=session_options(settings),
                                           providers=[name for name, _ in chain],
                                           provider_options=[options for _, options in chain])
        except Exception as e:  # ORT raises its own Fail/InvalidProtobuf/... types
            raise ModelLoadError(f"cannot load ONNX model {path}: {e}") from e
        _check_signature(session, info, path)
        model = cls(session, info)
        log.info("loaded %s %s (%s, opset %s) from %s on %s", info.name, info.version, info.precision,
                 info.opset, path, model.provider)
        warn_on_fallback(model, chain)
        return model

    def run(self, pixel_values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits, rollout = self._run(OUTPUT_NAMES, {INPUT_NAME: pixel_values})
        return logits, rollout

    def explain(self, pixel_values: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The relevance path: `targets` (B,) int64 names the class to explain per image, -1 its top-1."""
        logits, rollout, relevance = self._run((*OUTPUT_NAMES, RELEVANCE_NAME),
                                               {INPUT_NAME: pixel_values, TARGET_NAME: targets.astype(np.int64)})
        return logits, rollout, relevance

    def _run(self, outputs: tuple[str, ...], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        if not self.io_binding:
            return self.session.run(list(outputs), feeds)
        # One call through an IOBinding: the inputs bound from host memory, the outputs left on the device until
        # the one copy back.
        binding = self.session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name in outputs:
            binding.bind_output(name, self._device)
        self.session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()


def warn_on_fallback(model: OnnxModel, chain: list[tuple[str, dict]]) -> None:
    """ORT falls back silently when a provider of its build cannot start (no GPU visible, no driver, missing
    CUDA libraries): say so when the model does not run on the first provider of the chain."""
    preferred = chain[0][0]
    if model.provider != preferred:
        log.warning("%s is in this onnxruntime build but the model runs on %s (no GPU visible, or its driver or "
                    "CUDA/cuDNN libraries are missing)", preferred, model.provider)


def _check_signature(session, info: ModelInfo, path: Path) -> None:
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name for o in session.get_outputs()}
    if INPUT_NAME not in inputs or not set(OUTPUT_NAMES) <= outputs:
        raise ModelLoadError(f"{path} must take '{INPUT_NAME}' and return {list(OUTPUT_NAMES)}; it takes "
                             f"{sorted(inputs)} and returns {sorted(outputs)}")
    if info.explains_classes and (RELEVANCE_NAME not in outputs or TARGET_NAME not in _all_inputs(session)):
        raise ModelLoadError(f"{path}: its metadata lists the relevance map, but the graph lacks the "
                             f"'{TARGET_NAME}' input or the '{RELEVANCE_NAME}' output")
    shape = inputs[INPUT_NAME].shape
    if len(shape) != 4 or shape[1] not in (info.channels, None, "channels"):
        raise ModelLoadError(f"{path}: input shape {shape} does not match {info.channels} channels")


def _all_inputs(session) -> set[str]:
    """Inputs, including those with a default (ONNX Runtime lists them apart, as overridable initializers)."""
    return {i.name for i in [*session.get_inputs(), *session.get_overridable_initializers()]}


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
