"""OpenVINO: the artifact's fast path compiled for the CPU, behind the same `InferenceModel` contract as ONNX Runtime.

Why a second runtime: on a Xeon with AMX (Sapphire Rapids and later) OpenVINO runs the same ONNX file in bfloat16 on
the matrix units, 2.2-3.7x ONNX Runtime's float32 on the vector units at the same accuracy. ONNX
Runtime's own OpenVINO execution provider was tried and left aside: asked for bf16 through `load_config` it ran
float32 (float32's speed and float32's exact answers), and it hides which precision really ran; the OpenVINO API
says (`get_property("INFERENCE_PRECISION_HINT")` on the compiled model).

OpenVINO cannot convert the relevance branch of the artifact's `If` (its ReduceSum, ScatterElements, Slice and
Transpose fail), so it gets the fast graph alone (service/engine/graph_paths.py), read from bytes; the relevance path
stays on ONNX Runtime, made on first use as in `OnnxModel`.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from vitserve.artifact import EMBEDDING_NAME, OUTPUT_NAMES, ModelInfo
from vitserve.machine import has_int8_dot_product
from vitserve.service.engine.inference_model import (
    Artifact,
    Capabilities,
    InferenceModel,
    RuntimeSpec,
    intra_op_threads,
    logits_disagree,
    probe_pixels,
    wide_settings,
)
from vitserve.service.engine.onnx_runtime import RelevancePath, make_relevance_session, read_artifact
from vitserve.service.engine.providers import CPU, openvino_provider
from vitserve.service.engine.serving_plan import tuning_dir
from vitserve.service.ground.errors import ModelLoadError
from vitserve.service.ground.processes import usable_cores

if TYPE_CHECKING:  # pydantic's settings stay out of the runtimes: the peers' venvs compile models without them
    from vitserve.service.ground.settings import Settings

log = logging.getLogger("vitserve.runtime")

# Importing OpenVINO sends a telemetry event (openvino/tools/ovc/__init__.py, through the openvino_telemetry package,
# which starts a process to post it); a server sends nothing anywhere it was not asked to. OpenVINO's only switches
# are a consent file in the user's home (its `opt_in_out` command) and CI=true; with the package absent from the
# import system, OpenVINO falls back to its own stub (telemetry_stub) and nothing is sent. A process that imported
# the package before this module keeps it.
sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]

PRECISION_HINTS = {"fp32": "f32", "bf16": "bf16"}


def available() -> bool:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


def cpu_capabilities() -> set[str]:
    """What OpenVINO's CPU plugin says this CPU computes natively: 'FP32', 'BF16' (AVX512-BF16 or AMX), 'INT8', ..."""
    import openvino as ov
    return set(ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))


class _SignalStack(ctypes.Structure):  # libc's stack_t
    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


@contextlib.contextmanager
def signal_stack_kept():
    """The calling thread's alternate signal stack as it was before the block, whatever the block did to it.

    OpenVINO's compile_model installs an alternate signal stack (11,568 bytes) on the thread that calls it and never
    takes it down; its memory can go with the compiled model. CPython installs its signal handlers with SA_ONSTACK,
    so the next Ctrl-C (SIGINT) or SIGTERM delivered to that thread is written onto the freed stack and the process
    dies of SIGSEGV instead of shutting down (found on a CPU with AVX512-BF16: `--runtime auto` compiles two models
    and drops one). Putting the thread's own setting back through libc's sigaltstack(2) is the only way: OpenVINO
    has no option for it."""
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    before = _SignalStack()
    if libc is None or libc.sigaltstack(None, ctypes.byref(before)) != 0:
        yield
        return
    try:
        yield
    finally:
        if before.ss_flags & 2:  # SS_DISABLE: the thread had none
            before = _SignalStack(None, 2, 0)
        libc.sigaltstack(ctypes.byref(before), None)


def compiled_precision(compiled) -> str:
    """The precision OpenVINO compiled for, in its short spelling ("f32", "bf16"): the property is an `ov.Type`,
    whose str() is "<Type: 'bfloat16'>" and whose to_string() is the short name."""
    ran = compiled.get_property("INFERENCE_PRECISION_HINT")
    return ran.to_string() if hasattr(ran, "to_string") else str(ran)


