"""`vitserve export --precision int8`: static int8 Linear layers (activation scales calibrated on the labelled set and
stored), refused unless it passes an accuracy gate against the float32 graph; the maps' agreement reported; a
server loads the file with no flag; an image's answer does not depend on its batch-mates."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

TINY_LABELS = ["cat", "dog", "bird"]  # tests/conftest.py's tiny_checkpoint
from vitserve.export.accuracy_gate import EvalSetError, load_labelled_set, spearman
from vitserve.export.verify import ExportVerificationError, cpu_session
from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES, ModelInfo


@pytest.fixture(scope="module")
def labelled_folder(tmp_path_factory, labelled_folder_writer):
    """DIR/<label>/<image> for the tiny model's labels, 4 images each, of different sizes."""
    root = labelled_folder_writer(tmp_path_factory.mktemp("eval"), 4, seed=0, size=lambda i: (20 + 4 * i, 30))
    (root / TINY_LABELS[0] / "notes.txt").write_text("not an image: skipped")
    return root


@pytest.fixture(scope="module")
def tiny_int8_export(tiny_checkpoint, labelled_folder, tmp_path_factory):
    from vitserve.export.onnx_export import export_onnx

    return export_onnx(tiny_checkpoint, tmp_path_factory.mktemp("onnx") / "tiny-int8.onnx", precision="int8",
                       eval_dir=labelled_folder)


def test_the_int8_file_has_int8_linear_weights_and_passes_its_gate(tiny_int8_export, tiny_export):
    report = tiny_int8_export
    assert report.precision == "int8" and report.metadata["vitserve.precision"] == "int8"
    proto = onnx.load(str(report.path))
    ops = {n.op_type for n in proto.graph.node}
    branch_ops = {n.op_type for n in proto.graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH
                  for n in a.g.node}
    # static: activation scales stored in the file (QuantizeLinear with constant scales), none computed per call
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops | branch_ops
    assert not {"DynamicQuantizeLinear", "DynamicQuantizeMatMul", "MatMulInteger"} & (ops | branch_ops)
    gate = report.int8
    assert gate.images == 4 * len(TINY_LABELS) and gate.top1_agreement >= 0.99 and gate.photos >= 17 * 4
    assert gate.fp32_accuracy is not None and gate.fp32_accuracy - gate.int8_accuracy <= 0.003
    assert 0.9 <= gate.rollout_spearman_mean <= 1.0 and gate.rollout_spearman_min <= gate.rollout_spearman_mean
    assert gate.relevance_spearman_mean == pytest.approx(1.0)  # the relevance path stays float32
    # it computes what the fp32 file computes, nearly: the same classes on the gate's images
    x = np.random.default_rng(3).standard_normal((4, 3, 32, 32)).astype(np.float32)
    q = cpu_session(str(report.path)).run(list(OUTPUT_NAMES), {INPUT_NAME: x})
    f = cpu_session(str(tiny_export.path)).run(list(OUTPUT_NAMES), {INPUT_NAME: x})
    assert q[1].shape == f[1].shape and np.abs(q[0] - f[0]).max() < 0.1 * max(1.0, np.abs(f[0]).max())
    info = ModelInfo.from_metadata({p.key: p.value for p in proto.metadata_props})
    assert info.precision == "int8" and info.explains_classes
    # the embedding survives quantization, near float32's; 12 labelled images are too few for an OOD score
    (q_embedding,), (f_embedding,) = (cpu_session(str(path)).run(["embedding"], {INPUT_NAME: x})
                                      for path in (report.path, tiny_export.path))
    assert q_embedding.shape == (4, 32) and np.abs(q_embedding - f_embedding).max() < 0.1 * np.abs(f_embedding).max()
    assert [o.name for o in proto.graph.output][-1] == "embedding" and info.extra_outputs == ("embedding",)
    assert report.no_ood == "no OOD score: 12 labelled images, fitting one needs at least 100"


@pytest.mark.slow
def test_an_int8_file_that_misses_the_gate_is_refused_and_moved_aside(tiny_checkpoint, labelled_folder, tmp_path,
                                                                       monkeypatch):
    """Quantization that wrecks the weights (scrambled, as bad scales would) changes the decisions: the
    export fails like a failed verification and no file is left where a server would load it."""
    import vitserve.export.int8 as int8
    from vitserve.export.onnx_export import export_onnx

    real = int8.quantize_int8

    def wrecked(proto, calibration, keep_float=()):
        proto = real(proto, calibration, keep_float)
        rng = np.random.default_rng(0)
        for weights in [i for i in proto.graph.initializer if i.data_type == onnx.TensorProto.INT8]:
            values = onnx.numpy_helper.to_array(weights)
            weights.CopyFrom(onnx.numpy_helper.from_array(rng.permutation(values.ravel()).reshape(values.shape),
                                                          weights.name))
        return proto

    monkeypatch.setattr(int8, "quantize_int8", wrecked)
    out = tmp_path / "bad.onnx"
    with pytest.raises(ExportVerificationError, match="misses the accuracy gate: top-1 agreement"):
        export_onnx(tiny_checkpoint, out, precision="int8", eval_dir=labelled_folder, relevance=False)
    assert not out.exists() and (tmp_path / "bad.onnx.rejected").exists()


