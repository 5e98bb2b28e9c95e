"""The maps-free graph: the fast graph without the rollout, its attention fused into one operator per block.

The rollout needs every block's attention probabilities, so the fast graph computes attention the long way:
`softmax((q * scale) @ k^T) @ v`, a (batch, heads, tokens, tokens) tensor written, read and written again per block.
A request that asks for no map needs none of that. Without the rollout output the probabilities have one reader
each (the product with v), and the whole pattern is ONNX Runtime's `com.microsoft.MultiHeadAttention`, which on a
GPU runs flash or memory-efficient attention in float16 (the probabilities never reach memory) and on a CPU a fused
kernel. ONNX Runtime's own transformer optimizer (`onnxruntime.transformers.optimizer`, model type "vit") finds
none of the attention in this exporter's graphs: its patterns are torch.onnx's older output, with q, k and v from
three Linear layers, so the rewrite is done here, on the exporter's one pattern:

    qkv = Add(MatMul(x, W), b)                           (batch, tokens, 3 * dim)
    Reshape(qkv, [batch, tokens, 3, heads, head_dim]) -> Transpose(perm 2,0,3,1,4)
    q, k, v = Squeeze(Slice(., i:i+1, axis 0)) for i in 0, 1, 2
    Softmax(MatMul(Mul(q, scale), Transpose(k, perm 0,1,3,2))) -> MatMul(., v)
    Transpose(perm 0,2,1,3) -> Reshape([batch, tokens, dim])

becomes `MultiHeadAttention(Split(qkv, 3, axis -1), num_heads=heads, scale=scale)`, whose output is the final
Reshape's. A block whose graph differs in any detail is left as it is (the rewrite is an optimisation, never a
requirement), and the caller checks the fused graph's answers against the unfused one's before serving it.

Uses the `onnx` package only, never torch.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from vitserve.service.engine.graph_paths import prune_outputs

MS_DOMAIN = "com.microsoft"


def maps_free(fast: onnx.ModelProto, map_outputs: tuple[str, ...]) -> onnx.ModelProto:
    """`fast` without the outputs in `map_outputs` and the nodes only they needed, its attention fused."""
    pruned = prune_outputs(fast, set(map_outputs))
    return fuse_attention(pruned)


def fuse_attention(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with each recognised self-attention replaced by one MultiHeadAttention (module doc); the
    graph is returned unchanged where nothing matches."""
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    constants = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None:
                constants[node.output[0]] = value
    outputs = {o.name for o in graph.output}

    replaced: dict[str, list[onnx.NodeProto]] = {}  # the block's last value -> the nodes that now make it
    new_initializers: list[onnx.TensorProto] = []
    for softmax in graph.node:
        if softmax.op_type != "Softmax":
            continue
        match = _match(softmax, producer, readers, constants, outputs)
        if match is None:
            continue
        qkv, heads, scale, final_reshape, dim = match
        index = len(replaced)
        split_sizes = f"fused_attention_{index}/split_sizes"
        new_initializers.append(numpy_helper.from_array(np.array([dim, dim, dim], dtype=np.int64), split_sizes))
        q, k, v = (f"fused_attention_{index}/{part}" for part in "qkv")
        split = helper.make_node("Split", [qkv, split_sizes], [q, k, v], axis=-1,
                                 name=f"fused_attention_{index}/Split")
        attention = helper.make_node("MultiHeadAttention", [q, k, v], [final_reshape.output[0]], domain=MS_DOMAIN,
                                     num_heads=heads, scale=scale, name=f"fused_attention_{index}/MultiHeadAttention")
        replaced[final_reshape.output[0]] = [split, attention]  # in the final Reshape's place
    if not replaced:
        return model

    nodes: list[onnx.NodeProto] = []
    for node in graph.node:  # a value has one producer: the final Reshape is the only node to swap for its block's
        nodes.extend(replaced.get(node.output[0], [node]) if node.output else [node])
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    del fused.graph.node[:]
    fused.graph.node.extend(nodes)
    fused.graph.initializer.extend(new_initializers)
    fused = prune_outputs(fused, set())  # the long way's nodes, now read by nothing
    if not any(o.domain == MS_DOMAIN for o in fused.opset_import):
        fused.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return fused