def embedding_in_inference_precision(model, precision: str):
    """The model with its `embedding` output (where it has one) handed over in `precision` instead of float32.

    Why: to keep a model's outputs accurate, OpenVINO's CPU plugin computes in float32 every node it reaches walking
    back from an output through element-wise, normalisation and data-movement nodes, stopping only at a matrix
    product or a convolution (the plugin's `Graph::EnforceInferencePrecision`). The logits come out of the head's
    matrix product, so the walk from them stops at once; the embedding is the class token after the final LayerNorm,
    and the walk from it runs up the residual stream through every block: 16 additions, the LayerNorm and 24 more
    reorders ran in float32, and the default model's bf16 batch cost 6-13% more than without the output.
    An output asked for in the inference precision is exempt from the walk, so the residual stream stays in bf16 as
    it is without the output; the embedding then has the precision the logits are computed from."""
    import openvino as ov
    from openvino.preprocess import PrePostProcessor

    if EMBEDDING_NAME not in {name for output in model.outputs for name in output.get_names()}:
        return model
    steps = PrePostProcessor(model)
    steps.output(EMBEDDING_NAME).tensor().set_element_type(getattr(ov.Type, precision))
    return steps.build()


def widened_bfloat16(values: np.ndarray) -> np.ndarray:
    """A bfloat16 output as float32 (exact: bfloat16 is float32's upper 16 bits). OpenVINO's Python API hands a
    bf16 tensor over as its raw 16-bit words typed float16, which numpy has no bfloat16 to type otherwise."""
    words = np.asarray(values).view(np.uint16)
    return (words.astype(np.uint32) << 16).view(np.float32)


class OpenVinoModel:
    """The fast path compiled by OpenVINO for the CPU at a precision; `explain` runs ONNX Runtime's relevance path
    (`relevance`: service.engine.runtime.RelevancePath)."""

    def __init__(self, compiled, info: ModelInfo, precision: str, relevance=None, with_rollout: bool = True):
        self.compiled, self.info, self.precision = compiled, info, precision
        self.provider = openvino_provider(precision)
        self.runtime, self.precision_hint = "openvino", precision
        # the maps-free graph's `run` where this model has one (`maps_free_run`); None: `run` serves all batches
        self.run_maps_free: Callable[[np.ndarray], tuple[np.ndarray, ...]] | None = None
        # the model compiled again with one stream of every core's thread, where the runners' streams share the
        # cores out (`wide_settings`): for a batch of one with nothing beside it; None: the streams run every batch
        self.wide: OpenVinoModel | None = None
        self.capabilities = Capabilities()  # what `openvino_model` made, declared once it has
        self._with_rollout = with_rollout  # False: compiled without the rollout, which `run` returns empty ((B, 0))
        names = info.output_names() if with_rollout else \
            tuple(n for n in info.output_names() if n != OUTPUT_NAMES[1])
        self._outputs = [compiled.output(name) for name in names]  # by name, in the contract's order
        self._bfloat16 = [output.get_element_type().to_string() == "bf16" for output in self._outputs]
        self._requests = threading.local()  # an InferRequest is not safe to share between threads
        self.relevance = relevance

    @classmethod
    def compile(cls, fast_graph: bytes, info: ModelInfo, precision: str, threads: int,
                relevance=None, with_rollout: bool = True, streams: int = 1,
                cache_dir: Path | None = None) -> OpenVinoModel:
        """`threads` per inference (0: OpenVINO's choice), on `streams` that run as many inferences at once (the
        batcher's runners: one stream would run their batches one after another). `cache_dir`: OpenVINO's cache of
        compiled models (`compiled_model_cache`)."""
        import openvino as ov

        core = ov.Core()
        if precision == "bf16" and "BF16" not in cpu_capabilities():
            raise ModelLoadError("precision bf16: this CPU has no bfloat16 arithmetic (AVX512-BF16 or AMX; "
                                 f"OpenVINO says {sorted(cpu_capabilities())}); OpenVINO would run float32")
        config: dict[str, object] = {"INFERENCE_PRECISION_HINT": PRECISION_HINTS[precision],
                                     "PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": pins_cores(threads, streams)}
        if streams > 1:
            config["NUM_STREAMS"] = str(streams)
        if threads:
            config["INFERENCE_NUM_THREADS"] = str(threads * streams)  # OpenVINO's count is all streams' together
        if cache_dir is not None:
            config["CACHE_DIR"] = str(cache_dir)
        try:
            with signal_stack_kept():
                model = core.read_model(fast_graph)
                if precision != "fp32":
                    model = embedding_in_inference_precision(model, PRECISION_HINTS[precision])
                compiled = core.compile_model(model, "CPU", config)
        except Exception as e:  # OpenVINO raises RuntimeError with the converter's message
            raise ModelLoadError(f"OpenVINO cannot compile {info.name} {info.version}: {str(e)[:500]}") from e
        ran = compiled_precision(compiled)
        if ran != PRECISION_HINTS[precision]:
            raise ModelLoadError(f"OpenVINO compiled {info.name} in {ran}, not {PRECISION_HINTS[precision]}")
        return cls(compiled, info, precision, relevance, with_rollout)

    def run(self, pixel_values: np.ndarray) -> tuple[np.ndarray, ...]:
        request = getattr(self._requests, "request", None)
        if request is None:
            request = self._requests.request = self.compiled.create_infer_request()
        results = request.infer({0: np.ascontiguousarray(pixel_values, np.float32)})
        # copies: the request's output buffers are reused by its next call
        outputs = tuple(widened_bfloat16(results[output]) if bfloat16 else np.array(results[output])
                        for output, bfloat16 in zip(self._outputs, self._bfloat16))
        if self._with_rollout:
            return outputs
        return (outputs[0], np.empty((len(pixel_values), 0), np.float32), *outputs[1:])

    def explain(self, pixel_values: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, ...]:
        if self.relevance is None:
            raise ModelLoadError(f"{self.info.name} has no relevance path")
        return self.relevance.explain(pixel_values, targets)


