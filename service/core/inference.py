"""The inference core: a request's life, whatever transport brought it. The /v1 and /v2 routes (and a gRPC
front end next) only translate their transport into these calls and the results back.

    route(state, name, version)                  -> the model version to run (404 / 503 when there is none)
    classify_image(state, handle, data, ...)     -> decode -> submit to that version's batcher -> top-k and map
    run_pixel_tensors(state, handle, pixels, ...) -> each image submitted -> the outputs stacked by name
    run_encoded_images(state, handle, images, ...) -> decode each, then as above

Admission (before the body is read) is the dependency `service.core.state.get_admitted_state`; the deadline is the
request's own (`service.core.admission.Deadline`). An image runs on the version it was routed to, or (unpinned) on
the newest ready one if its version was unloaded meanwhile: the answer names the version that ran it.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np

from vitserve.service.ground import tracing
from vitserve.service.core import postprocess
from vitserve.service.ground.deadlines import Deadline
from vitserve.service.engine import InferenceResult, ModelHandle
from vitserve.service.ground.errors import InvalidParameter, ServiceError
from vitserve.service.core.explanations import relevance_target
from vitserve.service.core.preprocess import PreparedImage, ResizePolicy
from vitserve.service.protocols.schemas import (ClassifyResponse, ExplainedClass, ImageEmbedding, ModelRef, OodScore,
                                                RelevanceGrid, RelevanceImage, RolloutGrid, Timing)
from vitserve.service.core.state import INFERENCE_ENDPOINTS, ServiceState
from vitserve.service.protocols.model_config import triton_config
from vitserve.service.protocols.statistics import triton_statistics
from vitserve.artifact import (EMBEDDING_NAME, OOD_SCORE_NAME, OPTIONAL_OUTPUTS, OUTPUT_NAMES, RELEVANCE_NAME,
                               ModelInfo)


def route(state: ServiceState, name: str | None, version: str | None = None, request=None) -> ModelHandle:
    """The version a request for model `name` (None: the only model) runs on; with the transport's request, it is
    remembered there for the request's metrics."""
    handle = state.engine.route(name, version)
    if request is not None:
        request.state.served = (handle.name, handle.version)
    return handle


def model_ref(name: str, version: str) -> ModelRef:
    return ModelRef(name=name, version=version)


async def classify_image(state: ServiceState, handle: ModelHandle, data: bytes, options, started: float,
                         deadline: Deadline) -> ClassifyResponse:
    """One encoded image -> its top classes and its map. `options` has top_k, map, map_format, resize and the
    resolved target_index (service.http.routes.classify.ClassifyParams)."""
    target = options.target_index
    with tracing.stage("decode"):
        prepared, preprocess_s = await state.preprocess(data, handle.info, options.resize,
                                                        options.map_format == "overlay")
    result = await submit(state, handle, prepared.pixels, deadline, target)
    info = answering_info(state, handle, result.version)
    outputs = dict(zip(info.output_names(relevance=target is not None), result.output))
    logits = outputs[OUTPUT_NAMES[0]]
    shown = outputs[RELEVANCE_NAME] if options.map == "relevance" else outputs[OUTPUT_NAMES[1]]
    with tracing.stage("encode"):
        (predictions, map_body), postprocess_s = await _encode(state, info, prepared, logits, shown, options)
    state.metrics.for_model(info.name, info.version).image_stages(preprocess_s, postprocess_s)
    timing = Timing(queue=_ms(result.queue_s), preprocess=_ms(preprocess_s), inference=_ms(result.inference_s),
                    total=_ms(time.perf_counter() - started))
    ood = _ood(state, info, outputs.get(OOD_SCORE_NAME))
    ref = model_ref(info.name, info.version)
    if options.map == "relevance":
        body = _explained(map_body, info, logits, target)
        return ClassifyResponse(model=ref, predictions=predictions, rollout=None, relevance=body, ood=ood,
                                timing_ms=timing)
    return ClassifyResponse(model=ref, predictions=predictions, rollout=map_body, ood=ood, timing_ms=timing)


