"""The relevance path of the artifact: traced to plain operations, then joined to the fast graph by one `If`.

Tracing: `torch.export` cannot export a forward that calls `autograd.grad`, so the forward and backward passes
from embedded tokens (and the reference image's tokens, export/relevance.py) to the maps are first traced into
plain aten operations (`make_fx`, symbolic shapes so batch and token count stay dynamic). The patch embedding and
position-embedding resampling stay outside the trace: gradients never reach them, and traced they would decompose
the bicubic Resize into a hundred index operations. The traced module is then exported like the fast model.

Joining: ONNX Runtime runs every node of a graph whatever outputs are asked for (measured: a graph with two
independent chains costs the same for one output as for both), so the two paths cannot simply share a graph. The
artifact's graph is one `If` on whether `target_class` has elements: the else branch is the fast graph (logits,
rollout, embedding; relevance empty), the then branch the relevance graph (logits, rollout, relevance, embedding).
Nodes after the `If` read its outputs whichever branch ran (export/ood_graph.py's score). `target_class` has
an empty default, so a caller that feeds only pixels (any server of format 1) gets the fast path, and the fast
path pays one `If` and nothing of the gradient graph. Weights the branches share are stored once, at the top.
"""
from __future__ import annotations

import hashlib

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from vitserve.artifact import EMBEDDING_NAME, INPUT_NAME, OUTPUT_NAMES, RELEVANCE_NAME, TARGET_NAME
from vitserve.export.relevance import class_token_maps, reference_tokens

BRANCH_OUTPUTS = (*OUTPUT_NAMES, RELEVANCE_NAME, EMBEDDING_NAME)  # each branch's, and the `If`'s, in this order


