import json

import numpy as np
import onnx
import pytest
import torch

from vitserve.export.rollout_reference import numpy_attention_rollout
from vitserve.export.verify import (ExportVerificationError, check_graph, cpu_session, require_symbolic_input,
                           verify_against_torch)
from vitserve.onnx_header import read_model_info
TINY_LABELS = ["cat", "dog", "bird"]  # as tests/conftest.py makes them


def dims(value):
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def run_both(model_path, vit, x):
    """(ONNX Runtime logits, rollout), (PyTorch logits, attentions) for float32 pixels x."""
    logits, rollout = cpu_session(str(model_path)).run(["logits", "rollout"], {"pixel_values": x})
    with torch.no_grad():
        ref_logits, attentions = vit.forward_with_attention(torch.from_numpy(x))
    return (logits, rollout), (ref_logits.numpy(), [a.numpy() for a in attentions])


def test_interface_is_the_contract(tiny_export):
    proto = onnx.load(str(tiny_export.path))
    assert [i.name for i in proto.graph.input] == ["pixel_values", "target_class"]
    assert dims(proto.graph.input[0]) == ["batch", 3, "height", "width"]
    assert dims(proto.graph.input[1]) == ["targets"]
    assert proto.graph.input[1].type.tensor_type.elem_type == onnx.TensorProto.INT64
    (default,) = [t for t in proto.graph.initializer if t.name == "target_class"]  # optional: empty by default
    assert list(default.dims) == [0]
    outputs = [(o.name, dims(o)) for o in proto.graph.output]
    assert outputs == [("logits", ["batch", 3]), ("rollout", ["batch", "height/8", "width/8"]),
                       ("relevance", ["explained", "explained_height", "explained_width"]),
                       ("embedding", ["batch", 32])]  # no ood_score: exported without a labelled set
    assert all(v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
               for v in [proto.graph.input[0], *proto.graph.output])
    assert tiny_export.metadata["vitserve.maps"] == '["rollout", "relevance"]'



def branch(proto: onnx.ModelProto, name: str) -> onnx.GraphProto:
    """A branch of the artifact's If: then_branch the relevance path, else_branch the fast path."""
    (choice,) = [n for n in proto.graph.node if n.op_type == "If"]
    return next(a.g for a in choice.attribute if a.name == name)


def test_single_file_without_external_data(tiny_export):
    assert sorted(p.name for p in tiny_export.path.parent.iterdir()) == ["tiny.onnx"]
    proto = onnx.load(str(tiny_export.path), load_external_data=False)
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)


def test_the_file_says_what_the_service_reads(tiny_export, tiny_model):
    """The one round trip of the contract: export writes ModelInfo, the service's reader gets it back."""
    from vitserve.model.checkpoint import weights_sha256
    from vitserve.artifact import ModelInfo
    from vitserve.budgets import derived_ladder
    from vitserve.onnx_header import read_model_info

    props = cpu_session(str(tiny_export.path)).get_modelmeta().custom_metadata_map
    assert props == tiny_export.metadata
    info = read_model_info(tiny_export.path)
    assert info == ModelInfo(
        name="tiny-vit", version="7", labels=TINY_LABELS, patch_size=8, image_size=(32, 32), channels=3,
        mean=[0.5] * 3, std=[0.25] * 3, precision="fp32",
        exporter=f"vitserve 0.1.0, torch {torch.__version__}, onnx {onnx.__version__}",
        weights_sha256=weights_sha256(tiny_model.state_dict()), test_accuracy=0.5,
        architecture=tiny_model.cfg.to_dict(), opset=tiny_export.opset, maps=("rollout", "relevance"),
        embedding_size=32, budgets=derived_ladder((32, 32), 8, tiny_model.cfg.to_dict()))
    assert ModelInfo.from_metadata(props, tiny_export.opset) == info