def compiled_model_cache(settings: Settings) -> Path | None:
    """OpenVINO's cache of compiled models, beside the tuning records (None with `tuning off`, or where the folder
    cannot be made): the same graph at the same precision and threads, compiled again by a later load or a replica that
    shares the folder, is read back instead (the default model's graph: 0.19 s to compile, 0.085 s read back on the
    2-core EPYC). OpenVINO keys each entry by the graph, the device and the configuration: a cached model is the
    same compiled model, its answers the same bits."""
    if settings.tuning == "off":
        return None
    folder = tuning_dir(settings) / "openvino"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.info("OpenVINO compiles without its cache: %s", e)
        return None
    return folder


def pins_cores(threads: int, streams: int) -> bool:
    """Whether OpenVINO may pin this model's inference threads to cores: only where they are given every core this
    process may use (0: OpenVINO's own count, every core). OpenVINO pins by default, each process from the first
    core: two HTTP workers with a one-thread session each had both inferences on one core, while the other served
    HTTP alone. On a 2-core EPYC at 32 clients (the default model, bf16, a session in each of 2 workers): 711-836
    req/s pinned, 1,184-1,328 unpinned on the image and OIP paths (docs/results/bench-peers.md#topology)."""
    return threads == 0 or threads * streams >= usable_cores()


def auto_precisions(hint: str, capabilities: set[str]) -> list[str]:
    """OpenVINO's candidates for `auto`: fp32, and bf16 where the CPU computes it natively; a hint keeps one."""
    precisions = ["fp32", "bf16"] if "BF16" in capabilities else ["fp32"]
    return precisions if hint == "auto" else [p for p in precisions if p == hint]


