"""The control plane's use cases, whatever transport asks: the models and versions the server knows and routes to,
a version's metadata, configuration and statistics, its shadow's report, and loading and unloading a model. HTTP's
routes (service/http/routes/) and gRPC's servicer (service/grpc/servicer.py) call these and translate the results
into their protocol; neither reaches the engine itself.

    version(state, name, version)        -> ModelHandle (ModelNotFound, ModelUnavailable: the transport's code)
    card(state, name, version)           -> ModelCard (/v1/model)
    metadata(state, name, version)       -> ModelMetadata (the protocol's document; unversioned: every ready version)
    configuration(state, name, version)  -> Triton's model configuration
    statistics(state, name, version)     -> Triton's statistics of each ready version (no name: every model's)
    is_routed(state, name, version)      -> whether requests for it are routed to a ready version now
    index(state, ready_only)             -> every model and version with its state and reason
    load(state, name), unload(state, name)
    shadow_report(state, name), live_versions(state)
"""
from __future__ import annotations

import asyncio

from vitserve.service.engine import IndexEntry, ModelHandle
from vitserve.service.ground.errors import ServiceError
from vitserve.service.ground.model_names import check_model_name
from vitserve.service.repository.layout import MODEL_FILENAME
from vitserve.service.schemas import paths
from vitserve.service.schemas.model_config import model_metadata, triton_config
from vitserve.service.schemas.statistics import triton_statistics
from vitserve.service.schemas.v1 import ModelCard, TemperatureCurve
from vitserve.service.schemas.v2 import ModelMetadata
from vitserve.service.usecases.state import ServiceState


def version(state: ServiceState, name: str | None, version: str | None = None) -> ModelHandle:
    """The version a request names (no name: the only model; no version: its newest ready one)."""
    return state.engine.route(name, version)


def is_routed(state: ServiceState, name: str, version_name: str | None) -> bool:
    """Whether requests for the model (or the version named) are routed to a ready version now."""
    try:
        state.engine.route(name, version_name)
    except ServiceError:  # not served (unknown, loading, unloaded): not ready, as Triton answers
        return False
    return state.ready


def card(state: ServiceState, name: str | None, version_name: str | None) -> ModelCard:
    """A version's card: what it is, how it was trained and calibrated, and how this server runs it."""
    handle = version(state, name, version_name)
    info, s = handle.info, state.settings.model_copy(update=handle.batching)
    return ModelCard(name=info.name, version=info.version, labels=info.labels, image_height=info.image_size[0],
                     image_width=info.image_size[1], patch_size=info.patch_size, channels=info.channels,
                     mean=info.mean, std=info.std, precision=info.precision, provider=state.engine.provider,
                     opset=info.opset, exporter=info.exporter, weights_sha256=info.weights_sha256,
                     test_accuracy=info.test_accuracy, maps=list(info.maps), max_batch_size=s.max_batch_size,
                     max_native_tokens=s.max_native_tokens, temperature=info.temperature,
                     temperature_by_entropy=None if info.temperature_by_entropy is None
                     else TemperatureCurve(**info.temperature_by_entropy.to_json()),
                     embedding_size=info.embedding_size, ood=info.ood or None,
                     calibration=info.calibration or None, serving=handle.serving,
                     budgets=budget_rows(state, info),
                     degrade_under_load=s.degrade_under_load and len(state.ladder(info)) > 1)


def budget_rows(state: ServiceState, info) -> list[dict]:
    """A version's token budgets as its card lists them: the file's ladder, each marked served or not."""
    served = {rung.tokens for rung in state.ladder(info)}
    return [{**rung.to_json(), "served": rung.tokens in served} for rung in info.ladder]


def live_versions(state: ServiceState) -> set[tuple[str, str]]:
    """The versions loaded now (an unloaded version's metric series are not exported)."""
    return state.engine.live_versions()


def metadata(state: ServiceState, name: str, version_name: str | None) -> ModelMetadata:
    """The protocol's metadata of a version; asked without a version, it lists every ready version of the model."""
    handle = version(state, name, version_name)
    versions = None if version_name else [v for _, v in state.engine.ready_versions(handle.name)]
    return model_metadata(handle.info, versions)


def configuration(state: ServiceState, name: str | None, version_name: str | None) -> dict:
    """Triton's model configuration of a version, with its own batching limits, its model's version policy (its
    config.json) and its own file's name (a repository's version folder holds model.onnx; else `--model`'s)."""
    handle = version(state, name, version_name)
    filename = MODEL_FILENAME if state.settings.model_repository is not None else state.settings.model_path.name
    return triton_config(handle.info, state.settings.model_copy(update=handle.batching), state.engine.provider,
                         handle.version_policy, handle.serving, model_filename=filename,
                         budgets=state.ladder(handle.info))


async def statistics(state: ServiceState, name: str | None, version_name: str | None) -> list[dict]:
    """Triton's statistics, read from the metrics (every process's, as a scrape): of the version named, of every
    ready version of the model named, or (no name) of every ready version of every model."""
    if name:
        handle = version(state, name, version_name)
        pairs = [(handle.name, handle.version)] if version_name else state.engine.ready_versions(handle.name)
    else:
        pairs = sorted(state.engine.ready_versions())
    families = await asyncio.to_thread(state.metrics.families)  # file reads with several processes
    return [triton_statistics(families, model, number, paths.INFERENCE) for model, number in pairs]


async def index(state: ServiceState, ready_only: bool = False) -> list[IndexEntry]:
    return await state.engine.index(ready_only=ready_only)


async def load(state: ServiceState, name: str) -> None:
    """Serve the versions the model's policy names, each warmed up before it is routed to (a failed load leaves
    what was serving)."""
    await state.engine.load(check_model_name(name))


async def unload(state: ServiceState, name: str) -> None:
    """Stop routing to every version of the model, let the admitted requests finish, then free it."""
    await state.engine.unload(check_model_name(name))


async def shadow_report(state: ServiceState, name: str) -> dict:
    return await state.engine.shadow_report(name)