def test_export_report_covers_required_cases(tiny_export):
    v = tiny_export.verification
    sizes = {(c.height, c.width) for c in v.cases}
    assert sizes == {(32, 32), (48, 48), (16, 16), (40, 56)}  # trained, larger, smaller, non-square
    assert {c.batch for c in v.cases} == {1, 3}
    assert v.max_logits_diff <= 1e-4 and v.max_rollout_diff <= 1e-5
    e = tiny_export.embedding
    assert {(c.height, c.width, c.batch, c.path) for c in e.cases} == {
        (s, s, b, p) for s in (32, 64) for b in (1, 3) for p in ("fast", "relevance")}
    assert e.max_rel_diff <= 1e-5 and tiny_export.ood is tiny_export.ood_verification is None
    assert tiny_export.precision == "fp32" and tiny_export.opset >= 18


@pytest.mark.parametrize("batch,height,width", [(1, 32, 32), (7, 32, 32), (7, 24, 64), (1, 8, 8), (2, 72, 16)])
def test_runs_at_other_sizes_like_pytorch(tiny_export, tiny_model, batch, height, width):
    x = np.random.default_rng(batch + height).standard_normal((batch, 3, height, width)).astype(np.float32)
    (logits, rollout), (ref_logits, attentions) = run_both(tiny_export.path, tiny_model, x)
    assert logits.shape == (batch, 3) and rollout.shape == (batch, height // 8, width // 8)
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-4)
    want = numpy_attention_rollout(attentions, (height // 8, width // 8))
    np.testing.assert_allclose(rollout, want, rtol=0, atol=1e-5)


def test_rollout_is_a_distribution_share(tiny_export):
    x = np.random.default_rng(0).standard_normal((4, 3, 40, 24)).astype(np.float32)
    (rollout,) = cpu_session(str(tiny_export.path)).run(["rollout"], {"pixel_values": x})
    # The class row of a product of row-stochastic matrices sums to 1; the patches get all but the class part.
    assert np.all(rollout > 0) and np.all(rollout.sum(axis=(1, 2)) < 1)


@pytest.mark.slow
def test_nonsquare_trained_grid(nonsquare_export, nonsquare_checkpoint):
    from vitserve.model.checkpoint import load_checkpoint

    vit, _ = load_checkpoint(nonsquare_checkpoint)
    info = read_model_info(nonsquare_export.path)
    assert info.image_size == (24, 40) and info.channels == 1
    assert info.test_accuracy is None  # the checkpoint recorded none
    assert (24, 40) in {(c.height, c.width) for c in nonsquare_export.verification.cases}
    for batch, size in [(1, (24, 40)), (7, (40, 24)), (7, (32, 32))]:
        x = np.random.default_rng(batch).standard_normal((batch, 1, *size)).astype(np.float32)
        (logits, rollout), (ref_logits, attentions) = run_both(nonsquare_export.path, vit, x)
        np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-4)
        grid = (size[0] // 8, size[1] // 8)
        np.testing.assert_allclose(rollout, numpy_attention_rollout(attentions, grid), rtol=0, atol=1e-5)


def test_frozen_or_tied_dims_are_rejected(tiny_export):
    proto = onnx.load(str(tiny_export.path))
    require_symbolic_input(proto)
    frozen = onnx.ModelProto()
    frozen.CopyFrom(proto)
    frozen.graph.input[0].type.tensor_type.shape.dim[2].dim_value = 32  # height fixed at 32
    with pytest.raises(ExportVerificationError, match="frozen"):
        require_symbolic_input(frozen)
    tied = onnx.ModelProto()
    tied.CopyFrom(proto)
    tied.graph.input[0].type.tensor_type.shape.dim[3].dim_param = "height"  # width == height
    with pytest.raises(ExportVerificationError, match="tied"):
        check_graph(tied)


def test_size_specialising_model_fails_at_torch_export():
    """A Python branch on a size would freeze it; our torch.export call must refuse instead of exporting."""
    from vitserve.export.onnx_export import export_program

    class SizeBranch(torch.nn.Module):
        def forward(self, pixel_values):
            return pixel_values * 2 if pixel_values.shape[2] == 16 else pixel_values

    with pytest.raises(Exception, match="(?i)constraint|specializ|guard"):
        export_program(SizeBranch(), 8, torch.randn(2, 1, 16, 24))


def test_tampered_weight_fails_verification(tiny_export, tiny_model, tmp_path):
    proto = onnx.load(str(tiny_export.path))
    head = next(t for t in proto.graph.initializer if list(t.dims) == [3, 32])  # the head's weight
    values = onnx.numpy_helper.to_array(head).copy()
    values[0, 0] += 1e-2
    head.CopyFrom(onnx.numpy_helper.from_array(values, head.name))
    path = tmp_path / "tampered.onnx"
    onnx.save(proto, str(path))
    with pytest.raises(ExportVerificationError, match="differs from PyTorch"):
        verify_against_torch(str(path), tiny_model)


def test_fp16_export(tiny_fp16_export, tiny_export):
    report = tiny_fp16_export
    assert report.precision == "fp16" and report.metadata["vitserve.precision"] == "fp16"
    proto = onnx.load(str(report.path))
    assert dims(proto.graph.input[0]) == ["batch", 3, "height", "width"]
    assert all(v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for v in [proto.graph.input[0], *proto.graph.output])
    types = {t.data_type for t in proto.graph.initializer if len(t.dims) >= 2}
    assert onnx.TensorProto.FLOAT16 in types
    # The position embeddings reach the fast path's bicubic Resize in float32 (the exporter folds them to
    # (1, D, gh, gw)); the relevance path is float32 throughout.
    fast = branch(proto, "else_branch")
    producers = {out: n for n in fast.node for out in n.output}
    initializers = {t.name: t for t in proto.graph.initializer}
    (resize,) = [n for n in fast.node if n.op_type == "Resize"]
    source = resize.input[0]
    while source in producers and producers[source].op_type == "Cast":
        source = producers[source].input[0]
    assert list(initializers[source].dims) == [1, 32, 4, 4]
    assert initializers[source].data_type == onnx.TensorProto.FLOAT
    assert report.fp16.top1_agreement == 1.0 and report.fp16.photos >= 17 * 4
    assert report.fp16.logits_max_abs_diff <= report.fp16.logits_tolerance
    assert report.fp16.embedding_max_abs_diff <= report.fp16.embedding_tolerance
    matmul_weights = {i for n in fast.node if n.op_type in ("MatMul", "Gemm") for i in n.input if i in initializers}
    assert matmul_weights and {initializers[i].data_type for i in matmul_weights} == {onnx.TensorProto.FLOAT16}
    relevance = branch(proto, "then_branch")
    relevance_weights = {i for n in relevance.node for i in n.input if i in initializers}
    assert {initializers[i].data_type for i in relevance_weights} <= {onnx.TensorProto.FLOAT, onnx.TensorProto.INT64}
    assert report.relevance.max_relevance_rel_diff <= 1e-4
    assert report.metadata["vitserve.weights_sha256"] == tiny_export.metadata["vitserve.weights_sha256"]


@pytest.mark.slow
def test_cli_export(tiny_checkpoint, tmp_path, capsys):
    from vitserve.cli import main

    out = tmp_path / "cli.onnx"
    assert main(["export", str(tiny_checkpoint), "--out", str(out), "--no-verify", "--opset", "18", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["path"] == str(out) and summary["opset"] == 18 and "verified" not in summary
    assert next(o.version for o in onnx.load(str(out)).opset_import if o.domain == "") == 18


def test_cli_export_tells_its_progress_and_what_to_run_next(tiny_checkpoint, tmp_path, capsys):
    """Without --json: a line per step on stderr as it starts, then a summary a person reads, ending with the
    command that serves the file."""
    from vitserve.cli import main

    out = tmp_path / "told.onnx"
    assert main(["export", str(tiny_checkpoint), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    steps = [line for line in printed.err.splitlines() if line.startswith("[")]
    assert any("into ONNX" in s for s in steps) and any("verifying ONNX Runtime" in s for s in steps)
    lines = printed.out.strip().splitlines()
    assert lines[0].startswith(f"exported {out}: fp32, opset ") and "verified against PyTorch at" in lines[1]
    assert "relevance path verified" in lines[2] and lines[-1] == f"next: vitserve serve --model {out}"
    assert lines[3].startswith("embedding verified against PyTorch's class token at 32x32, 64x64 (fast and relevance "
                               "paths): within ")
    assert main(["export", str(tiny_checkpoint), "--out", str(out), "--no-verify", "--quiet"]) == 0
    assert not capsys.readouterr().err.count("[")
