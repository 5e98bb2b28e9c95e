"""Checkpoint -> ONNX: dynamic batch, height and width, logits, in-graph attention rollout and the embedding (and, in
the same file, the class-specific relevance path: export/relevance_graph.py; with a labelled set, the OOD score:
export/ood_graph.py).

`torch.export.export` runs first, with `Dim` dynamic shapes (height and width as multiples of the
patch), so a violated shape constraint raises here instead of `torch.onnx.export` silently
re-exporting with frozen sizes; the resulting ExportedProgram is what gets converted to ONNX, and
the ONNX input dims are checked to be symbolic before anything is written.
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import torch
from torch import nn
from torch.export import Dim

from vitserve.artifact import (
    EMBEDDING_NAME,
    INPUT_NAME,
    INSPECTION_KEY,
    MAPS,
    OUTPUT_NAMES,
    PRECISIONS,
    RELEVANCE_NAME,
    TARGET_NAME,
    TOP1_TARGET,
    ModelInfo,
    normalize_pixels,
)
from vitserve.budgets import derived_ladder
from vitserve.export.inspection import DEFAULT_IMAGES, inspection_json, inspection_pixels
from vitserve.export.rollout import attention_rollout
from vitserve.export.verify import (
    ExportVerificationError,
    Fp16Report,
    OutputReport,
    RelevanceReport,
    VerificationReport,
    require_symbolic_input,
)
from vitserve.model.checkpoint import CheckpointMeta, load_checkpoint, weights_sha256
from vitserve.model.vit import VisionTransformer

if TYPE_CHECKING:
    from vitserve.export.accuracy_gate import Int8Report
    from vitserve.export.calibration import Calibration
    from vitserve.export.ood import OodScore

MAX_SINGLE_FILE_BYTES = 2**31 - 1  # protobuf's limit; larger models need ONNX external data
FAST_OUTPUTS = (*OUTPUT_NAMES, EMBEDDING_NAME)


class ViTWithRollout(nn.Module):
    """What the artifact's fast path computes: pixels (B, C, H, W) -> (logits (B, K), rollout (B, H/P, W/P),
    embedding (B, D): the class token after the final LayerNorm, what the head reads)."""

    def __init__(self, vit: VisionTransformer):
        super().__init__()
        self.vit = vit

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, attentions = self.vit.forward_features(pixel_values, return_attention=True)  # (B, N, D)
        patch = self.vit.cfg.patch_size
        grid = (pixel_values.shape[-2] // patch, pixel_values.shape[-1] // patch)  # symbolic under export
        return self.vit.forward_head(tokens), attention_rollout(attentions, grid), tokens[:, 0]


@dataclass
class ExportReport:
    path: Path
    precision: str  # "fp32", "fp16" or "int8"
    opset: int
    size_bytes: int
    export_seconds: float
    metadata: dict[str, str]
    verification: VerificationReport | None  # fp32 graph vs PyTorch eager (None with verify=False)
    fp16: Fp16Report | None = None  # fp16 graph vs fp32 (fp16 exports only)
    int8: Int8Report | None = None  # the int8 file's accuracy gate against fp32 (int8 exports only)
    relevance: RelevanceReport | None = None  # the relevance path vs PyTorch and NumPy (with the relevance path)
    calibration: Calibration | None = None  # the fitted temperature and its effect (with a labelled set)
    uncalibrated: str | None = None  # why a labelled set gave no temperature (too few images)
    embedding: OutputReport | None = None  # the embedding output vs PyTorch's class token
    ood: OodScore | None = None  # the OOD score's fit (with a labelled set)
    no_ood: str | None = None  # why a labelled set gave no OOD score (too few images, or of a class)
    ood_verification: OutputReport | None = None  # the in-graph score vs NumPy's from the same embedding


def export_program(module: nn.Module, patch_size: int, example: torch.Tensor,
                   target: torch.Tensor | None = None) -> torch.export.ExportedProgram:
    """torch.export with batch, height = P * gh and width = P * gw all dynamic (and the target's length, the batch,
    when the module takes one); raises if any gets specialised."""
    batch, gh, gw = Dim("batch", min=1), Dim("grid_height", min=1), Dim("grid_width", min=1)
    pixels = {0: batch, 2: patch_size * gh, 3: patch_size * gw}
    args = (example,) if target is None else (example, target)
    shapes = (pixels,) if target is None else (pixels, {0: batch})
    return torch.export.export(module, args, dynamic_shapes=shapes, strict=False)


def example_input(vit: VisionTransformer, batch: int = 2) -> torch.Tensor:
    # Batch 2 and the trained grid: sizes 0 and 1 would be specialised by torch.export.
    channels, (height, width) = vit.cfg.in_channels, vit.cfg.image_size
    return torch.randn(batch, channels, height, width, generator=torch.Generator().manual_seed(0))


def to_onnx(module: nn.Module, patch_size: int, example: torch.Tensor, output_names: tuple[str, ...],
            opset: int | None = None, target: torch.Tensor | None = None) -> onnx.ModelProto:
    """Export `module` (pixels, and a target class per image if given) to an in-memory ONNX model with named
    symbolic dims."""
    args, input_names = ((example,), [INPUT_NAME]) if target is None else ((example, target), [INPUT_NAME, TARGET_NAME])
    with _quiet_exporter():
        program = export_program(module, patch_size, example, target)
        onnx_program = torch.onnx.export(program, args, input_names=input_names, output_names=list(output_names),
                                         opset_version=opset, dynamo=True, optimize=True, verbose=False)
    assert onnx_program is not None  # None is the legacy exporter's (dynamo=False) answer
    proto = onnx_program.model_proto
    require_symbolic_input(proto)
    name_dims(proto, patch_size)
    strip_debug_metadata(proto)
    return proto


@contextlib.contextmanager
def _quiet_exporter():
    """Without the exporter's notes that say nothing about this model: "torchvision is not installed. Skipping
    torchvision::nms" (four of them) and torch's own FutureWarning about its pytree internals."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*treespec, LeafSpec", category=FutureWarning)
            yield
    finally:
        registration.setLevel(level)


