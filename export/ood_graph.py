"""The OOD score in the artifact's graph: nodes that read the embedding output and write OOD_SCORE_NAME.

They sit in the top-level graph after whatever produces the embedding: the relevance `If` (export/relevance_graph.py),
so both paths get the score from their own embedding, or the fast graph itself in a file without the relevance path.
They are added after any float16 conversion or int8 quantization, so they and their two arrays stay float32 in
every precision. The score, float32 [batch], for the embedding z (B, D) and the stored P (D, r) and M (K, r)
(export/ood.py):

    ood_score = ReduceMin_c ReduceSum_r ((Unsqueeze(z P, 1) - M) ^ 2)        (B, r) -> (B, 1, r) -> (B, K, r)
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from vitserve.artifact import EMBEDDING_NAME, OOD_SCORE_NAME
from vitserve.export.ood import OodScore

PROJECTION = "ood/projection"
PROJECTED_MEANS = "ood/projected_means"


def with_ood_score(model: onnx.ModelProto, ood: OodScore) -> onnx.ModelProto:
    """A copy of `model` that also outputs OOD_SCORE_NAME, after its other outputs."""
    scored = onnx.ModelProto()
    scored.CopyFrom(model)
    graph = scored.graph
    opset = next(o.version for o in scored.opset_import if o.domain in ("", "ai.onnx"))
    graph.initializer.extend([numpy_helper.from_array(np.asarray(ood.projection, np.float32), PROJECTION),
                              numpy_helper.from_array(np.asarray(ood.projected_means, np.float32), PROJECTED_MEANS)])
    graph.node.extend([
        helper.make_node("MatMul", [EMBEDDING_NAME, PROJECTION], ["ood/projected"], name="ood/project"),  # (B, r)
        *_with_axes("Unsqueeze", "ood/projected", [1], "ood/row", opset, since=13),  # (B, 1, r)
        helper.make_node("Sub", ["ood/row", PROJECTED_MEANS], ["ood/difference"], name="ood/difference"),  # (B, K, r)
        helper.make_node("Mul", ["ood/difference", "ood/difference"], ["ood/squared"], name="ood/square"),
        *_with_axes("ReduceSum", "ood/squared", [-1], "ood/distances", opset, since=13, keepdims=0),  # (B, K)
        *_with_axes("ReduceMin", "ood/distances", [1], OOD_SCORE_NAME, opset, since=18, keepdims=0),  # (B,)
    ])
    embedding = next(o for o in graph.output if o.name == EMBEDDING_NAME)
    batch = embedding.type.tensor_type.shape.dim[0]
    graph.output.append(helper.make_tensor_value_info(OOD_SCORE_NAME, TensorProto.FLOAT,
                                                      [batch.dim_param or batch.dim_value]))
    return scored


def _with_axes(op_type: str, data: str, axes: list[int], output: str, opset: int, since: int,
               **attributes) -> list[onnx.NodeProto]:
    """`op_type` over `axes`: an int64 input from opset `since` (Unsqueeze and ReduceSum 13, ReduceMin 18), an
    attribute before it."""
    name = f"ood/{op_type.lower()}"
    if opset < since:
        return [helper.make_node(op_type, [data], [output], name=name, axes=axes, **attributes)]
    constant = helper.make_node("Constant", [], [f"{name}_axes"], name=f"{name}_axes",
                                value=numpy_helper.from_array(np.array(axes, np.int64)))
    return [constant, helper.make_node(op_type, [data, f"{name}_axes"], [output], name=name, **attributes)]


def stored_ood_arrays(model: onnx.ModelProto) -> tuple[np.ndarray, np.ndarray]:
    """(P (D, r), M (K, r)) as the file stores them."""
    stored = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
              if t.name in (PROJECTION, PROJECTED_MEANS)}
    return stored[PROJECTION], stored[PROJECTED_MEANS]
