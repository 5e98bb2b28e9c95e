"""Export is verified, not trusted: structure, symbolic dims, ONNX Runtime vs PyTorch, rollout and relevance vs NumPy,
the embedding vs PyTorch's class token and the OOD score vs NumPy's.

Every check raises ExportVerificationError with the numbers that failed; the reports carry the
numbers that passed, so the caller can print them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import torch

from vitserve.artifact import (
    EMBEDDING_NAME,
    INPUT_NAME,
    OOD_SCORE_NAME,
    OUTPUT_NAMES,
    RELEVANCE_NAME,
    TARGET_NAME,
    ArtifactError,
    ModelInfo,
    normalize_pixels,
)
from vitserve.export.ood import nearest_class_distance
from vitserve.export.ood_graph import stored_ood_arrays
from vitserve.export.relevance import explain, replacement_relevance
from vitserve.export.rollout import attention_rollout
from vitserve.export.rollout_reference import numpy_attention_rollout


# Every check compares two computations of the same numbers in different orders (ONNX Runtime's kernels against
# PyTorch's, fp16 against fp32), and rounding makes their difference grow with the size of what is compared:
# float32 promises about 1e-7 of a value, not of 1. A fixed absolute tolerance therefore refuses a correct model
# whose logits are large (timm's R26+S/32 with peaky attention differed by 1.1e-4 to 2.4e-4 on logits of
# 32 to 43, and was refused at 1e-4). So each tolerance is `Tolerance.bound`: atol + rtol * the largest |reference|
# of the case. The atol terms are the absolute tolerances these checks had before (they still govern small values);
# rtol sits well above the relative differences measured (float32, on that 12-block hybrid: at most 7.2e-6 of the
# largest |logit|, 1.6e-5 of the largest |relevance|), while a wrong graph (a perturbed weight, a layer missed)
# differs by a sizeable fraction of its values (tests/export/test_verify.py).
@dataclass(frozen=True)
class Tolerance:
    """|actual - reference| may reach atol + rtol * max|reference| over the case.

    The scale is the case's largest |reference|, not each element's (numpy.allclose's): a near-zero logit is a
    difference of large terms, and its rounding error is that of the terms, not of its own small value.
    """

    atol: float
    rtol: float

    def bound(self, reference: np.ndarray) -> float:
        return self.atol + self.rtol * float(np.abs(reference).max(initial=0.0))

    def __str__(self) -> str:
        return f"{self.atol:g} + {self.rtol:g} x max|reference|"


# float32 graph vs PyTorch eager.
LOGITS_TOLERANCE = Tolerance(atol=1e-4, rtol=1e-4)
ROLLOUT_TOLERANCE = Tolerance(atol=1e-5, rtol=1e-4)  # rollout values lie in [0, 1]
# The relevance path vs PyTorch eager and NumPy: its values scale with the logit's gradients, which may be any size,
# so the tolerance is relative alone (measured: 2.5e-6 of the largest |relevance| on the default model, up to
# 1.6e-5 on the hybrid above).
RELEVANCE_TOLERANCE = Tolerance(atol=0.0, rtol=1e-4)
# The embedding (the class token after the final LayerNorm) vs PyTorch eager, at the trained size and twice it: a
# LayerNorm output's scale is its weight's, whatever the image, so the tolerance is relative alone.
EMBEDDING_TOLERANCE = Tolerance(atol=0.0, rtol=1e-5)
# The in-graph OOD score vs NumPy's (float64) from the same embedding output and the file's stored arrays: only
# float32 rounding of one projection and a sum of squares between them.
OOD_SCORE_TOLERANCE = Tolerance(atol=0.0, rtol=1e-4)
# float16 graph vs float32: logits within FP16_LOGITS_RTOL of the largest |logit| (at least 1), rollout within
# FP16_ROLLOUT_TOLERANCE, and the same top-1 class on real photos wherever the float32 top-2 margin exceeds the
# logits tolerance (closer calls are ties that fp16 rounding may legitimately flip). float16 keeps 11 bits, about
# 5e-4 of a value: its relative tolerances are twenty times that.
FP16_LOGITS_RTOL = 1e-2
FP16_ROLLOUT_TOLERANCE = Tolerance(atol=2e-3, rtol=1e-2)
FP16_EMBEDDING_TOLERANCE = Tolerance(atol=0.0, rtol=1e-2)
BATCH_SIZES = (1, 3)


class ExportVerificationError(Exception):
    """The exported graph is malformed, has frozen sizes, or does not compute what the PyTorch model does."""


@dataclass
class CaseResult:
    height: int
    width: int
    batch: int
    logits_max_abs_diff: float  # ONNX Runtime vs PyTorch eager
    rollout_max_abs_diff: float  # ONNX Runtime vs PyTorch eager
    reference_rollout_max_abs_diff: float  # ONNX Runtime vs the NumPy rollout of PyTorch's attention
    logits_bound: float = LOGITS_TOLERANCE.atol  # the tolerance at this case's largest |logit|
    rollout_bound: float = ROLLOUT_TOLERANCE.atol  # ... and at its largest rollout value

    @property
    def tolerance_used(self) -> float:
        """The largest of its differences as a fraction of its tolerance: above 1 fails."""
        return max(self.logits_max_abs_diff / self.logits_bound,
                   max(self.rollout_max_abs_diff, self.reference_rollout_max_abs_diff) / self.rollout_bound)


@dataclass
class VerificationReport:
    cases: list[CaseResult]
    logits_tolerance: Tolerance = LOGITS_TOLERANCE
    rollout_tolerance: Tolerance = ROLLOUT_TOLERANCE

    @property
    def max_logits_diff(self) -> float:
        return max(c.logits_max_abs_diff for c in self.cases)

    @property
    def max_rollout_diff(self) -> float:
        return max(max(c.rollout_max_abs_diff, c.reference_rollout_max_abs_diff) for c in self.cases)

    @property
    def tolerance_used(self) -> float:
        return max(c.tolerance_used for c in self.cases)


@dataclass
class RelevanceCase:
    height: int
    width: int
    batch: int
    targets: list[int]  # the target_class fed, -1 meaning the top-1
    logits_max_abs_diff: float  # the relevance path's logits vs PyTorch eager
    rollout_max_abs_diff: float  # its rollout vs PyTorch eager
    relevance_max_rel_diff: float  # vs PyTorch eager (export.relevance.explain), relative to max |relevance|
    reference_relevance_max_rel_diff: float  # the first image vs the autograd-free rule (0: a case too large for it)
    logits_bound: float = LOGITS_TOLERANCE.atol  # the tolerances at this case's largest |logit| and rollout value
    rollout_bound: float = ROLLOUT_TOLERANCE.atol

    @property
    def tolerance_used(self) -> float:
        """The largest of its differences as a fraction of its tolerance: above 1 fails (relevance's tolerance is
        relative alone, RELEVANCE_TOLERANCE.rtol of the largest |relevance|)."""
        relevance = max(self.relevance_max_rel_diff, self.reference_relevance_max_rel_diff)
        return max(self.logits_max_abs_diff / self.logits_bound, self.rollout_max_abs_diff / self.rollout_bound,
                   relevance / RELEVANCE_TOLERANCE.rtol)


@dataclass
class RelevanceReport:
    cases: list[RelevanceCase]
    relevance_tolerance: Tolerance = RELEVANCE_TOLERANCE

    @property
    def max_relevance_rel_diff(self) -> float:
        return max(max(c.relevance_max_rel_diff, c.reference_relevance_max_rel_diff) for c in self.cases)

    @property
    def tolerance_used(self) -> float:
        return max(c.tolerance_used for c in self.cases)


@dataclass
class Fp16Report:
    logits_max_abs_diff: float  # fp16 graph vs fp32 graph, over random inputs and photos at every size
    rollout_max_abs_diff: float
    logits_tolerance: float
    top1_agreement: float  # fraction of photos whose top-1 class matches fp32's
    photos: int
    ties: int = 0  # photos whose fp32 top-2 margin was within tolerance (not counted against agreement)
    sizes: list[tuple[int, int]] = field(default_factory=list)
    rollout_tolerance: float = FP16_ROLLOUT_TOLERANCE.atol  # FP16_ROLLOUT_TOLERANCE at the largest fp32 rollout value
    embedding_max_abs_diff: float = 0.0
    embedding_tolerance: float = 0.0  # FP16_EMBEDDING_TOLERANCE at the largest |fp32 embedding value|


@dataclass
class OutputCase:
    """One output of one path of the graph at one input, against its reference."""

    height: int
    width: int
    batch: int
    path: str  # "fast" (pixels alone) or "relevance" (target classes fed)
    max_abs_diff: float
    largest: float  # the reference's largest |value|
    bound: float  # the tolerance there

    @property
    def max_rel_diff(self) -> float:
        return self.max_abs_diff / max(self.largest, 1e-30)

    @property
    def tolerance_used(self) -> float:
        return self.max_abs_diff / max(self.bound, 1e-30)


@dataclass
class OutputReport:
    """One output (EMBEDDING_NAME, OOD_SCORE_NAME) checked in every path at every case."""

    output: str
    cases: list[OutputCase]
    tolerance: Tolerance

    @property
    def max_rel_diff(self) -> float:
        return max(c.max_rel_diff for c in self.cases)

    @property
    def tolerance_used(self) -> float:
        return max(c.tolerance_used for c in self.cases)


def verification_sizes(image_size: tuple[int, int], patch: int) -> list[tuple[int, int]]:
    """Trained, larger, smaller and non-square resolutions (multiples of the patch), without repeats."""
    gh, gw = image_size[0] // patch, image_size[1] // patch
    candidates = [(gh, gw), (gh + max(1, gh // 2), gw + max(1, gw // 2)), (max(1, gh // 2), max(1, gw // 2)),
                  (gh + 1, gw + 3) if gh + 1 != gw + 3 else (gh + 2, gw + 3)]
    sizes = []
    for h, w in candidates:
        if (h * patch, w * patch) not in sizes:
            sizes.append((h * patch, w * patch))
    return sizes


def require_symbolic_input(proto: onnx.ModelProto) -> None:
    """Batch, height and width must be three distinct symbols, never fixed numbers."""
    names = [i.name for i in proto.graph.input]
    if names not in ([INPUT_NAME], [INPUT_NAME, TARGET_NAME]):
        raise ExportVerificationError(f"expected the inputs {INPUT_NAME!r} and optionally {TARGET_NAME!r}, got {names}")
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    if len(dims) != 4:
        raise ExportVerificationError(f"input must be 4-D (batch, channels, height, width), got {len(dims)} dims")
    shown = [d.dim_param or d.dim_value for d in dims]
    params = [dims[i].dim_param for i in (0, 2, 3)]
    if not all(params) or any(dims[i].HasField("dim_value") for i in (0, 2, 3)):
        raise ExportVerificationError(f"input dims {shown}: batch, height and width were frozen by the export")
    if len(set(params)) != 3:
        raise ExportVerificationError(f"input dims {shown}: batch, height and width are tied to each other")


def check_graph(model: str | onnx.ModelProto) -> onnx.ModelProto:
    """The ONNX checker (full, with shape inference) and the contract's named symbolic dims."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise ExportVerificationError(f"ONNX checker failed: {e}") from e
    proto = onnx.load(model, load_external_data=False) if isinstance(model, str) else model
    require_symbolic_input(proto)
    named = [d.dim_param or d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    if [named[0], named[2], named[3]] != ["batch", "height", "width"]:
        raise ExportVerificationError(f"input dims are {named}, the contract names them batch, height, width")
    inputs, outputs = [i.name for i in proto.graph.input], [o.name for o in proto.graph.output]
    contracts = ([[INPUT_NAME], list(OUTPUT_NAMES)], [[INPUT_NAME, TARGET_NAME], [*OUTPUT_NAMES, RELEVANCE_NAME]])
    optional = [EMBEDDING_NAME, OOD_SCORE_NAME]  # after the required outputs, in this order where present
    if not any(inputs == i and outputs[:len(o)] == o and outputs[len(o):] == optional[:len(outputs) - len(o)]
               for i, o in contracts):
        raise ExportVerificationError(f"the graph maps {inputs} to {outputs}; the contract says "
                                      f"{' or '.join(f'{i} to {o}' for i, o in contracts)}, then optionally "
                                      f"{optional} in that order")
    return proto


def check_artifact(path: str, metadata: dict[str, str]) -> None:
    """The saved file passes the checker, keeps its symbolic dims and carries exactly the metadata written,
    which a server reads back (`ModelInfo.from_metadata`) to the same values, and has the graph its maps say."""
    proto = check_graph(path)
    stored = {p.key: p.value for p in proto.metadata_props}
    if stored != metadata:
        raise ExportVerificationError(f"metadata did not round-trip: wrote {sorted(metadata)}, read {sorted(stored)}")
    try:
        info = ModelInfo.from_metadata(stored)
    except ArtifactError as e:
        raise ExportVerificationError(f"a server would refuse this file: {e}") from e
    outputs = [o.name for o in proto.graph.output]
    has_relevance = RELEVANCE_NAME in outputs
    if info.explains_classes != has_relevance:
        raise ExportVerificationError(f"the metadata lists the maps {list(info.maps)} but the graph "
                                      f"{'has' if has_relevance else 'lacks'} the relevance output")
    extras = tuple(o for o in outputs if o in (EMBEDDING_NAME, OOD_SCORE_NAME))
    if extras != info.extra_outputs:
        raise ExportVerificationError(f"the metadata describes the optional outputs {list(info.extra_outputs)} "
                                      f"(embedding_size {info.embedding_size}, ood {bool(info.ood)}) but the graph "
                                      f"has {list(extras)}")


def cpu_session(model: str | bytes | onnx.ModelProto, threads: int = 0):
    """An ONNX Runtime CPU session; threads=0 lets ONNX Runtime choose."""
    import onnxruntime as ort

    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


@torch.no_grad()
def torch_outputs(vit, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """PyTorch eager: logits, the torch rollout, and each layer's attention probabilities."""
    patch = vit.cfg.patch_size
    logits, attentions = vit.forward_with_attention(torch.from_numpy(x))
    rollout = attention_rollout(attentions, (x.shape[2] // patch, x.shape[3] // patch))
    return logits.numpy(), rollout.numpy(), [a.numpy() for a in attentions]


def random_pixels(batch: int, channels: int, size: tuple[int, int], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, channels, *size)).astype(np.float32)


def compare_case(session, vit, x: np.ndarray) -> CaseResult:
    logits, rollout = session.run(list(OUTPUT_NAMES), {INPUT_NAME: x})
    ref_logits, ref_rollout, attentions = torch_outputs(vit, x)
    grid = ref_rollout.shape[1:]
    if logits.shape != ref_logits.shape or rollout.shape != ref_rollout.shape:
        raise ExportVerificationError(f"input {x.shape}: ONNX Runtime gave {logits.shape} {rollout.shape}, "
                                      f"PyTorch {ref_logits.shape} {ref_rollout.shape}")
    numpy_rollout = numpy_attention_rollout(attentions, grid)
    return CaseResult(x.shape[2], x.shape[3], x.shape[0], float(np.abs(logits - ref_logits).max()),
                      float(np.abs(rollout - ref_rollout).max()), float(np.abs(rollout - numpy_rollout).max()),
                      LOGITS_TOLERANCE.bound(ref_logits), ROLLOUT_TOLERANCE.bound(ref_rollout))


def verify_against_torch(model: str | bytes | onnx.ModelProto, vit, sizes: list[tuple[int, int]] | None = None,
                         batches: tuple[int, ...] = BATCH_SIZES) -> VerificationReport:
    """ONNX Runtime (CPU) vs PyTorch eager at several resolutions and batch sizes (float32 tolerances)."""
    if isinstance(model, (str, onnx.ModelProto)):
        check_graph(model)
    cfg = vit.cfg
    sizes = sizes or verification_sizes(cfg.image_size, cfg.patch_size)
    session = cpu_session(model)
    cases = [compare_case(session, vit, random_pixels(b, cfg.in_channels, size, seed=i))
             for i, (size, b) in enumerate((s, b) for s in sizes for b in batches)]
    report = VerificationReport(cases)
    bad = [c for c in cases if c.tolerance_used > 1]
    if bad:
        raise ExportVerificationError(f"ONNX Runtime differs from PyTorch beyond logits {LOGITS_TOLERANCE} / "
                                      f"rollout {ROLLOUT_TOLERANCE} (each case's bounds beside its differences): "
                                      f"{bad}")
    return report


def relevance_targets(batch: int, num_classes: int) -> np.ndarray:
    """Per image: the top-1 (-1), then each class in turn, so a batch mixes both kinds of target."""
    return (np.arange(batch) % (num_classes + 1) - 1).astype(np.int64)


REPLACEMENT_MAX_TOKENS = 100  # the autograd-free reference costs a forward pass per token: small cases only


def autograd_free_relevance(vit, x: np.ndarray, targets: np.ndarray) -> np.ndarray | None:
    """The rule without autograd (export.relevance.replacement_relevance: the frozen network is affine, so a
    patch's relevance is the logit's change when its token is replaced), on the first image; None for large cases."""
    grid = (x.shape[2] // vit.cfg.patch_size) * (x.shape[3] // vit.cfg.patch_size)
    if grid + 1 > REPLACEMENT_MAX_TOKENS:
        return None
    return replacement_relevance(vit, torch.from_numpy(x[:1]), torch.from_numpy(targets[:1])).numpy()


def compare_relevance_case(session, vit, x: np.ndarray) -> RelevanceCase:
    targets = relevance_targets(len(x), vit.cfg.num_classes)
    names = [*OUTPUT_NAMES, RELEVANCE_NAME]
    logits, rollout, relevance = session.run(names, {INPUT_NAME: x, TARGET_NAME: targets})
    ref_logits, ref_rollout, ref_relevance = (t.numpy() for t in explain(vit, torch.from_numpy(x),
                                                                         torch.from_numpy(targets)))
    if relevance.shape != ref_relevance.shape or logits.shape != ref_logits.shape:
        raise ExportVerificationError(f"input {x.shape}: the relevance path gave {logits.shape} {relevance.shape}, "
                                      f"PyTorch {ref_logits.shape} {ref_relevance.shape}")
    scale = max(float(np.abs(ref_relevance).max()), 1e-12)
    reference = autograd_free_relevance(vit, x, targets)
    return RelevanceCase(x.shape[2], x.shape[3], x.shape[0], targets.tolist(),
                         float(np.abs(logits - ref_logits).max()), float(np.abs(rollout - ref_rollout).max()),
                         float(np.abs(relevance - ref_relevance).max()) / scale,
                         0.0 if reference is None else float(np.abs(relevance[:1] - reference).max()) / scale,
                         LOGITS_TOLERANCE.bound(ref_logits), ROLLOUT_TOLERANCE.bound(ref_rollout))


def verify_relevance(model: str | bytes | onnx.ModelProto, vit, sizes: list[tuple[int, int]] | None = None,
                     batches: tuple[int, ...] = BATCH_SIZES) -> RelevanceReport:
    """The relevance path (fed target classes) vs PyTorch eager and the autograd-free rule, at several resolutions and
    batch sizes; and the fast path's relevance output empty."""
    cfg = vit.cfg
    sizes = sizes or verification_sizes(cfg.image_size, cfg.patch_size)
    session = cpu_session(model)
    cases = [compare_relevance_case(session, vit, random_pixels(b, cfg.in_channels, size, seed=50 + i))
             for i, (size, b) in enumerate((s, b) for s in sizes for b in batches)]
    report = RelevanceReport(cases)
    bad = [c for c in cases if c.tolerance_used > 1]
    if bad:
        raise ExportVerificationError(f"the relevance path differs from PyTorch beyond logits {LOGITS_TOLERANCE} / "
                                      f"rollout {ROLLOUT_TOLERANCE} / relevance {RELEVANCE_TOLERANCE}: {bad}")
    (fast_relevance,) = session.run([RELEVANCE_NAME], {INPUT_NAME: random_pixels(1, cfg.in_channels,
                                                                                  cfg.image_size, seed=0)})
    if fast_relevance.size:
        raise ExportVerificationError(f"the fast path (no target_class) computed relevance {fast_relevance.shape}")
    return report


def extra_output_sizes(image_size: tuple[int, int]) -> list[tuple[int, int]]:
    """The trained size and twice it: the embedding and the OOD score are checked at both."""
    return [(image_size[0], image_size[1]), (2 * image_size[0], 2 * image_size[1])]


def path_feeds(session, x: np.ndarray, num_classes: int) -> list[tuple[str, dict]]:
    """(path, feeds) for each path the graph has: pixels alone (fast), and with target classes (relevance)."""
    feeds = [("fast", {INPUT_NAME: x})]
    # ONNX Runtime lists an input with a default (the target's, empty) among the overridable initializers
    if TARGET_NAME in {i.name for i in [*session.get_inputs(), *session.get_overridable_initializers()]}:
        feeds.append(("relevance", {INPUT_NAME: x, TARGET_NAME: relevance_targets(len(x), num_classes)}))
    return feeds


def output_case(x: np.ndarray, path: str, actual: np.ndarray, reference: np.ndarray,
                tolerance: Tolerance) -> OutputCase:
    if actual.shape != reference.shape:
        raise ExportVerificationError(f"input {x.shape}, {path} path: an output of shape {actual.shape}, expected "
                                      f"{reference.shape}")
    return OutputCase(x.shape[2], x.shape[3], x.shape[0], path, float(np.abs(actual - reference).max()),
                      float(np.abs(reference).max()), tolerance.bound(reference))


def checked(report: OutputReport, what: str) -> OutputReport:
    bad = [c for c in report.cases if c.tolerance_used > 1]
    if bad:
        raise ExportVerificationError(f"{what} beyond {report.tolerance} (each case's bound beside its difference): "
                                      f"{bad}")
    return report


def verify_embedding(model: str | bytes | onnx.ModelProto, vit,
                     batches: tuple[int, ...] = BATCH_SIZES) -> OutputReport:
    """The embedding output of every path the graph has vs PyTorch's class token after the final LayerNorm
    (`forward_features(x)[0][:, 0]`), at the trained size and twice it."""
    cfg = vit.cfg
    session = cpu_session(model)
    cases = []
    for i, (size, batch) in enumerate((s, b) for s in extra_output_sizes(cfg.image_size) for b in batches):
        x = random_pixels(batch, cfg.in_channels, size, seed=200 + i)
        with torch.no_grad():
            reference = vit.forward_features(torch.from_numpy(x))[0][:, 0].numpy()  # (B, D)
        for path, feeds in path_feeds(session, x, cfg.num_classes):
            (embedding,) = session.run([EMBEDDING_NAME], feeds)
            cases.append(output_case(x, path, embedding, reference, EMBEDDING_TOLERANCE))
    return checked(OutputReport(EMBEDDING_NAME, cases, EMBEDDING_TOLERANCE),
                   "the embedding output differs from PyTorch's class token")


def verify_ood_score(path: str, vit, batches: tuple[int, ...] = BATCH_SIZES) -> OutputReport:
    """The OOD score output of every path the file has vs NumPy's from its embedding output and the arrays the file
    stores (export/ood.py `nearest_class_distance`), at the trained size and twice it."""
    cfg = vit.cfg
    projection, projected_means = stored_ood_arrays(onnx.load(path))
    session = cpu_session(path)
    cases = []
    for i, (size, batch) in enumerate((s, b) for s in extra_output_sizes(cfg.image_size) for b in batches):
        x = random_pixels(batch, cfg.in_channels, size, seed=300 + i)
        for name, feeds in path_feeds(session, x, cfg.num_classes):
            embedding, score = session.run([EMBEDDING_NAME, OOD_SCORE_NAME], feeds)
            reference = nearest_class_distance(embedding, projection, projected_means)
            cases.append(output_case(x, name, score, reference, OOD_SCORE_TOLERANCE))
    return checked(OutputReport(OOD_SCORE_NAME, cases, OOD_SCORE_TOLERANCE),
                   "the in-graph OOD score differs from NumPy's")


# skimage.data images that ship with scikit-image (no download): natural photos, colour and grey.
COLOUR_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina")
GREY_PHOTOS = ("camera", "moon", "coins", "page", "text", "clock", "grass", "gravel", "brick", "cell")


def photo_batch(channels: int, size: tuple[int, int], mean: list[float], std: list[float]) -> np.ndarray:
    """Real photos from scikit-image, centre-cropped and resized (bicubic) and normalised: float32 (17, C, H, W)."""
    try:
        import skimage.data
    except ImportError as e:
        raise ExportVerificationError("fp16 verification uses scikit-image's photos: install scikit-image "
                                      "or export with verify=False / --no-verify") from e
    from PIL import Image, ImageOps

    mode = "L" if channels == 1 else "RGB"
    images = []
    for name in COLOUR_PHOTOS + GREY_PHOTOS:
        im = Image.fromarray(getattr(skimage.data, name)()).convert(mode)
        array = np.asarray(ImageOps.fit(im, (size[1], size[0]), Image.Resampling.BICUBIC))
        images.append(array[None] if channels == 1 else array.transpose(2, 0, 1))
    return normalize_pixels(np.stack(images), mean, std)  # (N, C, H, W)


def verify_fp16(fp16_model: str | bytes | onnx.ModelProto, fp32_model: str | bytes | onnx.ModelProto, vit,
                meta) -> Fp16Report:
    """The fp16 graph against the fp32 one on CPU: random pixels and real photos at every verification size."""
    if isinstance(fp16_model, (str, onnx.ModelProto)):
        check_graph(fp16_model)
    half, full = cpu_session(fp16_model), cpu_session(fp32_model)
    cfg = vit.cfg
    sizes = verification_sizes(cfg.image_size, cfg.patch_size)
    runs = []  # (fp16 logits, fp32 logits, is_photo)
    rollout_diff = rollout_scale = embedding_diff = embedding_scale = 0.0
    names = [*OUTPUT_NAMES, EMBEDDING_NAME]
    for i, size in enumerate(sizes):
        photos = photo_batch(cfg.in_channels, size, meta.mean, meta.std)
        for x, is_photo in ((random_pixels(3, cfg.in_channels, size, seed=100 + i), False), (photos, True)):
            feeds = {INPUT_NAME: x}
            (l16, r16, e16), (l32, r32, e32) = half.run(names, feeds), full.run(names, feeds)
            rollout_diff = max(rollout_diff, float(np.abs(r16 - r32).max()))
            rollout_scale = max(rollout_scale, float(np.abs(r32).max()))
            embedding_diff = max(embedding_diff, float(np.abs(e16 - e32).max()))
            embedding_scale = max(embedding_scale, float(np.abs(e32).max()))
            runs.append((l16, l32, is_photo))
    tolerance = FP16_LOGITS_RTOL * max(1.0, max(float(np.abs(l32).max()) for _, l32, _ in runs))
    logits_diff = max(float(np.abs(l16 - l32).max()) for l16, l32, _ in runs)
    l16, l32 = (np.concatenate([r[k] for r in runs if r[2]]) for k in (0, 1))
    top2 = np.sort(l32, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > tolerance  # photos whose fp32 decision is not a near-tie
    agree = int((l16.argmax(1) == l32.argmax(1))[clear].sum())
    report = Fp16Report(logits_diff, rollout_diff, tolerance, agree / max(1, int(clear.sum())), len(l32),
                        int((~clear).sum()), sizes, FP16_ROLLOUT_TOLERANCE.bound(np.array(rollout_scale)),
                        embedding_diff, FP16_EMBEDDING_TOLERANCE.bound(np.array(embedding_scale)))
    if (logits_diff > tolerance or rollout_diff > report.rollout_tolerance
            or embedding_diff > report.embedding_tolerance or agree != int(clear.sum())):
        raise ExportVerificationError(f"fp16 graph differs from fp32 beyond logits {tolerance:.3g} / rollout "
                                      f"{report.rollout_tolerance:.3g} / embedding {report.embedding_tolerance:.3g} / "
                                      f"top-1 agreement on photos: {report}")
    return report
