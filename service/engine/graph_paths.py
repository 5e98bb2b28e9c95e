"""The artifact's two paths as two graphs: the fast path (pixels -> logits, rollout) and the relevance path.

A file with the relevance path is one graph, `If(Size(target_class) > 0)`, whose branches are the relevance graph
and the fast graph (export/relevance_graph.py). One graph keeps the artifact contract simple, but control flow is
what engines take worst: ONNX Runtime's CUDA graphs refuse any graph with an `If`, OpenVINO's ONNX frontend cannot
convert the relevance branch at all, and ORT optimises a branch as a subgraph with shapes it cannot see from
outside. So the server takes the file apart when it loads it: each branch becomes a graph of its own (the outer
inputs and the weights the branches share at its top level), built in memory and handed to the runtime as bytes.
The file on disk stays the one artifact. A file without the `If` (`vitserve export --no-relevance`) is its own fast
graph.

Uses the `onnx` package (protobuf classes and `onnx.helper`), never torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper

from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES, RELEVANCE_NAME, TARGET_NAME, optional_outputs

_GRAPH_ATTRIBUTES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


@dataclass
class ModelPaths:
    fast: onnx.ModelProto  # pixels -> logits, rollout (then embedding, ood_score where the file has them)
    relevance: onnx.ModelProto | None  # pixels, target_class -> logits, rollout, relevance (...); None: no such path
    input_dims: list[str | int]  # the pixel input's dimensions: a name where symbolic (batch, height, width)


def split_paths(model: onnx.ModelProto) -> ModelPaths:
    """The fast and relevance graphs of an artifact (see the module doc); a file without the switch is returned as
    its own fast graph."""
    dims = [d.dim_param or d.dim_value for d in _value(model.graph.input, INPUT_NAME).type.tensor_type.shape.dim]
    switch = _relevance_switch(model.graph)
    if switch is None:
        return ModelPaths(model, None, dims)
    branches = {a.name: a.g for a in switch.attribute}
    present = {o.name for o in model.graph.output}
    extras = tuple(name for name in optional_outputs() if name in present)
    fast = _inline(model, switch, branches["else_branch"], keep=(*OUTPUT_NAMES, *extras))
    relevance = _inline(model, switch, branches["then_branch"], keep=(*OUTPUT_NAMES, RELEVANCE_NAME, *extras))
    return ModelPaths(fast, relevance, dims)


def _relevance_switch(graph: onnx.GraphProto) -> onnx.NodeProto | None:
    """The top-level `If` whose outputs are the artifact's outputs, when its branches can be inlined (no nested
    subgraphs: the exporter refuses them too, export/relevance_graph.py `_copy`)."""
    for node in graph.node:
        if node.op_type == "If" and set(OUTPUT_NAMES) <= set(node.output):
            nested = [n for a in node.attribute for n in a.g.node
                      if any(b.type in _GRAPH_ATTRIBUTES for b in n.attribute)]
            return None if nested else node
    return None


def _inline(model: onnx.ModelProto, switch: onnx.NodeProto, branch: onnx.GraphProto,
            keep: tuple[str, ...]) -> onnx.ModelProto:
    """The outer graph with `switch` replaced by `branch`'s nodes (in its place: outer nodes after the `If`, such as
    the OOD score's, read its outputs), pruned to the outputs named in `keep`."""
    renamed = dict(zip([o.name for o in branch.output], switch.output))  # the branch's outputs take the If's names
    outer = list(model.graph.node)
    at = next(i for i, n in enumerate(outer) if n is switch)
    inlined_nodes = []
    for original in branch.node:
        node = onnx.NodeProto()
        node.CopyFrom(original)
        node.input[:] = [renamed.get(name, name) for name in node.input]
        node.output[:] = [renamed.get(name, name) for name in node.output]
        inlined_nodes.append(node)
    nodes = [*outer[:at], *inlined_nodes, *outer[at + 1:]]
    nodes = _live(nodes, set(keep))
    used = {name for node in nodes for name in node.input}
    inputs = [i for i in model.graph.input if i.name in used]
    # The relevance graph's target is a required input: its empty default only ever selected the fast branch.
    initializers = [t for t in model.graph.initializer if t.name in used and t.name != TARGET_NAME]
    value_info = []
    for original in [*model.graph.value_info, *branch.value_info]:  # copies: `model` is left as it was read
        value = onnx.ValueInfoProto()
        value.CopyFrom(original)
        value.name = renamed.get(value.name, value.name)
        value_info.append(value)
    graph = helper.make_graph(nodes, model.graph.name, inputs, [_value(model.graph.output, n) for n in keep],
                              initializers, value_info=[v for v in value_info if v.name not in keep])
    inlined = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    inlined.producer_name, inlined.producer_version = model.producer_name, model.producer_version
    return inlined


def prune_outputs(model: onnx.ModelProto, drop: set[str]) -> onnx.ModelProto:
    """A copy of `model` without the outputs named in `drop`, and without the nodes and weights nothing else reads."""
    pruned = onnx.ModelProto()
    pruned.CopyFrom(model)
    kept = [o for o in pruned.graph.output if o.name not in drop]
    nodes = _live(list(pruned.graph.node), {o.name for o in kept})
    used = {name for node in nodes for name in node.input}
    initializers = [t for t in pruned.graph.initializer if t.name in used]
    for field, values in ((pruned.graph.output, kept), (pruned.graph.node, nodes),
                          (pruned.graph.initializer, initializers)):
        del field[:]
        field.extend(values)
    return pruned


def _live(nodes: list[onnx.NodeProto], wanted: set[str]) -> list[onnx.NodeProto]:
    """The nodes that the `wanted` values depend on, in their original (topological) order."""
    needed, live = set(wanted), []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            live.append(node)
            needed.update(i for i in node.input if i)
    return live[::-1]


def _value(values, name: str) -> onnx.ValueInfoProto:
    return next(v for v in values if v.name == name)


def symbolic_dims(paths: ModelPaths) -> tuple[str | None, str | None, str | None]:
    """The names of the pixel input's batch, height and width dimensions (None where the file fixes one)."""
    batch, _, height, width = paths.input_dims
    return _dim_name(batch), _dim_name(height), _dim_name(width)


def _dim_name(dim: str | int) -> str | None:
    return dim if isinstance(dim, str) and dim else None

