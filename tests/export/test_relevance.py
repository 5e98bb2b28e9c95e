"""Class-specific relevance: the rule alone, eager PyTorch, and the artifact's relevance path against both."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from vitserve.export.relevance import explain, relevance_rollout
from vitserve.export.rollout_reference import numpy_relevance
from vitserve.export.verify import (ExportVerificationError, autograd_relevance, cpu_session, verify_against_torch,
                           verify_relevance)

OUTPUTS = ["logits", "rollout", "relevance"]


def random_pixels(batch: int, size: tuple[int, int], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 3, *size)).astype(np.float32)


def test_rule_matches_the_full_matrix_products():
    rng = np.random.default_rng(0)
    attentions = [rng.dirichlet(np.ones(5), size=(2, 3, 5)) for _ in range(4)]  # (B, heads, N, N), rows sum to 1
    gradients = [rng.standard_normal((2, 3, 5, 5)) for _ in range(4)]
    got = relevance_rollout([torch.from_numpy(a) for a in attentions], [torch.from_numpy(g) for g in gradients])
    np.testing.assert_allclose(got.numpy(), numpy_relevance(attentions, gradients, (2, 2)).reshape(2, 4),
                               rtol=1e-12, atol=1e-15)


def test_one_layer_relevance_is_the_weighted_class_row():
    attn = torch.tensor([[[[0.5, 0.25, 0.25], [0.2, 0.4, 0.4], [0.1, 0.1, 0.8]]]])  # (1, 1, 3, 3)
    grad = torch.tensor([[[[1.0, -2.0, 4.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]]])
    # (grad * attn)+ on the class row: [0.5, 0 (negative), 1.0]; the patches' part is [0, 1].
    assert relevance_rollout([attn], [grad]).tolist() == [[0.0, 1.0]]


def test_relevance_depends_on_the_class_and_rollout_does_not(tiny_model):
    x = torch.from_numpy(random_pixels(1, (32, 32), seed=3)).expand(3, -1, -1, -1)
    logits, rollout, relevance = explain(tiny_model, x, torch.tensor([0, 1, 2]))
    assert torch.equal(rollout[0], rollout[1]) and torch.equal(rollout[1], rollout[2])
    assert not torch.allclose(relevance[0], relevance[1]) and not torch.allclose(relevance[1], relevance[2])
    top1 = int(logits[0].argmax())
    _, _, predicted = explain(tiny_model, x[:1])  # no target: the top-1
    torch.testing.assert_close(predicted[0], relevance[top1], rtol=0, atol=0)


def test_eager_relevance_matches_autograd_and_the_numpy_rule(tiny_model):
    x = random_pixels(3, (24, 40), seed=1)
    targets = np.array([-1, 0, 2])
    _, _, relevance = explain(tiny_model, torch.from_numpy(x), torch.from_numpy(targets))
    reference = autograd_relevance(tiny_model, x, targets, (3, 5))
    np.testing.assert_allclose(relevance.numpy(), reference, rtol=0, atol=1e-6 * np.abs(reference).max())


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