def count_fused(model: onnx.ModelProto) -> int:
    return sum(1 for n in model.graph.node if n.op_type == "MultiHeadAttention" and n.domain == MS_DOMAIN)


def _match(softmax, producer, readers, constants, outputs):
    """(qkv name, heads, scale, final Reshape node, model dim) when `softmax` sits in the module doc's pattern."""
    def only_reader(name: str, op_type: str):
        found = readers.get(name, [])
        if len(found) != 1 or found[0].op_type != op_type or name in outputs:
            return None
        return found[0]

    def made_by(name: str, op_type: str):
        node = producer.get(name)
        return node if node is not None and node.op_type == op_type else None

    def attribute(node, name, default=None):
        return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)

    def constant(name: str):
        tensor = constants.get(name)
        return None if tensor is None else numpy_helper.to_array(tensor)

    if attribute(softmax, "axis", -1) not in (-1, 3):
        return None
    scores = made_by(softmax.input[0], "MatMul")
    context = only_reader(softmax.output[0], "MatMul")
    if scores is None or context is None or context.input[0] != softmax.output[0]:
        return None
    scaled_q, k_t = made_by(scores.input[0], "Mul"), made_by(scores.input[1], "Transpose")
    if scaled_q is None or k_t is None or list(attribute(k_t, "perm", [])) != [0, 1, 3, 2]:
        return None
    scale_value = constant(scaled_q.input[1])
    if scale_value is None or scale_value.size != 1:
        return None
    picks = [scaled_q.input[0], k_t.input[0], context.input[1]]  # q, k, v
    packed = None
    for part, name in enumerate(picks):
        squeeze = made_by(name, "Squeeze")
        slice_ = made_by(squeeze.input[0], "Slice") if squeeze is not None else None
        if slice_ is None or len(slice_.input) < 4:
            return None
        starts, ends, axes = (constant(n) for n in slice_.input[1:4])
        squeeze_axes = constant(squeeze.input[1]) if len(squeeze.input) > 1 else attribute(squeeze, "axes")
        if starts is None or ends is None or axes is None or squeeze_axes is None:
            return None
        if (int(np.ravel(starts)[0]), int(np.ravel(ends)[0]), int(np.ravel(axes)[0])) != (part, part + 1, 0) \
                or list(np.ravel(squeeze_axes)) != [0]:
            return None
        if packed is None:
            packed = slice_.input[0]
        elif slice_.input[0] != packed:
            return None
    permute = made_by(packed, "Transpose")
    if permute is None or list(attribute(permute, "perm", [])) != [2, 0, 3, 1, 4]:
        return None
    split_heads = made_by(permute.input[0], "Reshape")
    if split_heads is None:
        return None
    shape = _shape_parts(split_heads.input[1], producer, constants)
    if shape is None or len(shape) != 5 or shape[2] != 3 or shape[3] is None or shape[4] is None:
        return None
    heads, head_dim = shape[3], shape[4]
    merge = only_reader(context.output[0], "Transpose")
    if merge is None or list(attribute(merge, "perm", [])) != [0, 2, 1, 3]:
        return None
    final_reshape = only_reader(merge.output[0], "Reshape")
    if final_reshape is None:
        return None
    return split_heads.input[0], heads, float(np.ravel(scale_value)[0]), final_reshape, heads * head_dim


def _shape_parts(name: str, producer, constants) -> list[int | None] | None:
    """The entries of a Reshape's target shape: a constant, or a Concat of one-element pieces (None where a piece
    is computed at run time, such as the batch size)."""
    tensor = constants.get(name)
    if tensor is not None:
        return [int(v) for v in numpy_helper.to_array(tensor).ravel()]
    concat = producer.get(name)
    if concat is None or concat.op_type != "Concat":
        return None
    parts: list[int | None] = []
    for piece in concat.input:
        value = constants.get(piece)
        if value is None:
            parts.append(None)
            continue
        array = numpy_helper.to_array(value).ravel()
        if array.size != 1:
            return None
        parts.append(int(array[0]))
    return parts
