"""float32 graph -> float16 graph for GPU serving, with float32 inputs, outputs and interpolation.

Uses ONNX Runtime's own converter (`onnxruntime.transformers.float16`, the maintained copy of
onnxconverter-common's): keep_io_types leaves the contract's float32 interface, and the nodes that
feed the position-embedding Resize from the stored embeddings, plus the Resize itself, stay
float32 so the interpolation matches the fp32 model's. This artifact is for CUDA: on the CPU provider
float16 buys nothing (the default Fashion-MNIST model measured about as fast as float32 here, within
noise) and CPUs without native float16 arithmetic are slower; serve the float32 file on CPU.
"""
from __future__ import annotations

import onnx


def input_independent_ancestors(proto: onnx.ModelProto, node: onnx.NodeProto) -> list[str]:
    """Names of the nodes that feed `node` and do not depend on any graph input (constant subgraphs)."""
    producers = {out: n for n in proto.graph.node for out in n.output}
    graph_inputs = {i.name for i in proto.graph.input}
    dynamic: set[str] = set(graph_inputs)
    for n in proto.graph.node:  # the exporter writes nodes in topological order
        if any(i in dynamic for i in n.input):
            dynamic.update(n.output)
    found, stack = [], [i for i in node.input if i]
    while stack:
        producer = producers.get(stack.pop())
        if producer is None or producer.name in found or any(o in dynamic for o in producer.output):
            continue
        found.append(producer.name)
        stack.extend(i for i in producer.input if i)
    return found


def convert_to_fp16(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A float16 copy of `proto`; the position-embedding interpolation and the interface stay float32."""
    import onnx_ir as ir
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    resizes = [n for n in proto.graph.node if n.op_type == "Resize"]
    keep = [name for n in resizes for name in [n.name, *input_independent_ancestors(proto, n)]]
    half = convert_float_to_float16(proto, keep_io_types=True, op_block_list=list(DEFAULT_OP_BLOCK_LIST) + ["Resize"],
                                    node_block_list=keep)
    del half.graph.value_info[:]  # the converter leaves stale float32 value_info behind
    model = ir.from_proto(half)
    model.graph.sort()  # the converter appends its input Casts at the end of the node list
    # Inferred again here, where every initializer's value is in scope: once the graph is a branch of the relevance
    # `If`, ONNX's inference no longer reads the outer scope's constants (a Pad's pads, a Reshape's shape), loses a
    # hybrid backbone's rank, and fails the position-embedding Resize, whose sizes come from the feature map's shape.
    return onnx.shape_inference.infer_shapes(ir.to_proto(model), strict_mode=True, data_prop=True)