def relevance_onnx(vit: VisionTransformer, opset: int | None = None) -> onnx.ModelProto:
    """The relevance path alone (pixels, target class -> logits, rollout, relevance, embedding) as ONNX."""
    from vitserve.export.relevance_graph import BRANCH_OUTPUTS, trace_relevance

    example = example_input(vit)
    target = torch.full((example.shape[0],), TOP1_TARGET, dtype=torch.long)
    return to_onnx(trace_relevance(vit, tracing_example(vit)), vit.cfg.patch_size, example, BRANCH_OUTPUTS, opset,
                   target=target)


def tracing_example(vit: VisionTransformer) -> torch.Tensor:
    """Pixels whose token count differs from every other size the trace sees (batch, width): make_fx gives
    equal input sizes one symbol, and would tie them."""
    cfg = vit.cfg
    gh, gw = cfg.grid_size
    if 1 + gh * (gw + 1) == cfg.embed_dim:
        gh += 1
    return torch.randn(2, cfg.in_channels, gh * cfg.patch_size, (gw + 1) * cfg.patch_size,
                       generator=torch.Generator().manual_seed(0))


def name_dims(proto: onnx.ModelProto, patch_size: int) -> None:
    """Rename the exporter's symbols (s12, 4*s34, ...) to the contract's: batch, height, width, height/P, width/P."""
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    names = {dims[0].dim_param: "batch", dims[2].dim_param: "height", dims[3].dim_param: "width"}
    for output in proto.graph.output:
        if output.name in ("rollout", RELEVANCE_NAME):
            grid = output.type.tensor_type.shape.dim
            names[grid[1].dim_param] = f"height/{patch_size}"
            names[grid[2].dim_param] = f"width/{patch_size}"
    names.pop("", None)
    for value in [*proto.graph.input, *proto.graph.output, *proto.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in names:
                dim.dim_param = names[dim.dim_param]


def artifact_info(meta: CheckpointMeta, vit: VisionTransformer, precision: str, maps: tuple[str, ...]) -> ModelInfo:
    """What the file tells a server about the model (written as `vitserve.*` metadata by `ModelInfo.to_metadata`)."""
    from vitserve import __version__

    cfg = meta.config
    accuracy = meta.metrics.get("test_accuracy")
    return ModelInfo(
        name=meta.name, version=meta.version, labels=list(meta.labels), patch_size=cfg.patch_size,
        image_size=cfg.image_size, channels=cfg.in_channels, mean=list(meta.mean), std=list(meta.std),
        precision=precision, exporter=f"vitserve {__version__}, torch {torch.__version__}, onnx {onnx.__version__}",
        weights_sha256=weights_sha256(vit.state_dict()), architecture=cfg.to_dict(),
        test_accuracy=None if accuracy is None else float(accuracy), maps=maps, embedding_size=cfg.embed_dim)


def strip_debug_metadata(proto: onnx.ModelProto) -> None:
    """Drop the exporter's debugging metadata: per node and value (Python stack traces with this machine's
    absolute paths, FX node dumps) and per graph (the ExportedProgram's signature and range constraints, a set
    printed in hash order, so it changes with PYTHONHASHSEED): the same checkpoint must give the same bytes on
    every machine and in every process. The model's own metadata_props (vitserve.*) are untouched."""
    def strip_graph(graph: onnx.GraphProto) -> None:
        del graph.metadata_props[:]
        for value in [*graph.input, *graph.output, *graph.value_info, *graph.initializer]:
            del value.metadata_props[:]
        for node in graph.node:
            del node.metadata_props[:]
            for attribute in node.attribute:  # only real subgraphs: touching an unset `g` would set it
                subgraphs = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else []
                for subgraph in [*subgraphs, *attribute.graphs]:
                    strip_graph(subgraph)

    strip_graph(proto.graph)
    for function in proto.functions:
        for node in function.node:
            del node.metadata_props[:]


def save_model(proto: onnx.ModelProto, out_path: Path) -> None:
    """One self-contained file; only models past protobuf's 2 GiB limit get a `.data` file beside them."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if proto.ByteSize() < MAX_SINGLE_FILE_BYTES:
        onnx.save_model(proto, str(out_path))
    else:
        onnx.save_model(proto, str(out_path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=out_path.name + ".data")


def export_onnx(checkpoint_dir: str | Path, out_path: str | Path, *, precision: str = "fp32", fp16: bool = False,
                opset: int | None = None, verify: bool = True, relevance: bool = True,
                eval_dir: str | Path | None = None, eval_limit: int | None = None,
                min_agreement: float | None = None, max_accuracy_drop: float | None = None,
                inspection_images: int = DEFAULT_IMAGES, inspection_dir: str | None = None,
                progress=None) -> ExportReport:
    """Export a checkpoint directory to one ONNX file and (by default) prove it right. `progress(text)`, when
    given, hears each step as it starts (the command prints them: an export takes tens of seconds).

    `precision`: fp32; fp16 (for GPUs: export/fp16.py); int8 (for CPUs: export/int8.py), verified by an accuracy
    gate against the float32 graph (export/accuracy_gate.py) on `eval_dir`'s labelled images and on photos.
    Every file outputs the embedding (the class token the head reads). With `eval_dir`, in every precision, the file
    also carries a temperature fitted on half of those images (export/calibration.py): the server's probabilities are
    then calibrated; and the OOD score, fitted on the same half (export/ood.py, computed in the graph:
    export/ood_graph.py), with its threshold taken on the other half.
    `fp16=True` is the older spelling of precision="fp16".

    With `relevance` the file also carries the relevance path (export/relevance_graph.py), in float32 even in a
    float16 or int8 file: its backward pass is where lower precision would cost accuracy, and explanations are not
    the throughput path. With `inspection_images` > 0 the file carries the float32 model's Figure 7 numbers, its
    attention distances over that many images (export/inspection.py; `inspection_dir`'s files if given).
    Raises ExportVerificationError (file left in place for inspection) when verification fails.
    """
    from vitserve.export import verify as checks

    precision = "fp16" if fp16 else precision
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    out_path = Path(out_path)
    say = progress or (lambda text: None)
    started = time.perf_counter()
    vit, meta = load_checkpoint(checkpoint_dir)  # (a bad checkpoint is one error line, before any progress)
    # the labelled set (the temperature, the OOD statistics; int8's scales and gate) is read first: a folder it
    # cannot use is an EvalSetError now, not after a minute
    labelled = _labelled_set(vit, meta, eval_dir, eval_limit)
    say(f"tracing {meta.name} {meta.version} into ONNX (any batch, height and width; position embeddings "
        "interpolated in the graph)")
    fast = to_onnx(ViTWithRollout(vit), vit.cfg.patch_size, example_input(vit), FAST_OUTPUTS, opset)
    proto, explained = fast, None
    fits = LabelledFits() if labelled is None else fit_on_labelled(fast, labelled, meta, say)
    if precision == "fp16":
        from vitserve.export.fp16 import convert_to_fp16

        say("converting to float16")
        proto = convert_to_fp16(fast)
    elif precision == "int8":
        from vitserve.export.int8 import quantize_int8

        batches, labelled, calibrated_on = calibration_split(vit, meta, labelled)
        say(f"quantizing the Linear layers to int8, activation scales calibrated on {calibrated_on}")
        proto = quantize_int8(fast, batches)
    if relevance:
        from vitserve.export.relevance_graph import with_relevance_branch

        say("adding the relevance path (its forward and backward graph)")
        relevance_graph = relevance_onnx(vit, opset)
        proto = with_relevance_branch(proto, relevance_graph)
        if precision == "int8" and verify:
            explained = with_relevance_branch(fast, relevance_graph)  # the float32 artifact the gate compares to
    if fits.ood is not None:
        from vitserve.export.ood_graph import with_ood_score

        proto = with_ood_score(proto, fits.ood)  # after the If: both paths score their own embedding
    info = artifact_info(meta, vit, precision, MAPS if relevance else ("rollout",))
    if fits.calibration is not None:
        info = replace(info, temperature=fits.calibration.temperature, calibration=fits.calibration.summary(),
                       temperature_by_entropy=fits.calibration.curve)
    if fits.ood is not None:
        info = replace(info, ood=fits.ood.summary)
    info = replace(info, budgets=fits.budgets or derived_ladder(info.image_size, info.patch_size, info.architecture))
    metadata = info.to_metadata()
    if inspection_images > 0:
        pixels, source = inspection_pixels(vit, meta, inspection_images, inspection_dir)
        say(f"inspecting the model (the paper's Figure 7): attention distances over {source}")
        metadata[INSPECTION_KEY] = inspection_json(vit, meta, pixels)
    onnx.helper.set_model_props(proto, metadata)
    save_model(proto, out_path)
    export_seconds = time.perf_counter() - started
    opset_used = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    report = ExportReport(out_path, info.precision, opset_used, out_path.stat().st_size, export_seconds, metadata,
                          None, calibration=fits.calibration, uncalibrated=fits.uncalibrated, ood=fits.ood,
                          no_ood=fits.no_ood)
    if verify:
        try:
            say("verifying ONNX Runtime against PyTorch at several sizes")
            float32 = str(out_path) if precision == "fp32" else fast
            report.verification = checks.verify_against_torch(float32, vit)
            report.embedding = checks.verify_embedding(float32, vit)
            if precision == "fp16":
                say("checking the float16 file against float32")
                report.fp16 = checks.verify_fp16(str(out_path), fast, vit, meta)
            if precision == "int8":
                say("the int8 accuracy gate against float32" + (f" on {eval_dir}" if eval_dir else ""))
                report.int8 = _verify_int8(out_path, explained or fast, vit, meta, labelled, min_agreement,
                                           max_accuracy_drop)
            if relevance:
                say("verifying the relevance path against PyTorch")
                report.relevance = checks.verify_relevance(str(out_path), vit)
            if fits.ood is not None:
                say("verifying the in-graph OOD score against NumPy's from the same embeddings")
                report.ood_verification = checks.verify_ood_score(str(out_path), vit)
            checks.check_artifact(str(out_path), metadata)
        except ExportVerificationError as e:
            rejected = out_path.with_name(out_path.name + ".rejected")
            out_path.replace(rejected)  # never leave an unverified model where a server would load it
            raise ExportVerificationError(f"{e} (the rejected model was moved to {rejected})") from e
    return report


@dataclass
class LabelledFits:
    """What a labelled set fitted (export/calibration.py, export/ood.py), or why it could not."""

    calibration: Calibration | None = None
    uncalibrated: str | None = None
    ood: OodScore | None = None
    no_ood: str | None = None
    budgets: tuple = ()  # the token budgets with each one's accuracy (export/budgets.py)


def fit_on_labelled(fast: onnx.ModelProto, labelled, meta: CheckpointMeta, say) -> LabelledFits:
    """The temperature and the OOD statistics, each fitted on the same seeded half of the labelled set, from the
    float32 fast graph's logits and embeddings (through ONNX Runtime, as the server computes them). A set too small
    for one leaves it out, with the reason, and the export goes on (an int8 gate's small set)."""
    from vitserve.export.budgets import ladder_table, measure_ladder
    from vitserve.export.calibration import MIN_IMAGES, calibrate, graph_outputs
    from vitserve.export.ood import OodFitError, fit_ood_score
    from vitserve.export.verify import cpu_session

    fits, count = LabelledFits(), len(labelled.labels)
    logits, embeddings = graph_outputs(cpu_session(fast), labelled.images, list(meta.mean), list(meta.std),
                                       [OUTPUT_NAMES[0], EMBEDDING_NAME])
    if count < MIN_IMAGES:
        fits.uncalibrated = f"not calibrated: {count} labelled images, a temperature needs at least {MIN_IMAGES}"
        say(fits.uncalibrated)
    else:
        say(f"fitting the temperature and the out-of-distribution statistics on half of {count} labelled images")
        fits.calibration = calibrate(logits, labelled.labels, labelled.source)
    try:
        fits.ood = fit_ood_score(embeddings, labelled.labels, list(meta.labels), labelled.source)
    except OodFitError as e:
        fits.no_ood = str(e)
        say(fits.no_ood)
    cfg = meta.config
    ladder = derived_ladder(cfg.image_size, cfg.patch_size, cfg.to_dict())
    say(f"measuring the accuracy of {len(ladder)} token budgets on {count} labelled images")
    fits.budgets = measure_ladder(cpu_session(fast), labelled.images, labelled.labels, list(meta.mean),
                                  list(meta.std), ladder)
    say("token budgets: " + ladder_table(fits.budgets))
    return fits


def _labelled_set(vit: VisionTransformer, meta: CheckpointMeta, eval_dir, eval_limit):
    """`eval_dir`'s labelled images at the model's size and channels, or None without one."""
    from vitserve.export import accuracy_gate as gate

    cfg = vit.cfg
    return None if eval_dir is None else gate.load_labelled_set(eval_dir, list(meta.labels), cfg.in_channels,
                                                                cfg.image_size, eval_limit)


def calibration_split(vit: VisionTransformer, meta: CheckpointMeta, labelled):
    """(calibration batches, the labelled set left for the gate, what calibrated).

    The labelled set's images: CALIBRATION_IMAGES of them chosen by a seeded shuffle and left out of the gate where
    the set can spare them (more than twice as many), else all of it for both. Beside them scikit-image's photos at
    each verification size (export/verify.py): the server takes any size and any picture, and a static scale must
    cover the token counts and the ranges it will meet, or it clips them (calibrated on the labelled set alone, a
    random-weight model's photo agreement fell to 0.93)."""
    from dataclasses import replace

    from vitserve.export.int8 import CALIBRATION_IMAGES
    from vitserve.export.verify import photo_batch, verification_sizes

    cfg = vit.cfg
    photos = [photo_batch(cfg.in_channels, size, list(meta.mean), list(meta.std))
              for size in verification_sizes(cfg.image_size, cfg.patch_size)]
    if labelled is None:
        return photos, None, ("scikit-image's photos at 4 sizes (no --eval set: give one for a file that serves real "
                              "traffic)")
    order = np.random.default_rng(0).permutation(len(labelled.images))
    if len(order) > 2 * CALIBRATION_IMAGES:
        chosen, kept = order[:CALIBRATION_IMAGES], np.sort(order[CALIBRATION_IMAGES:])
        gate = replace(labelled, images=labelled.images[kept], labels=labelled.labels[kept],
                       source=f"{labelled.source}, less the {len(chosen)} calibration images")
        described = f"{len(chosen)} images of {labelled.source} (left out of the gate)"
    else:
        chosen, gate, described = order, labelled, f"all {len(order)} images of {labelled.source} (too few to spare)"
    pixels = normalize_pixels(labelled.images[np.sort(chosen)], list(meta.mean), list(meta.std), channel_axis=1)
    return [np.ascontiguousarray(pixels, np.float32), *photos], gate, described + " and photos at 4 sizes"


def _verify_int8(out_path: Path, fp32: onnx.ModelProto, vit: VisionTransformer, meta: CheckpointMeta, labelled,
                 min_agreement, max_accuracy_drop):
    from vitserve.export import accuracy_gate as gate

    cfg = vit.cfg
    limits = {k: v for k, v in (("min_agreement", min_agreement), ("max_accuracy_drop", max_accuracy_drop))
              if v is not None}
    return gate.verify_int8(str(out_path), fp32, mean=list(meta.mean), std=list(meta.std), channels=cfg.in_channels,
                            image_size=cfg.image_size, patch=cfg.patch_size, labelled=labelled, **limits)