def openvino_model(settings: Settings, precision: str, relevance: RelevancePath | None = None,
                   artifact: Artifact | None = None) -> OpenVinoModel:
    path = Path(settings.model_path)
    info, paths = artifact or read_artifact(path)
    if relevance is None and paths.relevance is not None:
        chain: list[tuple[str, dict]] = [(CPU, {})]
        relevance = RelevancePath(functools.partial(make_relevance_session, path, settings, chain), info, None)
    cache = compiled_model_cache(settings)
    model = OpenVinoModel.compile(paths.fast.SerializeToString(), info, precision, intra_op_threads(settings),
                                  relevance, streams=settings.batch_runners, cache_dir=cache)
    if settings.maps_free != "off":
        model.run_maps_free = maps_free_run(model, paths.fast, settings, cache)
    wide = wide_settings(settings, on_cpu=True)
    if wide is not None:  # the fast graph, and the maps-free one where this model has it
        pinned = wide.model_copy(update={"maps_free": "on" if model.run_maps_free else "off"})
        model.wide = openvino_model(pinned, precision, relevance, (info, paths))
    # its inputs come normalised (the engine normalises raw ones on the host); no CUDA graphs, no padding
    model.capabilities = Capabilities(maps_free=model.run_maps_free, wide=model.wide)
    log.debug("read %s %s (%s) from %s on %s", info.name, info.version, info.precision, path, model.provider)
    return model


def maps_free_run(model: OpenVinoModel, fast, settings: Settings,
                  cache: Path | None = None) -> Callable[[np.ndarray], tuple] | None:
    """The fast graph compiled again without the rollout output (OpenVINO then leaves out the nodes that only it
    needs; the attention fusion of ONNX Runtime's maps-free graph is not for OpenVINO: it has no com.microsoft
    operators), for batches that need no map; kept where it agrees with the rollout graph on probe images. None
    otherwise, with a warning."""
    info, graph = model.info, onnx.ModelProto()
    graph.CopyFrom(fast)
    kept = [output for output in graph.graph.output if output.name != OUTPUT_NAMES[1]]
    del graph.graph.output[:]
    graph.graph.output.extend(kept)
    try:
        lean = OpenVinoModel.compile(graph.SerializeToString(), info, model.precision, intra_op_threads(settings),
                                     with_rollout=False, streams=settings.batch_runners,
                                     cache_dir=cache)
    except ModelLoadError as e:
        log.warning("no maps-free graph for %s %s: %s", info.name, info.version, e)
        return None
    pixels = probe_pixels(info)
    disagreement = logits_disagree(lean.run(pixels)[0], model.run(pixels)[0])
    if disagreement:
        log.warning("no maps-free graph for %s %s: its answers differ from the rollout graph's: %s", info.name,
                    info.version, disagreement)
        return None
    return lean.run


def load_openvino_model(settings: Settings, artifact: Artifact | None = None) -> OpenVinoModel:
    return openvino_model(settings, "fp32" if settings.precision_hint == "auto" else settings.precision_hint,
                          artifact=artifact)


def computes_bf16() -> bool:
    """OpenVINO is installed and this CPU computes bfloat16 natively (AVX512-BF16 or AMX), as its CPU plugin says."""
    return available() and "BF16" in cpu_capabilities()


def computes_int8() -> bool:
    """OpenVINO is installed and this CPU multiplies int8 vectors natively (VNNI or AMX): OpenVINO's low-precision
    transformations then run an int8 file's quantize-dequantize layers as integer products."""
    return available() and has_int8_dot_product()


def tuning_candidates(settings: Settings, artifact: Artifact,
                      reference: InferenceModel) -> Iterator[tuple[str, InferenceModel]]:
    """`vitserve tune`'s OpenVINO candidates: fp32, and bf16 where this CPU computes it (or the one the hint names);
    one that will not compile is left out, with a warning."""
    for precision in auto_precisions(settings.precision_hint, cpu_capabilities()):
        try:
            model = openvino_model(settings, precision, None, artifact)
        except ModelLoadError as e:
            log.warning("tuning: OpenVINO %s left out: %s", precision, e)
            continue
        yield candidate_name("openvino", reference.info.precision, precision), model


def candidate_name(runtime: str, file_precision: str, compute_precision: str) -> str:
    """What a candidate computes in: `openvino/fp32`, `openvino/bf16` for a float32 file; an int8 file's layers
    stay int8 whatever the hint, which sets the precision of the rest (`openvino/int8`, `openvino/int8+bf16`)."""
    if file_precision == "fp32" or compute_precision == file_precision:
        return f"{runtime}/{compute_precision}"
    return f"{runtime}/{file_precision}" if compute_precision == "fp32" else \
        f"{runtime}/{file_precision}+{compute_precision}"


OPENVINO = RuntimeSpec("openvino", load_openvino_model, available, computes_bf16, computes_int8, tuning_candidates)