async def embed_image(state: ServiceState, handle: ModelHandle, data: bytes, resize: ResizePolicy,
                      deadline: Deadline, normalize: bool) -> ImageEmbedding:
    """One encoded image -> its embedding (the class token before the head; L2-normalised on request) and its OOD
    score, on the fast path. The caller checks first that the version's file has the embedding output."""
    with tracing.stage("decode"):
        prepared, preprocess_s = await state.preprocess(data, handle.info, resize, False)
    result = await submit(state, handle, prepared.pixels, deadline, None)
    info = answering_info(state, handle, result.version)
    outputs = dict(zip(info.output_names(), result.output))
    vector = outputs[EMBEDDING_NAME].astype(np.float64)
    norm = float(np.linalg.norm(vector))
    if normalize and norm > 0:
        vector = vector / norm
    state.metrics.for_model(info.name, info.version).image_stages(preprocess_s, 0.0)
    return ImageEmbedding(embedding=vector.tolist(), norm=norm, ood=_ood(state, info, outputs.get(OOD_SCORE_NAME)),
                          model=model_ref(info.name, info.version))


def _ood(state: ServiceState, info: ModelInfo, score) -> OodScore | None:
    """An image's out-of-distribution score against its model's threshold (the held-out images' 99th percentile,
    fitted at export), observed in the model's drift histogram; None for a file without the score."""
    if score is None or not info.ood:
        return None
    threshold = float(info.ood["threshold"])
    state.metrics.for_model(info.name, info.version).ood_score(float(score) / threshold)
    return OodScore(score=round(float(score), 4), threshold=round(threshold, 4), outside=bool(score > threshold))


def protocol_work(state: ServiceState, handle: ModelHandle, call, deadline: Deadline, started: float):
    """An Open Inference Protocol call's work (its images through the version's batcher; `call` a parsed
    service.protocols.inference_protocol.InferCall, from /v2 or gRPC), and the deadline it runs under: the
    request's, shortened by the call's own `timeout` parameter."""
    target = relevance_target(call.target, handle.info) if call.explains else None
    missing = [o.name for o in call.outputs if o.name in OPTIONAL_OUTPUTS and o.name not in handle.info.extra_outputs]
    if missing:
        outputs = ", ".join(handle.info.output_names(handle.info.explains_classes))
        raise InvalidParameter(f"{handle.name} {handle.version} has no output {missing[0]!r}: its file was exported "
                               f"without it (outputs: {outputs})")
    if call.timeout_s is not None:  # the client's own timeout can only make the deadline earlier
        deadline = Deadline(min(deadline.at, started + call.timeout_s))
    if call.images is not None:
        return run_encoded_images(state, handle, call.images, call.resize, deadline, target), deadline
    return run_pixel_tensors(state, handle, call.pixels, deadline, target), deadline


def encode_protocol_answer(state: ServiceState, handle: ModelHandle, call, tensors: dict, parse_s: float, encode):
    """`encode(info)` of a finished protocol call, with `info` the metadata of the version that ran it (a request is
    routed once: its images ran on one version); the call's stage metrics recorded. Returns (info, answer)."""
    info = answering_info(state, handle, tensors["versions"][0])
    encoding = time.perf_counter()
    with tracing.stage("encode"):
        answer = encode(info)
    encode_s = time.perf_counter() - encoding
    stages = state.metrics.for_model(info.name, info.version)
    if call.images is None:
        stages.tensor_stages(call.batch, parse_s, encode_s)
    else:
        for prepare_s in tensors["prepare_s"]:
            stages.image_stages(prepare_s, encode_s / call.batch)
    return info, answer


def model_configuration(state: ServiceState, handle: ModelHandle) -> dict:
    """Triton's model configuration of a routed version, with its own batching limits (its config.json)."""
    return triton_config(handle.info, state.settings.model_copy(update=handle.batching), state.engine.provider)


async def model_statistics(state: ServiceState, versions: list[tuple[str, str]]) -> list[dict]:
    """Triton's statistics of each (model, version), read from the metrics (every process's, as a scrape)."""
    families = await asyncio.to_thread(state.metrics.families)  # file reads with several processes
    return [triton_statistics(families, name, version, INFERENCE_ENDPOINTS) for name, version in versions]


def answering_info(state: ServiceState, handle: ModelHandle, version: str) -> ModelInfo:
    """The metadata of `version`, the one that ran a request's images: the routed one, unless it was retired
    meanwhile."""
    if not version or version == handle.version:
        return handle.info
    return state.engine.info(handle.name, version)