def test_the_labelled_set_reads_label_folders_and_refuses_what_it_cannot_use(labelled_folder, tmp_path):
    dataset = load_labelled_set(labelled_folder, list(TINY_LABELS), 3, (32, 32))
    assert dataset.images.shape == (4 * len(TINY_LABELS), 3, 32, 32) and dataset.images.dtype == np.uint8
    assert sorted(set(dataset.labels.tolist())) == list(range(len(TINY_LABELS)))
    assert len(load_labelled_set(labelled_folder, list(TINY_LABELS), 1, (16, 16), limit=5).labels) == 5
    (tmp_path / "zebra").mkdir()
    with pytest.raises(EvalSetError, match="unknown: \\['zebra'\\]"):
        load_labelled_set(tmp_path, list(TINY_LABELS), 3, (32, 32))
    with pytest.raises(EvalSetError, match="not a directory"):
        load_labelled_set(tmp_path / "missing", list(TINY_LABELS), 3, (32, 32))
    (tmp_path / "zebra").rmdir()
    (tmp_path / TINY_LABELS[0]).mkdir()
    with pytest.raises(EvalSetError, match="no images"):
        load_labelled_set(tmp_path, list(TINY_LABELS), 3, (32, 32))


def test_spearman_ranks_maps_alike_and_a_constant_map_counts_as_agreeing():
    a = np.arange(16, dtype=np.float32).reshape(1, 4, 4)
    assert spearman(a, a * 3 + 1)[0] == pytest.approx(1.0) and spearman(a, -a)[0] == pytest.approx(-1.0)
    assert spearman(np.ones((1, 2, 2)), np.ones((1, 2, 2)))[0] == 1.0


def test_the_cli_takes_precision_int8_and_keeps_fp16_as_its_older_spelling():
    import argparse

    from vitserve.export.cli import add_export_parser
    parser = argparse.ArgumentParser()
    add_export_parser(parser.add_subparsers())
    args = parser.parse_args(["export", "ckpt", "--out", "m.onnx", "--precision", "int8", "--eval", "d",
                              "--max-accuracy-drop", "0.5"])
    assert (args.precision, args.eval_dir, args.max_accuracy_drop) == ("int8", "d", 0.5)
    assert parser.parse_args(["export", "ckpt", "--out", "m.onnx", "--fp16"]).fp16
    with pytest.raises(SystemExit):
        parser.parse_args(["export", "ckpt", "--out", "m.onnx", "--precision", "int4"])
    with pytest.raises(SystemExit):
        parser.parse_args(["export", "ckpt", "--out", "m.onnx", "--min-top1-agreement", "1.5"])
    for flag, bad in (("--eval-limit", "0"), ("--eval-limit", "x"), ("--max-accuracy-drop", "-1"),
                      ("--max-accuracy-drop", "101")):
        with pytest.raises(SystemExit):
            parser.parse_args(["export", "ckpt", "--out", "m.onnx", "--precision", "int8", flag, bad])


def test_a_labelled_set_the_export_cannot_use_is_refused_before_exporting(tmp_path, capsys):
    """--eval that is not a folder: a one-line error at once, not after the export's minute."""
    import argparse

    from vitserve.export.cli import add_export_parser
    parser = argparse.ArgumentParser()
    add_export_parser(parser.add_subparsers())
    for extra, message in ((["--eval", str(tmp_path / "none")], "not a directory"),
                           (["--precision", "int8", "--eval", str(tmp_path / "none")], "not a directory")):
        args = parser.parse_args(["export", "no-such-checkpoint", "--out", str(tmp_path / "m.onnx"), *extra])
        assert args.func(args) == 2
        error = capsys.readouterr().err.strip()
        assert message in error and "\n" not in error
    assert not (tmp_path / "m.onnx").exists()


