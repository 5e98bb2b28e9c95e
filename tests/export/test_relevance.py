"""Class-specific relevance (conservative propagation): the rule's identities, eager PyTorch, and the artifact's
relevance path against both."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from vitserve.export.relevance import (FrozenGates, conservative_forward, explain, reference_tokens,
                                       replacement_relevance)
from vitserve.export.verify import ExportVerificationError, cpu_session, verify_against_torch, verify_relevance

OUTPUTS = ["logits", "rollout", "relevance"]


def random_pixels(batch: int, size: tuple[int, int], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 3, *size)).astype(np.float32)


def test_relevance_depends_on_the_class_and_rollout_does_not(tiny_model):
    x = torch.from_numpy(random_pixels(1, (32, 32), seed=3)).expand(3, -1, -1, -1)
    logits, rollout, relevance = explain(tiny_model, x, torch.tensor([0, 1, 2]))
    assert torch.equal(rollout[0], rollout[1]) and torch.equal(rollout[1], rollout[2])
    assert not torch.allclose(relevance[0], relevance[1]) and not torch.allclose(relevance[1], relevance[2])
    top1 = int(logits[0].argmax())
    _, _, predicted = explain(tiny_model, x[:1])  # no target: the top-1
    torch.testing.assert_close(predicted[0], relevance[top1], rtol=0, atol=0)


def test_eager_relevance_matches_the_autograd_free_rule(tiny_model):
    """The frozen network is affine: a patch's relevance is the logit's change when its token is replaced."""
    x = torch.from_numpy(random_pixels(3, (24, 40), seed=1))
    targets = torch.tensor([-1, 0, 2])
    _, _, relevance = explain(tiny_model, x, targets)
    reference = replacement_relevance(tiny_model, x, targets)
    torch.testing.assert_close(relevance, reference, rtol=0, atol=1e-5 * float(reference.abs().max()))


def test_relevance_is_conserved_and_the_logits_are_the_models(tiny_model):
    """The patches' relevance sums to the logit minus the frozen network's logit on the reference image."""
    x = torch.from_numpy(random_pixels(2, (32, 32), seed=4))
    logits, _, relevance = explain(tiny_model, x, torch.tensor([1, 2]))
    with torch.no_grad():
        torch.testing.assert_close(logits, tiny_model(x), rtol=0, atol=1e-5)
        _, _, gates = conservative_forward(tiny_model, tiny_model.embed(x))
        at_reference, _, _ = conservative_forward(tiny_model, reference_tokens(tiny_model, x).expand(2, -1, -1),
                                                  FrozenGates(gates.attention, gates.norm1, gates.norm2, gates.gelu,
                                                              gates.final_norm))
    added = logits[[0, 1], [1, 2]] - at_reference[[0, 1], [1, 2]]
    torch.testing.assert_close(relevance.sum((1, 2)), added, rtol=1e-4, atol=1e-5)


def test_a_patch_equal_to_the_reference_has_no_relevance(tiny_model):
    x = torch.from_numpy(random_pixels(1, (32, 32), seed=5))
    x[..., 8:16, 16:24] = 0  # the patch at row 1, column 2 of 8-pixel patches: the mean image's pixels
    _, _, relevance = explain(tiny_model, x)
    assert relevance[0, 1, 2] == 0
    assert (relevance != 0).sum() == relevance.numel() - 1
    assert (relevance < 0).any() and (relevance > 0).any()  # signed: evidence for and against the class


@pytest.mark.parametrize("batch,height,width", [(1, 32, 32), (5, 32, 32), (2, 24, 64), (1, 8, 8), (4, 72, 16)])
def test_artifact_relevance_path_matches_pytorch(tiny_export, tiny_model, batch, height, width):
    x = random_pixels(batch, (height, width), seed=batch + height)
    targets = (np.arange(batch) % 4 - 1).astype(np.int64)  # the top-1 and each class
    logits, rollout, relevance = cpu_session(str(tiny_export.path)).run(OUTPUTS, {"pixel_values": x,
                                                                                  "target_class": targets})
    want = [t.numpy() for t in explain(tiny_model, torch.from_numpy(x), torch.from_numpy(targets))]
    assert relevance.shape == (batch, height // 8, width // 8)
    np.testing.assert_allclose(logits, want[0], rtol=0, atol=1e-4)
    np.testing.assert_allclose(rollout, want[1], rtol=0, atol=1e-5)
    np.testing.assert_allclose(relevance, want[2], rtol=0, atol=1e-4 * np.abs(want[2]).max())


def test_fast_path_gives_the_same_logits_and_no_relevance(tiny_export):
    session = cpu_session(str(tiny_export.path))
    x = random_pixels(3, (40, 24), seed=7)
    fast = session.run(OUTPUTS, {"pixel_values": x})
    explained = session.run(OUTPUTS, {"pixel_values": x, "target_class": np.full(3, -1, np.int64)})
    assert fast[2].shape == (0, 0, 0)
    np.testing.assert_allclose(fast[0], explained[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(fast[1], explained[1], rtol=0, atol=1e-6)


def test_export_report_covers_the_relevance_path(tiny_export):
    report = tiny_export.relevance
    assert {(c.height, c.width) for c in report.cases} == {(32, 32), (48, 48), (16, 16), (40, 56)}
    assert {c.batch for c in report.cases} == {1, 3}
    assert {t for c in report.cases for t in c.targets} == {-1, 0, 1}  # the top-1 and named classes, mixed
    assert report.max_relevance_rel_diff <= 1e-4


def test_weights_are_stored_once(tiny_export):
    proto = onnx.load(str(tiny_export.path))
    digests = [onnx.numpy_helper.to_array(t).tobytes() + bytes(t.dims) for t in proto.graph.initializer]
    assert len(digests) == len(set(digests))
    (choice,) = [n for n in proto.graph.node if n.op_type == "If"]
    for branch in (a.g for a in choice.attribute):
        assert not branch.initializer  # the branches read the outer graph's weights


def test_a_wrong_relevance_path_fails_verification(tiny_export, tiny_model, tmp_path):
    """A weight only the relevance branch reads (the backward pass's own copy) changed: verification refuses it,
    and the fast path, which does not read it, still passes."""
    proto = onnx.load(str(tiny_export.path))
    (choice,) = [n for n in proto.graph.node if n.op_type == "If"]
    branches = {a.name: a.g for a in choice.attribute}
    reads = {name: {i for n in g.node for i in n.input} for name, g in branches.items()}
    (tensor, *_) = [t for t in proto.graph.initializer if t.name in reads["then_branch"] - reads["else_branch"]
                    and t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2]
    tensor.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(tensor) * 1.5, tensor.name))
    path = tmp_path / "wrong.onnx"
    onnx.save(proto, str(path))
    with pytest.raises(ExportVerificationError, match="relevance path differs"):
        verify_relevance(str(path), tiny_model)
    verify_against_torch(str(path), tiny_model)  # the fast path is untouched


def test_export_without_relevance_keeps_the_fast_contract(tiny_checkpoint, tmp_path):
    from vitserve.export.onnx_export import export_onnx
    from vitserve.onnx_header import read_model_info

    report = export_onnx(tiny_checkpoint, tmp_path / "fast.onnx", relevance=False)
    proto = onnx.load(str(report.path))
    assert [i.name for i in proto.graph.input] == ["pixel_values"]
    assert [o.name for o in proto.graph.output] == ["logits", "rollout", "embedding"]
    assert not any(n.op_type == "If" for n in proto.graph.node)
    assert report.relevance is None and read_model_info(report.path).maps == ("rollout",)
