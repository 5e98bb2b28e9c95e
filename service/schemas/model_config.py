"""How the served model describes itself to Open Inference Protocol clients: the protocol's model metadata, and
Triton's model configuration (`docs/protocol/extension_model_configuration.md`), so that tools written for
Triton (perf_analyzer, model-analyzer, tritonclient's `get_model_config`) read vitserve's real settings.

The service adds one input the ONNX graph does not have, `image` (encoded images, decoded by the server);
a request sends either it or `pixel_values`, so both are optional in the configuration. A model exported with
the relevance path lists a third output, `relevance`, sent only to a request that names it.
"""
from __future__ import annotations

from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES, RELEVANCE_NAME, ModelInfo, optional_outputs_of
from vitserve.service.engine.providers import GPU_PROVIDERS
from vitserve.service.ground.settings import Settings
from vitserve.service.schemas.v2 import IMAGE_INPUT_NAME, ModelMetadata, TensorMetadata

PLATFORM = "onnxruntime_onnx"
# The protocol's extensions vitserve serves, on HTTP and gRPC alike
EXTENSIONS = ["binary_tensor_data", "classification", "model_configuration", "model_repository", "statistics"]


def server_document() -> dict:
    """The protocol's server metadata (GET /v2, gRPC ServerMetadata)."""
    from vitserve import __version__
    return {"name": "vitserve", "version": __version__, "extensions": EXTENSIONS}


def model_metadata(info: ModelInfo, versions: list[str] | None = None) -> ModelMetadata:
    """The protocol's metadata (`versions`: the model's ready versions; default: this one): shapes with the batch
    dimension, -1 where a request chooses."""
    return ModelMetadata(name=info.name, versions=versions or [info.version], platform=PLATFORM,
                         inputs=[TensorMetadata(name=INPUT_NAME, datatype="FP32", shape=[-1, info.channels, -1, -1]),
                                 TensorMetadata(name=IMAGE_INPUT_NAME, datatype="BYTES", shape=[-1, 1])],
                         outputs=[TensorMetadata(name=name, datatype="FP32", shape=[-1, *dims])
                                  for name, dims in _output_dims(info)])


def _output_dims(info: ModelInfo) -> list[tuple[str, list[int]]]:
    """Each output's dims without the batch dimension."""
    maps = [OUTPUT_NAMES[1], *([RELEVANCE_NAME] if info.explains_classes else [])]
    # the optional outputs the file has, as the artifact declares them
    extras = [(output.name, output.dims(info)) for output in optional_outputs_of(info)]
    return [(OUTPUT_NAMES[0], [info.num_classes]), *((name, [-1, -1]) for name in maps), *extras]


def triton_config(info: ModelInfo, settings: Settings, provider: str, version_policy: dict | None = None,
                  serving: dict | None = None, model_filename: str | None = None, budgets: tuple = ()) -> dict:
    """Triton's model configuration as its JSON form: dims without the batch dimension (`max_batch_size` > 0),
    the version policy its model's config.json gives (else Triton's default, the latest one), the dynamic batcher
    as this server runs it, its instances on the execution provider in use: one in an engine process, one per
    HTTP worker inline (each worker's session runs its own batches); how the version is served and why (`serving`:
    its plan, service/engine/serving_plan.py) as string parameters, Triton's only kind; `model_filename`: the
    version's own file's name (default: the settings' model file's); `budgets`: the token budgets it serves, as
    `budget_tokens`, `budget_grids` and `budget_accuracy` (comma-separated, the full budget first; an accuracy not
    measured is null) and `degrade_under_load`."""
    on_gpu = provider in GPU_PROVIDERS
    count = settings.http_workers if settings.engine == "inline" else 1
    instance = {"name": f"{info.name}_0", "kind": "KIND_GPU" if on_gpu else "KIND_CPU", "count": count,
                "gpus": [settings.cuda_device_id] if on_gpu else []}
    return {
        "name": info.name,
        "platform": PLATFORM,
        "backend": "onnxruntime",
        "version_policy": version_policy or {"latest": {"num_versions": 1}},
        "max_batch_size": settings.max_batch_size,
        "input": [
            {"name": INPUT_NAME, "data_type": "TYPE_FP32", "format": "FORMAT_NCHW",
             "dims": [info.channels, -1, -1], "optional": True},
            {"name": IMAGE_INPUT_NAME, "data_type": "TYPE_STRING", "format": "FORMAT_NONE", "dims": [1],
             "optional": True},
        ],
        "output": [{"name": name, "data_type": "TYPE_FP32", "dims": dims} for name, dims in _output_dims(info)],
        "dynamic_batching": {"preferred_batch_size": [settings.max_batch_size],
                             "max_queue_delay_microseconds": round(settings.max_queue_delay_ms * 1000),
                             "preserve_ordering": False},
        "instance_group": [instance],
        "default_model_filename": model_filename or settings.model_path.name,
        "parameters": {"execution_provider": {"string_value": provider},
                       "image_size": {"string_value": "x".join(map(str, info.image_size))},
                       "patch_size": {"string_value": str(info.patch_size)},
                       **plan_parameters(serving or {}), **budget_parameters(budgets, settings)},
        "model_warmup": [],
    }


def budget_parameters(budgets: tuple, settings: Settings) -> dict:
    if not budgets:
        return {}
    rows = {"budget_tokens": [str(r.tokens) for r in budgets],
            "budget_grids": ["x".join(map(str, r.grid)) for r in budgets],
            "budget_accuracy": ["null" if r.accuracy is None else f"{r.accuracy:.4f}" for r in budgets]}
    degrading = settings.degrade_under_load and len(budgets) > 1
    return {**{key: {"string_value": ",".join(values)} for key, values in rows.items()},
            "degrade_under_load": {"string_value": str(degrading).lower()}}


# The plan's fields that /v2 config names, each as the parameter `plan_<field>`
PLAN_PARAMETERS = ("runtime", "precision_hint", "maps_free", "light", "source", "why", "key")


def plan_parameters(serving: dict) -> dict:
    return {f"plan_{name}": {"string_value": str(serving[name]).lower() if isinstance(serving[name], bool)
                             else str(serving[name])} for name in PLAN_PARAMETERS if name in serving}