def test_a_folder_the_gate_cannot_use_is_refused_before_tracing_in_one_line(tiny_checkpoint, tmp_path, capsys,
                                                                             monkeypatch):
    """An empty folder (found in the first-hour sitting: refused only after the whole export, as a failed
    verification, with the file moved aside) is a usage error before any work."""
    import argparse

    from vitserve.export import onnx_export
    from vitserve.export.cli import add_export_parser

    def never(*args, **kwargs):
        raise AssertionError("the export started")

    monkeypatch.setattr(onnx_export, "to_onnx", never)
    parser = argparse.ArgumentParser()
    add_export_parser(parser.add_subparsers())
    (tmp_path / "empty").mkdir()
    args = parser.parse_args(["export", str(tiny_checkpoint), "--out", str(tmp_path / "m.onnx"), "--precision",
                              "int8", "--eval", str(tmp_path / "empty"), "--quiet"])
    assert args.func(args) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().startswith(f"vitserve export: --eval {tmp_path / 'empty'}: folders must be named")
    assert "\n" not in captured.err.strip() and captured.out == ""
    assert not list(tmp_path.glob("m.onnx*"))


def test_the_server_loads_the_int8_file_with_no_flag_and_explains_with_it(tiny_int8_export):
    from vitserve.service.engine.onnx_runtime import OnnxModel
    from vitserve.service.ground.settings import Settings

    model = OnnxModel.load(Settings(model_path=tiny_int8_export.path, providers=["cpu"]))
    assert model.info.precision == "int8"
    pixels = np.zeros((2, 3, 48, 32), np.float32)  # another resolution than the trained one
    logits, rollout = model.run(pixels)[:2]  # then the file's optional outputs (its embedding)
    assert logits.shape == (2, len(TINY_LABELS)) and rollout.shape == (2, 6, 4)
    relevance = model.explain(pixels, np.array([-1, 1]))[2]
    assert relevance.shape == (2, 6, 4) and np.isfinite(relevance).all()


def test_the_cpu_check_reads_vnni_from_cpuinfo_flags(tmp_path):
    from vitserve.machine import has_int8_dot_product

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n")
    assert has_int8_dot_product(cpuinfo)
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n")
    assert not has_int8_dot_product(cpuinfo)
    assert not has_int8_dot_product(tmp_path / "missing")


def test_an_int8_image_answers_the_same_alone_and_among_any_batch_mates(tiny_int8_export):
    """Static scales: each image is computed the same whatever shares its batch (dynamic quantization took its
    activation scales from the whole batch, so the same image changed class with its neighbours)."""
    from vitserve.service.engine.onnx_runtime import OnnxModel
    from vitserve.service.ground.settings import Settings

    model = OnnxModel.load(Settings(model_path=tiny_int8_export.path, providers=["cpu"], intra_op_threads=1))
    rng = np.random.default_rng(5)
    # neighbours far apart in range: the batch-mates of a dynamic scale would dominate it
    images = np.concatenate([rng.standard_normal((8, 3, 32, 32)), 20 * rng.standard_normal((8, 3, 32, 32))])
    images = images.astype(np.float32)
    names = model.info.output_names()
    alone = [np.concatenate(column) for column in zip(*(model.run(images[i:i + 1]) for i in range(len(images))))]
    for trial in range(4):
        order = rng.permutation(len(images))[:int(rng.integers(2, len(images) + 1))]
        for name, batched, by_itself in zip(names, model.run(images[order]), alone):
            if name == "rollout":  # a map, never rounded to int8 steps: its float products may round by batch
                np.testing.assert_allclose(batched, by_itself[order], rtol=1e-5, atol=1e-7)
            else:  # bit for bit: a rounding difference, however small, moves an image at an int8 step's edge
                np.testing.assert_array_equal(batched, by_itself[order], err_msg=name)


def test_the_head_stays_float32_so_the_logits_are_not_rounded_to_int8_steps(tiny_int8_export):
    """The head's input is the embedding, a graph output: ONNX Runtime would run a quantized head as float32 on
    weights dequantized per call, with a kernel chosen by the batch's row count, then round the logits to int8
    steps; an image at a step's edge then moved a step with its batch size."""
    from vitserve.export.int8 import output_linear_nodes
    from vitserve.service.engine.graph_paths import split_paths

    fast = split_paths(onnx.load(str(tiny_int8_export.path))).fast.graph
    produced_by = {o: n for n in fast.node for o in n.output}
    head = produced_by["logits"]
    assert head.op_type in ("Gemm", "MatMul") and head.name in output_linear_nodes(onnx.helper.make_model(fast))
    weights = {i.name for i in fast.initializer}
    assert head.input[1] in weights  # a float32 weight, not a DequantizeLinear's output


def test_the_export_says_whether_int8_pays_on_this_cpu():
    from vitserve.export.cli import precision_advice

    assert "no int8 dot-product units" in precision_advice("int8", False, "ckpt")
    assert "--precision int8" in precision_advice("fp32", True, "ckpt")
    assert precision_advice("int8", True, "ckpt") is None and precision_advice("fp32", False, "ckpt") is None
    assert precision_advice("fp16", False, "ckpt") is None
