"""Verification's tolerances scale with what they compare: a correct model with large logits passes, a wrong graph
still fails (a hybrid with logits of 32-43 differed by up to 2.4e-4 and was refused at an absolute 1e-4)."""
from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from vitserve.export.verify import (LOGITS_TOLERANCE, ExportVerificationError, Tolerance, verify_against_torch,
                           verify_relevance)

SCALE = 100.0


def scaled_head(proto: onnx.ModelProto, vit, factor: float):
    """The exported graph and its PyTorch model with the head's weight times `factor` in both (the ONNX file holds
    it twice: the fast path's, and the relevance path's transposed copy), so logits are `factor` times larger
    without tracing again."""
    proto, vit = copy.deepcopy(proto), copy.deepcopy(vit)
    weight = vit.head.weight.detach().numpy()
    copies = [t for t in proto.graph.initializer
              if np.array_equal(numpy_helper.to_array(t), weight) or np.array_equal(numpy_helper.to_array(t), weight.T)]
    assert len(copies) == 2
    for tensor in copies:
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) * np.float32(factor), tensor.name))
    with torch.no_grad():
        vit.head.weight.mul_(factor)
        vit.head.bias.mul_(factor)
    return proto, vit


@pytest.fixture(scope="module")
def large_logits(tiny_export, tiny_model):
    return scaled_head(onnx.load(str(tiny_export.path)), tiny_model, SCALE)


def test_tolerance_bound_grows_with_the_largest_reference_value():
    tolerance = Tolerance(atol=1e-4, rtol=1e-3)
    assert tolerance.bound(np.array([0.0, 0.0])) == pytest.approx(1e-4)
    assert tolerance.bound(np.array([[2.0, -50.0], [3.0, 1.0]])) == pytest.approx(1e-4 + 5e-2)


def test_a_correct_model_with_large_logits_verifies(large_logits):
    proto, vit = large_logits
    report = verify_against_torch(proto, vit)
    # The float32 differences grow with the logits: beyond the absolute 1e-4 that refused the hybrid, well
    # within the scaled tolerance of every case.
    assert report.max_logits_diff > LOGITS_TOLERANCE.atol
    assert report.tolerance_used < 0.1
    assert all(c.logits_bound > 10 * LOGITS_TOLERANCE.atol for c in report.cases)
    relevance = verify_relevance(proto.SerializeToString(), vit)
    assert max(c.logits_max_abs_diff for c in relevance.cases) > LOGITS_TOLERANCE.atol
    assert relevance.tolerance_used < 0.1


def test_a_perturbed_weight_is_refused_at_large_logits_too(large_logits):
    proto, vit = copy.deepcopy(large_logits[0]), large_logits[1]
    # tests/export/test_onnx_export.py refuses 1e-2 added to one head weight of the plain model: the same relative
    # change here, where the weights are SCALE times larger
    head = next(t for t in proto.graph.initializer if list(t.dims) == [3, 32])
    values = numpy_helper.to_array(head).copy()
    values[0, 0] += 1e-2 * SCALE
    head.CopyFrom(numpy_helper.from_array(values, head.name))
    with pytest.raises(ExportVerificationError, match="differs from PyTorch"):
        verify_against_torch(proto, vit)


def test_a_perturbed_block_weight_is_refused_at_large_logits(large_logits):
    """A change inside the first block, which the head's scale does not magnify: 1e-2 on one query's bias still
    moves the logits several times beyond the scaled tolerance."""
    proto, vit = copy.deepcopy(large_logits[0]), large_logits[1]
    tensor = next(t for t in proto.graph.initializer if t.name.endswith("blocks.0.attn.qkv.bias"))
    values = numpy_helper.to_array(tensor).copy()
    values[0] += 1e-2
    tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
    with pytest.raises(ExportVerificationError, match="differs from PyTorch"):
        verify_against_torch(proto, vit)
