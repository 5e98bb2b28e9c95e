"""float32 graph -> int8 graph for CPUs, with ONNX Runtime's own quantizer (`onnxruntime.quantization`).

Static quantization (QDQ): the weights of the Linear layers (MatMul with a constant right-hand side) stored as int8
with a scale per output channel, and the activations that feed them quantized with scales **calibrated once**, on
images, and stored in the file. Every image is then computed the same way whatever shares its batch.

Why not dynamic quantization, which needs no images: it quantizes each activation with a scale taken from its
range over the **whole batch** at run time, so an image's answer depends on its batch-mates. Under dynamic
batching that is a correctness defect, not a rounding detail: with the dynamic default model, 2,000 Fashion-MNIST
test images run alone and in batches of 16 random neighbours differed by up to 0.50 in a logit and 7 changed their
top-1 class; the static file's answers do not move (tests/export/test_int8.py, docs/int8.md).

Kept in float32:
- the attention MatMuls (query x key, weights x value): both sides are activations, and the attention
  probabilities are what the rollout is made of;
- the patch embedding (a Conv) and the position-embedding interpolation, which take no MatMul;
- the classifier head, the Linear layer whose output is a graph output (the logits). Its input, the embedding, is a
  graph output too, so ONNX Runtime cannot fuse its quantize-dequantize pairs into an integer Gemm: it ran the head
  in float32 on weights dequantized at every call, with a kernel chosen by the batch's row count, and then rounded
  the logits to the output's int8 steps (0.027 on the default model). An image at a step's edge moved a step with
  its batch size: 2 of 2,000 test images through the server, 4 of 10,000 in-process. In float32 with
  constant weights the head computes each row the same at any batch size, as the float32 file does, for 0.1% of the
  model's multiply-adds;
- the layers named in `keep_float`.
The graph's interface stays float32.
"""
from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path

import numpy as np
import onnx

from vitserve.artifact import INPUT_NAME

LINEAR_OP_TYPES = ["MatMul", "Gemm"]
CALIBRATION_BATCH = 32
CALIBRATION_IMAGES = 512  # of the labelled set, chosen by a seeded shuffle and left out of the accuracy gate


def linear_nodes(proto: onnx.ModelProto) -> list[str]:
    """The MatMul/Gemm nodes whose second input is a weight (an initializer, possibly through a Transpose or a
    Cast of one), in graph order: the Linear layers."""
    constants = {i.name for i in proto.graph.initializer}
    constants |= {o for n in proto.graph.node if n.op_type == "Constant" for o in n.output}
    derived = {o for n in proto.graph.node if n.op_type in ("Transpose", "Cast", "Identity")
               and n.input and n.input[0] in constants for o in n.output}
    weights = constants | derived
    return [n.name for n in proto.graph.node if n.op_type in LINEAR_OP_TYPES and len(n.input) > 1
            and n.input[1] in weights]


def output_linear_nodes(proto: onnx.ModelProto) -> set[str]:
    """The Linear layers whose output is one of the graph's outputs: the classifier head."""
    outputs = {o.name for o in proto.graph.output}
    return {n.name for n in proto.graph.node if n.op_type in LINEAR_OP_TYPES and set(n.output) & outputs}


def quantize_int8(proto: onnx.ModelProto, calibration: np.ndarray | list[np.ndarray],
                  keep_float: list[str] | tuple[str, ...] = ()) -> onnx.ModelProto:
    """An int8 copy of `proto` (static QDQ quantization of its Linear layers, weights per channel, activation scales
    calibrated on `calibration`: normalised pixels (N, C, H, W), or a list of such arrays of different sizes), leaving
    the head (`output_linear_nodes`) and `keep_float`'s nodes in float32."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    groups = [calibration] if isinstance(calibration, np.ndarray) else list(calibration)
    feeds = [{INPUT_NAME: np.ascontiguousarray(group[i:i + CALIBRATION_BATCH], np.float32)}
             for group in groups for i in range(0, len(group), CALIBRATION_BATCH)]
    if not feeds:
        raise ValueError("static int8 quantization needs calibration images")

    class Batches(CalibrationDataReader):
        def __init__(self):
            self.batches = iter(feeds)

        def get_next(self):
            return next(self.batches, None)

    kept = set(keep_float) | output_linear_nodes(proto)
    nodes = [name for name in linear_nodes(proto) if name not in kept]
    with tempfile.TemporaryDirectory(prefix="vitserve-int8-") as directory, _without_preprocessing_advice():
        source, out = Path(directory) / "fp32.onnx", Path(directory) / "int8.onnx"
        onnx.save(proto, str(source))  # the calibrator runs the graph from a file
        quantize_static(str(source), str(out), Batches(), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=LINEAR_OP_TYPES, nodes_to_quantize=nodes, per_channel=True,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                        extra_options={"MatMulConstBOnly": True})
        return onnx.load(str(out))


@contextlib.contextmanager
def _without_preprocessing_advice():
    """The quantizer advises `quant_pre_process` on the root logger on every call. Its symbolic shape inference
    and graph optimization are for static quantization's calibration; the server's session applies ONNX
    Runtime's graph optimizations at load anyway, so the advice is noise here."""
    class Advice(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "pre-processing before quantization" not in record.getMessage()

    advice, root = Advice(), logging.getLogger()
    root.addFilter(advice)
    try:
        yield
    finally:
        root.removeFilter(advice)
