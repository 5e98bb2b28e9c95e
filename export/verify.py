"""Export is verified, not trusted: structure, symbolic dims, ONNX Runtime vs PyTorch, rollout vs NumPy.

Every check raises ExportVerificationError with the numbers that failed; the reports carry the
numbers that passed, so the caller can print them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import torch

from export.rollout import attention_rollout
from export.rollout_reference import numpy_attention_rollout
from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES, ArtifactError, ModelInfo, normalize_pixels

# float32 graph vs PyTorch eager (max absolute difference).
LOGITS_ATOL = 1e-4
ROLLOUT_ATOL = 1e-5
# float16 graph vs float32: logits within FP16_LOGITS_RTOL of the largest |logit| (at least 1), rollout
# within FP16_ROLLOUT_ATOL, and the same top-1 class on real photos wherever the float32 top-2 margin
# exceeds the logits tolerance (closer calls are ties that fp16 rounding may legitimately flip).
FP16_LOGITS_RTOL = 1e-2
FP16_ROLLOUT_ATOL = 2e-3
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


@dataclass
class VerificationReport:
    cases: list[CaseResult]
    logits_atol: float = LOGITS_ATOL
    rollout_atol: float = ROLLOUT_ATOL

    @property
    def max_logits_diff(self) -> float:
        return max(c.logits_max_abs_diff for c in self.cases)

    @property
    def max_rollout_diff(self) -> float:
        return max(max(c.rollout_max_abs_diff, c.reference_rollout_max_abs_diff) for c in self.cases)


@dataclass
class Fp16Report:
    logits_max_abs_diff: float  # fp16 graph vs fp32 graph, over random inputs and photos at every size
    rollout_max_abs_diff: float
    logits_tolerance: float
    top1_agreement: float  # fraction of photos whose top-1 class matches fp32's
    photos: int
    ties: int = 0  # photos whose fp32 top-2 margin was within tolerance (not counted against agreement)
    sizes: list[tuple[int, int]] = field(default_factory=list)


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
    if len(proto.graph.input) != 1:
        raise ExportVerificationError(f"expected one graph input, got {[i.name for i in proto.graph.input]}")
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
    if inputs != [INPUT_NAME] or outputs != list(OUTPUT_NAMES):
        raise ExportVerificationError(f"the graph maps {inputs} to {outputs}; the contract says "
                                      f"[{INPUT_NAME!r}] to {list(OUTPUT_NAMES)}")
    return proto


def check_artifact(path: str, metadata: dict[str, str]) -> None:
    """The saved file passes the checker, keeps its symbolic dims and carries exactly the metadata written,
    which a server reads back (`ModelInfo.from_metadata`) to the same values."""
    proto = check_graph(path)
    stored = {p.key: p.value for p in proto.metadata_props}
    if stored != metadata:
        raise ExportVerificationError(f"metadata did not round-trip: wrote {sorted(metadata)}, read {sorted(stored)}")
    try:
        ModelInfo.from_metadata(stored)
    except ArtifactError as e:
        raise ExportVerificationError(f"a server would refuse this file: {e}") from e


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
                      float(np.abs(rollout - ref_rollout).max()), float(np.abs(rollout - numpy_rollout).max()))


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
    bad = [c for c in cases if c.logits_max_abs_diff > LOGITS_ATOL
           or max(c.rollout_max_abs_diff, c.reference_rollout_max_abs_diff) > ROLLOUT_ATOL]
    if bad:
        raise ExportVerificationError(f"ONNX Runtime differs from PyTorch beyond logits {LOGITS_ATOL:g} / "
                                      f"rollout {ROLLOUT_ATOL:g}: {bad}")
    return report


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
    rollout_diff = 0.0
    for i, size in enumerate(sizes):
        photos = photo_batch(cfg.in_channels, size, meta.mean, meta.std)
        for x, is_photo in ((random_pixels(3, cfg.in_channels, size, seed=100 + i), False), (photos, True)):
            (l16, r16), (l32, r32) = half.run(None, {INPUT_NAME: x}), full.run(None, {INPUT_NAME: x})
            rollout_diff = max(rollout_diff, float(np.abs(r16 - r32).max()))
            runs.append((l16, l32, is_photo))
    tolerance = FP16_LOGITS_RTOL * max(1.0, max(float(np.abs(l32).max()) for _, l32, _ in runs))
    logits_diff = max(float(np.abs(l16 - l32).max()) for l16, l32, _ in runs)
    l16, l32 = (np.concatenate([r[k] for r in runs if r[2]]) for k in (0, 1))
    top2 = np.sort(l32, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > tolerance  # photos whose fp32 decision is not a near-tie
    agree = int((l16.argmax(1) == l32.argmax(1))[clear].sum())
    report = Fp16Report(logits_diff, rollout_diff, tolerance, agree / max(1, int(clear.sum())), len(l32),
                        int((~clear).sum()), sizes)
    if logits_diff > tolerance or rollout_diff > FP16_ROLLOUT_ATOL or agree != int(clear.sum()):
        raise ExportVerificationError(f"fp16 graph differs from fp32 beyond logits {tolerance:.3g} / rollout "
                                      f"{FP16_ROLLOUT_ATOL:g} / top-1 agreement on photos: {report}")
    return report