def _explained(map_body, info: ModelInfo, logits, target: int) -> RelevanceGrid | RelevanceImage:
    """The relevance map with the class it explains (the top-1 when the client named none)."""
    index = int(logits.argmax()) if target < 0 else target  # the graph's own choice for -1: the arg max
    score = float(postprocess.softmax(logits, info.temperature)[index])
    explained = ExplainedClass(index=index, label=info.labels[index], score=score)
    kind = RelevanceGrid if isinstance(map_body, RolloutGrid) else RelevanceImage
    return kind(**map_body.model_dump(), target=explained)


async def _encode(state: ServiceState, info: ModelInfo, prepared: PreparedImage, logits, map_values, options):
    args = (info.labels, prepared, logits, map_values, options.top_k, options.map_format, info.temperature)
    if options.map_format in ("png", "overlay"):  # PNG encoding is real work: keep it off the event loop
        return await state.in_pool(postprocess.encode_result, *args)
    started = time.perf_counter()
    return postprocess.encode_result(*args), time.perf_counter() - started


async def run_pixel_tensors(state: ServiceState, handle: ModelHandle, pixels: np.ndarray, deadline: Deadline,
                            target: int | None) -> dict[str, np.ndarray]:
    """Run every image of the tensor (on the relevance path with a `target`); the first that fails fails the
    request, named, and the others are dropped."""
    results = await _each(list(pixels), lambda image: submit(state, handle, image, deadline, target))
    return _stacked(state, handle, results, target is not None)


async def run_encoded_images(state: ServiceState, handle: ModelHandle, images: list[bytes], resize: ResizePolicy,
                             deadline: Deadline, target: int | None) -> dict:
    """Decode and prepare every image (as /v1/classify does), then run them; the first image that fails fails
    the request, named by its index, and the others' work is cancelled."""
    prepared = await _each(images, lambda data: _decode(state, data, handle.info, resize))
    shapes = {p.pixels.shape for p, _ in prepared}
    if len(shapes) > 1:
        raise InvalidParameter(f"with parameters.resize=native the images' sizes differ ({sorted(shapes)}), and a "
                               f"tensor must be rectangular: send them in separate requests, or resize=fit")
    results = await _each([p.pixels for p, _ in prepared],
                          lambda pixels: submit(state, handle, pixels, deadline, target))
    return {**_stacked(state, handle, results, target is not None), "prepare_s": [seconds for _, seconds in prepared]}


async def submit(state: ServiceState, handle: ModelHandle, pixels: np.ndarray, deadline: Deadline,
                 target: int | None) -> InferenceResult:
    """One image through the engine; traced, its queue and inference spans."""
    submitted_ns = tracing.now_ns()
    result = await state.engine.submit(handle, pixels, deadline.remaining(), target)
    tracing.engine_spans(submitted_ns, result)
    return result


async def _decode(state: ServiceState, data: bytes, info: ModelInfo, resize: ResizePolicy):
    with tracing.stage("decode"):
        return await state.preprocess(data, info, resize, keep_source=False)


async def _each(items: list, work) -> list:
    """`work(item)` for every item at once; the first ServiceError (with the item's index) cancels the rest."""
    async def one(index: int, item):
        try:
            return await work(item)
        except ServiceError as e:
            raise type(e)(f"inputs.0 item {index}: {e}") from e

    if len(items) == 1:  # most requests: no task group and no task to make for one item
        return [await one(0, items[0])]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(i, item)) for i, item in enumerate(items)]
    except BaseExceptionGroup as failed:
        raise _first_error(failed) from None
    return [task.result() for task in tasks]


def _first_error(group: BaseExceptionGroup) -> BaseException:
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            error = _first_error(error)
        if isinstance(error, ServiceError):
            return error
    return group.exceptions[0]


def _stacked(state: ServiceState, handle: ModelHandle, results: list[InferenceResult], explained: bool) -> dict:
    """The images' outputs by name (logits, rollout, from the relevance path relevance, then the file's optional
    outputs), and the versions that ran them (one version: a request is routed once)."""
    names = answering_info(state, handle, results[0].version).output_names(relevance=explained)
    stacked = {name: np.stack([r.output[i] for r in results]) for i, name in enumerate(names)}
    return {**stacked, "versions": [r.version for r in results]}


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)
