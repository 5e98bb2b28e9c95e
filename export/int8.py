"""float32 graph -> int8 graph for CPUs, with ONNX Runtime's own quantizer (`onnxruntime.quantization`).

Dynamic quantization: the weights of the Linear layers (MatMul with a constant right-hand side) stored as int8
with a scale per output channel, activations quantized per call from their own range. On a CPU with VNNI the
MatMuls run as MatMulInteger (u8 x s8). Kept in float32:
- the attention MatMuls (query x key, weights x value): both sides are activations, and the attention
  probabilities are what the rollout is made of;
- the patch embedding (a Conv) and the position-embedding interpolation, which take no MatMul;
- the layers named in `keep_float`: measured per model by `vitserve export --precision int8` when the gate asks.

Why dynamic and not static (QDQ, activations calibrated on images): measured on the default model, see
docs/int8.md. The graph's interface stays float32.
"""
from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path

import onnx

LINEAR_OP_TYPES = ["MatMul", "Gemm"]


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


def quantize_int8(proto: onnx.ModelProto, keep_float: list[str] | tuple[str, ...] = ()) -> onnx.ModelProto:
    """An int8 copy of `proto` (dynamic quantization of its Linear layers, per channel), leaving `keep_float`'s
    nodes in float32."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    nodes = [name for name in linear_nodes(proto) if name not in set(keep_float)]
    with tempfile.TemporaryDirectory(prefix="vitserve-int8-") as directory, _without_preprocessing_advice():
        out = Path(directory) / "int8.onnx"
        quantize_dynamic(proto, out, op_types_to_quantize=LINEAR_OP_TYPES, nodes_to_quantize=nodes,
                         per_channel=True, weight_type=QuantType.QInt8,
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
