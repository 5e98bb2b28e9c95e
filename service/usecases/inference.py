"""The use cases of an inference call, whatever transport brought it: each takes the admitted, routed `Call`
(service/usecases/pipeline.py) and the transport's request as typed values, returns a typed result, and records
the stages' metrics and spans.

    classify(call, image, ClassifyOptions) -> ClassifyResponse: decode -> submit to the version's batcher -> top-k, map
    embed(call, image, EmbedOptions)       -> ImageEmbedding: decode -> submit -> the class token's vector, OOD score
    infer(call, ParsedInferRequest, parse_s) -> InferOutcome: an Open Inference Protocol call (HTTP's /v2 or gRPC's,
                                              parsed by service/schemas/inference_protocol.py) -> its outputs by name,
                                              which the transport encodes within `outcome.encoding()`

A transport calls a request's whole work, which runs within the call's deadline (`Call.run`): `infer`, and for
/v1's uploads `classify_image`, `classify_images`, `embed_image`, `embed_images`, where an image of several that
fails (its upload, or its own work) is that image's error in its place, never its neighbours' failure.

The results of classify and embed are the /v1 documents (service/schemas/v1.py): /v1 is their only transport, and
a copy from a dataclass into them would cost every answer an object per field.

An image runs on the version it was routed to, or (unpinned) on the newest ready one if its version was unloaded
meanwhile: the answer names the version that ran it, and so does `call.served`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from vitserve.artifact import EMBEDDING_NAME, OOD_SCORE_NAME, OUTPUT_NAMES, RELEVANCE_NAME, ModelInfo, optional_outputs
from vitserve.service.engine import InferenceResult, ModelHandle
from vitserve.service.engine.budgets import FULL_BUDGET, BudgetAsk, rung_for_tokens
from vitserve.service.ground import tracing
from vitserve.service.ground.errors import InvalidParameter, ServiceError
from vitserve.service.schemas.inference_protocol import ParsedInferRequest
from vitserve.service.schemas.v1 import (
    Budget,
    ClassifyResponse,
    ErrorDetail,
    ErrorResponse,
    ExplainedClass,
    ImageEmbedding,
    MapKind,
    ModelRef,
    OodScore,
    RelevanceGrid,
    RelevanceImage,
    ResizePolicy,
    RolloutFormat,
    RolloutGrid,
    Timing,
)
from vitserve.service.usecases import postprocess
from vitserve.service.usecases.explanations import relevance_target
from vitserve.service.usecases.pipeline import Call
from vitserve.service.usecases.preprocess import PreparedImage
from vitserve.service.usecases.state import ServiceState

log = logging.getLogger("vitserve.inference")

Upload = bytes | ServiceError  # an image as its transport read it, or why it could not be read


@dataclass(frozen=True)
class ClassifyOptions:
    """What a classify call asks for, as plain values (HTTP's query parameters make it:
    service/http/routes/classify.py)."""

    top_k: int = 5
    top_k_asked: bool = False  # the request named its top_k: the answer says when the model has fewer classes
    map: MapKind = "rollout"
    map_format: RolloutFormat = "grid"
    resize: ResizePolicy = "fit"
    target_index: int | None = None  # map=relevance: the class to explain (-1: the top-1)
    max_tokens: int | None = None  # the token budget asked for (None: the full budget; docs/token-budgets.md)
    degrade: bool = True  # False (degrade=never): refused under load rather than answered at a cheaper budget


@dataclass(frozen=True)
class EmbedOptions:
    """What an embed call asks for (HTTP's query parameters make it: service/http/routes/embed.py)."""

    resize: ResizePolicy = "fit"
    normalize: bool = False  # L2-normalise the vector
    max_tokens: int | None = None  # as ClassifyOptions's
    degrade: bool = True


@dataclass
class InferOutcome:
    """What an Open Inference Protocol call computed: each output by name, (B, ...), as the version `info` describes
    (the one that ran its images). The transport encodes `outputs` within `encoding()`, which times and traces it and
    records the call's stage metrics."""

    info: ModelInfo
    outputs: dict[str, np.ndarray]
    record_stages: Callable[[float], None]  # given the encode's seconds
    budget: Budget | None = None  # the token budget its images used (one for all of them)

    @property
    def parameters(self) -> dict:
        """The response's parameters: the token budget used (`budget_reason` only below the full budget)."""
        return {} if self.budget is None else budget_parameters(self.budget)

    @contextmanager
    def encoding(self) -> Iterator[None]:
        started = time.perf_counter()
        with tracing.stage("encode"):
            yield
        self.record_stages(time.perf_counter() - started)


def model_ref(name: str, version: str) -> ModelRef:
    return ModelRef(name=name, version=version)


async def classify(call: Call, image: bytes, options: ClassifyOptions) -> ClassifyResponse:
    """One encoded image -> its top classes and its map."""
    state, target = call.state, options.target_index
    ask = budget_ask(call, options.max_tokens, options.degrade)
    prepared, preprocess_s = await _decode(call, image, options.resize, options.map_format == "overlay")
    result = await submit(call, prepared.pixels, target, maps_free=options.map == "none", alone=call.alone,
                          budget=ask)
    info = answering_info(call, result.version)
    budget = used_budget(call, info, result, prepared.pixels)
    outputs = dict(zip(info.output_names(relevance=target is not None), result.output))
    logits = outputs[OUTPUT_NAMES[0]]
    shown = outputs[RELEVANCE_NAME] if options.map == "relevance" else outputs[OUTPUT_NAMES[1]]
    with tracing.stage("encode"):
        (predictions, map_body), postprocess_s = await _encode(state, info, prepared, logits, shown, options)
    state.metrics.for_model(info.name, info.version).image_stages(preprocess_s, postprocess_s)
    call.stages.append(("postprocess", postprocess_s))
    timing = Timing(queue=_ms(result.queue_s), preprocess=_ms(preprocess_s), inference=_ms(result.inference_s),
                    total=_ms(time.perf_counter() - call.started))
    ood = _ood(state, info, outputs.get(OOD_SCORE_NAME))
    ref = model_ref(info.name, info.version)
    capped = postprocess.top_k_capped(options.top_k, len(info.labels)) if options.top_k_asked else None
    warnings = [capped] if capped else None
    if options.map == "relevance":
        assert target is not None, "the options of a relevance map name its class"
        body = _explained(map_body, info, logits, target)
        return ClassifyResponse(model=ref, predictions=predictions, rollout=None, relevance=body, ood=ood,
                                budget=budget, timing_ms=timing, warnings=warnings)
    return ClassifyResponse(model=ref, predictions=predictions, rollout=map_body, ood=ood, budget=budget,
                            timing_ms=timing, warnings=warnings)


async def classify_image(call: Call, upload: Upload, options: ClassifyOptions) -> ClassifyResponse:
    """One image, within the call's deadline; its error (its upload's, or its own) is the request's."""
    return await call.run(classify(call, _read(upload), options))


async def classify_images(call: Call, uploads: list[Upload],
                          options: ClassifyOptions) -> list[ClassifyResponse | ErrorResponse]:
    """Every image at once, within the call's deadline: each answer, or that image's error, in its place."""
    return await call.run(_each_answer(call.state, uploads, lambda data: classify(call, data, options), "a batch"))


async def embed_image(call: Call, upload: Upload, options: EmbedOptions) -> ImageEmbedding:
    """One image's embedding, within the call's deadline; its error is the request's."""
    return await call.run(embed(call, _read(upload), options))


async def embed_images(call: Call, uploads: list[Upload],
                       options: EmbedOptions) -> list[ImageEmbedding | ErrorResponse]:
    """Every image's embedding at once, within the call's deadline: each, or that image's error, in its place."""
    work = _each_answer(call.state, uploads, lambda data: embed(call, data, options), "an embed request")
    return await call.run(work)


def _read(upload: Upload) -> bytes:
    if isinstance(upload, ServiceError):
        raise upload
    return upload


async def _each_answer(state: ServiceState, uploads: list[Upload], work, what: str) -> list:
    """`work(data)` for every upload at once, each answer in its place: an upload's own error (a read that failed,
    or the work's) becomes its entry in /v1's error shape and is counted, never its neighbours' failure."""
    async def one(upload: Upload):
        try:
            return await work(_read(upload))
        except ServiceError as e:
            error = e
        except Exception as e:  # a bug shows in this image's answer and the log, never in its neighbours'
            log.exception("unexpected error on one file of %s", what)
            error = ServiceError(f"internal error: {type(e).__name__}")
        state.metrics.rejected_request(error.code)
        return ErrorResponse(error=ErrorDetail(code=error.code, message=str(error)))

    return await asyncio.gather(*(one(upload) for upload in uploads))


def check_embeds(handle: ModelHandle) -> None:
    """Refused before the upload is read: a file exported before embeddings existed has no embedding output."""
    if not handle.info.embedding_size:
        raise InvalidParameter(f"{handle.name} {handle.version} has no embedding output: its file was exported "
                               f"before embeddings existed (export it again with vitserve export)")


async def embed(call: Call, image: bytes, options: EmbedOptions) -> ImageEmbedding:
    """One encoded image -> its embedding (the class token before the head; L2-normalised on request) and its OOD
    score, on the fast path (`check_embeds` first)."""
    state = call.state
    ask = budget_ask(call, options.max_tokens, options.degrade)
    prepared, preprocess_s = await _decode(call, image, options.resize, False)
    result = await submit(call, prepared.pixels, None, maps_free=True, alone=call.alone, budget=ask)
    info = answering_info(call, result.version)
    budget = used_budget(call, info, result, prepared.pixels)
    outputs = dict(zip(info.output_names(), result.output))
    vector = outputs[EMBEDDING_NAME].astype(np.float64)
    norm = float(np.linalg.norm(vector))
    if options.normalize and norm > 0:
        vector = vector / norm
    state.metrics.for_model(info.name, info.version).image_stages(preprocess_s, 0.0)
    return ImageEmbedding(embedding=vector.tolist(), norm=norm, ood=_ood(state, info, outputs.get(OOD_SCORE_NAME)),
                          model=model_ref(info.name, info.version), budget=budget)


def _ood(state: ServiceState, info: ModelInfo, score) -> OodScore | None:
    """An image's out-of-distribution score against its model's threshold (the held-out images' 99th percentile,
    fitted at export), observed in the model's drift histogram; None for a file without the score."""
    if score is None or not info.ood:
        return None
    threshold = float(info.ood["threshold"])
    state.metrics.for_model(info.name, info.version).ood_score(float(score) / threshold)
    return OodScore(score=round(float(score), 4), threshold=round(threshold, 4), outside=bool(score > threshold))


async def infer(call: Call, request: ParsedInferRequest, parse_s: float) -> InferOutcome:
    """An Open Inference Protocol call (from /v2 or gRPC) through the routed version's batcher, within the call's
    deadline shortened by the request's own `timeout` parameter; its outputs by name, with the metadata of the
    version that ran it (a request is routed once: its images ran on one version). The call's stage metrics are
    recorded when the transport has encoded them (`InferOutcome.encoding`)."""
    state, handle = call.state, call.handle
    target = relevance_target(request.target, handle.info) if request.explains else None
    extra = handle.info.extra_outputs
    missing = [o.name for o in request.outputs if o.name in optional_outputs() and o.name not in extra]
    if missing:
        outputs = ", ".join(handle.info.output_names(handle.info.explains_classes))
        raise InvalidParameter(f"{handle.name} {handle.version} has no output {missing[0]!r}: its file was exported "
                               f"without it (outputs: {outputs})")
    call.stages.append(("parse", parse_s))
    call.shorten(request.timeout_s)  # the client's own timeout can only make the deadline earlier
    ask = budget_ask(call, request.max_tokens, request.degrade)
    # no outputs named: every output is sent, the rollout too
    maps_free = bool(request.outputs) and not any(o.name == OUTPUT_NAMES[1] for o in request.outputs)
    prepare_s: list[float] = []
    if request.images is not None:
        work = run_encoded_images(call, request.images, request.resize, target, maps_free, prepare_s, ask)
    else:
        assert request.pixels is not None, "a request carries its images or its pixels"
        work = run_pixel_tensors(call, request.pixels, target, maps_free, ask)
    outputs, version, budget = await call.run(work)
    info = answering_info(call, version)
    stages = state.metrics.for_model(info.name, info.version)

    def record_stages(encode_s: float) -> None:
        call.stages.append(("encode", encode_s))
        if request.images is None:
            stages.tensor_stages(request.batch, parse_s, encode_s)
        for seconds in prepare_s:
            stages.image_stages(seconds, encode_s / request.batch)
    return InferOutcome(info, outputs, record_stages, budget)


def budget_ask(call: Call, max_tokens: int | None, degrade: bool) -> BudgetAsk:
    """The budget a request asks of its routed version: the most accurate served rung within `max_tokens`
    (InvalidParameter below the cheapest), and whether load may make it cheaper."""
    if max_tokens is None and degrade:
        return FULL_BUDGET
    return BudgetAsk(rung_for_tokens(call.state.ladder(call.handle.info), max_tokens), degrade)


def used_budget(call: Call, info: ModelInfo, result: InferenceResult, pixels: np.ndarray) -> Budget:
    """The budget an image's answer used, counted in the model's metrics: its rung of the version's ladder, or
    for an image not at the trained size (resize=native) its own grid, which has no cheaper rungs."""
    height, width = pixels.shape[-2:]
    if (height, width) == tuple(info.image_size):
        ladder = call.state.ladder(info)
        rung = ladder[min(result.rung, len(ladder) - 1)]
        budget = Budget(tokens=rung.tokens, full_tokens=ladder[0].tokens, grid=list(rung.grid), reason=result.reason,
                        accuracy=rung.accuracy)
    else:
        tokens = (height // info.patch_size) * (width // info.patch_size)
        budget = Budget(tokens=tokens, full_tokens=tokens, grid=[height, width], reason=None)
    call.state.metrics.for_model(info.name, info.version).budget_answer(budget.tokens, budget.reason, budget.accuracy)
    return budget


def budget_parameters(budget: Budget) -> dict:
    """A budget as Open Inference Protocol response parameters (scalars; the reason only below the full budget)."""
    parameters: dict = {"budget_tokens": budget.tokens, "budget_full_tokens": budget.full_tokens,
                        "budget_grid": "x".join(str(side) for side in budget.grid)}
    if budget.reason is not None:
        parameters["budget_reason"] = budget.reason
    return parameters


def answering_info(call: Call, version: str) -> ModelInfo:
    """The metadata of `version`, the one that ran a call's images: the routed one, unless it was retired
    meanwhile (then the call says so)."""
    handle = call.handle
    if not version or version == handle.version:
        return handle.info
    call.ran_on(handle.name, version)
    return call.state.engine.info(handle.name, version)


def _explained(map_body, info: ModelInfo, logits, target: int) -> RelevanceGrid | RelevanceImage:
    """The relevance map with the class it explains (the top-1 when the client named none)."""
    index = int(logits.argmax()) if target < 0 else target  # the graph's own choice for -1: the arg max
    score = float(info.probabilities(logits)[index])
    explained = ExplainedClass(index=index, label=info.labels[index], score=score)
    kind = RelevanceGrid if isinstance(map_body, RolloutGrid) else RelevanceImage
    return kind(**map_body.model_dump(), target=explained)


async def _encode(state: ServiceState, info: ModelInfo, prepared: PreparedImage, logits, map_values, options):
    args = (info.labels, prepared, logits, map_values, options.top_k, options.map_format,
            info.temperature_for(logits))
    if options.map_format in ("png", "overlay"):  # PNG encoding is real work: keep it off the event loop
        return await state.images.run(postprocess.encode_result, *args)
    started = time.perf_counter()
    return postprocess.encode_result(*args), time.perf_counter() - started


async def run_pixel_tensors(call: Call, pixels: np.ndarray, target: int | None, maps_free: bool = False,
                            budget: BudgetAsk = FULL_BUDGET) -> tuple[dict[str, np.ndarray], str, Budget]:
    """Run every image of the tensor (on the relevance path with a `target`; `maps_free`: the rollout is not
    needed, engine.submit); the first that fails fails the request, named, and the others are dropped. The outputs
    by name, stacked, the version that ran them, and the budget they used (one: `_one_budget`)."""
    return await _run_all(call, list(pixels), target, maps_free, budget)


async def _run_all(call: Call, pixels: list[np.ndarray], target: int | None, maps_free: bool,
                   budget: BudgetAsk) -> tuple[dict[str, np.ndarray], str, Budget]:
    alone = len(pixels) == 1 and call.alone
    results = await _each(pixels, lambda image: submit(call, image, target, maps_free, alone, budget))
    results = await _one_budget(call, pixels, results, target, maps_free)
    outputs, version = _stacked(call, results, target is not None)
    info = answering_info(call, version)
    used = [used_budget(call, info, result, image) for result, image in zip(results, pixels)]
    return outputs, version, used[0]


async def _one_budget(call: Call, pixels: list[np.ndarray], results: list[InferenceResult], target: int | None,
                      maps_free: bool) -> list[InferenceResult]:
    """The results of a tensor's images at one token budget, so that its maps stack: where load split them across
    batches at different budgets (rare: the budget changed between two batches), those that ran dearer run again
    at the cheapest one's."""
    cheapest = max(result.rung for result in results)
    dearer = [i for i, result in enumerate(results) if result.rung != cheapest]
    if not dearer:
        return results
    reason = next(result.reason for result in results if result.rung == cheapest)
    again = await _each([pixels[i] for i in dearer],
                        lambda image: submit(call, image, target, maps_free, False, BudgetAsk(cheapest, False)))
    for i, result in zip(dearer, again):
        result.reason = reason
        results[i] = result
    return results


async def run_encoded_images(call: Call, images: list[bytes], resize: ResizePolicy, target: int | None,
                             maps_free: bool = False, prepare_s: list[float] | None = None,
                             budget: BudgetAsk = FULL_BUDGET) -> tuple[dict[str, np.ndarray], str, Budget]:
    """Decode and prepare every image (as /v1/classify does; each one's seconds appended to `prepare_s`), then run
    them; the first image that fails fails the request, named by its index, and the others' work is cancelled."""
    prepared = await _each(images, lambda data: _decode(call, data, resize, False))
    if prepare_s is not None:
        prepare_s.extend(seconds for _, seconds in prepared)
    shapes = {p.pixels.shape for p, _ in prepared}
    if len(shapes) > 1:
        raise InvalidParameter(f"with parameters.resize=native the images' sizes differ ({sorted(shapes)}), and a "
                               f"tensor must be rectangular: send them in separate requests, or resize=fit")
    return await _run_all(call, [p.pixels for p, _ in prepared], target, maps_free, budget)


async def submit(call: Call, pixels: np.ndarray, target: int | None, maps_free: bool = False,
                 alone: bool = False, budget: BudgetAsk = FULL_BUDGET) -> InferenceResult:
    """One image through the engine (`maps_free`: its answer needs no rollout; `alone`: the only image in flight in
    this process); traced, its queue and inference spans; its stages: the wait in the batch queue (batch assembly
    included), the batch's run, and the rest of the time from submit to answer, the way to the engine and back."""
    submitted_ns, started = tracing.now_ns(), time.perf_counter()
    result = await call.state.engine.submit(call.handle, pixels, call.deadline.remaining(), target, maps_free, alone,
                                            budget)
    waited = time.perf_counter() - started
    call.stages += (("queue", result.queue_s), ("inference", result.inference_s),
                    ("engine_hop", max(0.0, waited - result.queue_s - result.inference_s)))
    tracing.engine_spans(submitted_ns, result)
    return result


async def _decode(call: Call, data: bytes, resize: ResizePolicy, keep_source: bool) -> tuple[PreparedImage, float]:
    """One image decoded and prepared for the routed version; its stages: the work in the pool, and the wait
    around it (the header's read, the pixel budget, the hops to the pool and back)."""
    started, state = time.perf_counter(), call.state
    # The first image of a request alone in its process may be decoded on the event loop (ImagePools): nobody waits
    # behind it there. A request's others decode side by side in the pools, not one after another on the loop.
    call.images_decoded += 1
    inline = call.images_decoded == 1 and call.alone
    with tracing.stage("decode"):
        prepared, preprocess_s = await state.images.preprocess(data, call.handle.info, resize, keep_source, inline)
    call.stages += (("decode", preprocess_s), ("decode_wait", time.perf_counter() - started - preprocess_s))
    return prepared, preprocess_s


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


def _stacked(call: Call, results: list[InferenceResult], explained: bool) -> tuple[dict[str, np.ndarray], str]:
    """The images' outputs by name (logits, rollout, from the relevance path relevance, then the file's optional
    outputs), and the version that ran them (one version: a request is routed once)."""
    version = results[0].version
    names = answering_info(call, version).output_names(relevance=explained)
    return {name: np.stack([r.output[i] for r in results]) for i, name in enumerate(names)}, version


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)