class ViTWithRelevance(nn.Module):
    """(pixels (B, C, H, W), target (B,) int64) -> logits (B, K), rollout and relevance (B, H/P, W/P), embedding
    (B, D)."""

    def __init__(self, vit, traced_maps: nn.Module):
        super().__init__()
        self.vit, self.traced_maps = vit, traced_maps

    def forward(self, pixel_values: torch.Tensor, target_class: torch.Tensor):
        tokens = self.vit.embed(pixel_values)  # (B, N, D)
        reference = reference_tokens(self.vit, pixel_values)  # (1, N, D): the mean image at this size
        logits, rollout, relevance, embedding = self.traced_maps(tokens, reference, target_class)  # maps (B, N - 1)
        patch = self.vit.cfg.patch_size
        grid = (pixel_values.shape[-2] // patch, pixel_values.shape[-1] // patch)  # symbolic under export
        return logits, rollout.reshape(-1, grid[0], grid[1]), relevance.reshape(-1, grid[0], grid[1]), embedding


def trace_relevance(vit, example_pixels: torch.Tensor) -> ViTWithRelevance:
    """The relevance model with its forward and backward traced to plain operations (dynamic shapes)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    vit = vit.eval()
    tokens = vit.embed(example_pixels).detach()
    reference = reference_tokens(vit, example_pixels)
    target = torch.arange(example_pixels.shape[0], dtype=torch.long) % vit.cfg.num_classes - 1  # -1 and classes
    traced = make_fx(lambda t, r, c: class_token_maps(vit, t, r, c), tracing_mode="symbolic",
                     _allow_non_fake_inputs=True)(tokens, reference, target)  # the parameters stay real tensors
    return ViTWithRelevance(vit, traced)


def with_relevance_branch(fast: onnx.ModelProto, relevance: onnx.ModelProto) -> onnx.ModelProto:
    """One model: If(Size(target_class) > 0) then the relevance graph else the fast graph (see the module doc)."""
    fast, relevance = _copy(fast), _copy(relevance)
    pixels = onnx.ValueInfoProto()
    pixels.CopyFrom(_input(fast, INPUT_NAME))
    outer = {INPUT_NAME, TARGET_NAME}
    _prefix_names(fast.graph, "fast/", outer)
    _prefix_names(relevance.graph, "relevance/", outer)
    shared = _hoist_initializers([fast.graph, relevance.graph])
    empty = numpy_helper.from_array(np.zeros((0, 0, 0), np.float32), "fast/relevance")
    fast.graph.node.append(helper.make_node("Constant", [], ["fast/relevance"], value=empty))
    fast.graph.output.append(helper.make_tensor_value_info("fast/relevance", TensorProto.FLOAT, [0, 0, 0]))
    _order_outputs(fast.graph, [f"fast/{name}" for name in BRANCH_OUTPUTS])  # a branch's outputs are the If's
    for branch in (fast.graph, relevance.graph):
        del branch.input[:]  # a branch reads the outer graph's inputs by name
    no_target = numpy_helper.from_array(np.zeros((0,), np.int64), TARGET_NAME)
    zero = numpy_helper.from_array(np.array(0, np.int64), "zero")
    nodes = [helper.make_node("Size", [TARGET_NAME], ["target_count"]),
             helper.make_node("Constant", [], ["zero"], value=zero),
             helper.make_node("Greater", ["target_count", "zero"], ["relevance_requested"]),
             helper.make_node("If", ["relevance_requested"], list(BRANCH_OUTPUTS), name="relevance_or_fast",
                              then_branch=relevance.graph, else_branch=fast.graph)]
    outputs = [_output(fast, f"fast/{name}", name) for name in OUTPUT_NAMES]
    outputs.append(helper.make_tensor_value_info(RELEVANCE_NAME, TensorProto.FLOAT,
                                                 ["explained", "explained_height", "explained_width"]))
    outputs.append(_output(fast, f"fast/{EMBEDDING_NAME}", EMBEDDING_NAME))
    graph = helper.make_graph(nodes, fast.graph.name or "vit", [pixels, _target_input()], outputs,
                              [*shared, no_target])
    opsets = {o.domain: o.version for o in [*relevance.opset_import, *fast.opset_import]}
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()],
                              ir_version=max(fast.ir_version, 4))  # IR 4: an input's initializer is its default
    model.producer_name, model.producer_version = fast.producer_name, fast.producer_version
    return model


def _copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    nested = [n.name for n in copy.graph.node if any(a.type in (a.GRAPH, a.GRAPHS) for a in n.attribute)]
    if copy.functions or nested:  # their names would need renaming too
        raise ValueError(f"the exported graph has local functions or subgraphs ({nested}); joining them is not "
                         f"supported")
    return copy


def _input(model: onnx.ModelProto, name: str) -> onnx.ValueInfoProto:
    return next(i for i in model.graph.input if i.name == name)


def _output(model: onnx.ModelProto, branch_name: str, name: str) -> onnx.ValueInfoProto:
    value = onnx.ValueInfoProto()
    value.CopyFrom(next(o for o in model.graph.output if o.name == branch_name))
    value.name = name
    return value


def _order_outputs(graph: onnx.GraphProto, names: list[str]) -> None:
    by_name = {o.name: o for o in graph.output}
    ordered = [onnx.ValueInfoProto() for _ in names]
    for value, name in zip(ordered, names):
        value.CopyFrom(by_name[name])
    del graph.output[:]
    graph.output.extend(ordered)


def _target_input() -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(TARGET_NAME, TensorProto.INT64, ["targets"])


def _prefix_names(graph: onnx.GraphProto, prefix: str, keep: set[str]) -> None:
    """Give every value and node of a branch a prefix, so the two branches' names cannot clash."""
    def rename(name: str) -> str:
        return name if not name or name in keep else prefix + name

    for node in graph.node:
        node.input[:] = [rename(i) for i in node.input]
        node.output[:] = [rename(o) for o in node.output]
        node.name = prefix + node.name
    for value in [*graph.input, *graph.output, *graph.value_info, *graph.initializer]:
        value.name = rename(value.name)


def _hoist_initializers(graphs: list[onnx.GraphProto]) -> list[onnx.TensorProto]:
    """Move the branches' initializers to the outer graph, one copy of each distinct tensor (by dtype, shape and
    bytes), and point the branches' nodes at it."""
    kept: dict[tuple, onnx.TensorProto] = {}
    for graph in graphs:
        renamed = {}
        for tensor in graph.initializer:
            digest = hashlib.sha256(numpy_helper.to_array(tensor).tobytes()).hexdigest()
            key = (tensor.data_type, tuple(tensor.dims), digest)
            if key not in kept:
                kept[key] = onnx.TensorProto()
                kept[key].CopyFrom(tensor)
            renamed[tensor.name] = kept[key].name
        for node in graph.node:
            node.input[:] = [renamed.get(i, i) for i in node.input]
        del graph.initializer[:]
    return list(kept.values())
