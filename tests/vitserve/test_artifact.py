"""The model file's contract alone: metadata both ways, its errors, the header reader, the reference normalisation."""
from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from vitserve.artifact import (FORMAT_VERSION, INPUT_NAME, OUTPUT_NAMES, ArtifactError, ModelInfo,
                               normalize_pixels)
from vitserve.onnx_header import read_header, read_model_info

INFO = ModelInfo(name="m", version="2", labels=["a", "b"], patch_size=4, image_size=(28, 24), channels=1,
                 mean=[0.286], std=[0.353], precision="fp16", exporter="vitserve 0.1.0", weights_sha256="ab" * 32,
                 test_accuracy=0.92, architecture={"depth": 6}, maps=("rollout", "relevance"))


def test_metadata_round_trips():
    props = INFO.to_metadata()
    assert all(k.startswith("vitserve.") and isinstance(v, str) for k, v in props.items())
    assert props["vitserve.format_version"] == str(FORMAT_VERSION) and props["vitserve.labels"] == '["a", "b"]'
    assert (props["vitserve.image_height"], props["vitserve.image_width"]) == ("28", "24")
    assert ModelInfo.from_metadata(props, opset=18) == replace(INFO, opset=18)
    assert ModelInfo.from_metadata(replace(INFO, test_accuracy=None).to_metadata()).test_accuracy is None
    assert "vitserve.test_accuracy" not in replace(INFO, test_accuracy=None).to_metadata()


def test_optional_keys_have_defaults():
    required = {k: v for k, v in INFO.to_metadata().items()
                if k.split(".", 1)[1] not in ("precision", "exporter", "weights_sha256", "test_accuracy",
                                              "architecture", "maps")}
    info = ModelInfo.from_metadata(required)
    assert (info.precision, info.exporter, info.weights_sha256, info.test_accuracy, info.architecture) == (
        "fp32", "", "", None, {})
    assert info.maps == ("rollout",) and not info.explains_classes  # a file from before the relevance path


@pytest.mark.parametrize("change, message", [
    ({"vitserve.labels": None}, "lacks 'vitserve.labels'"),
    ({"vitserve.patch_size": "four"}, "'vitserve.patch_size' = 'four' is malformed"),
    ({"vitserve.labels": "not json"}, "'vitserve.labels' = 'not json' is malformed"),
    ({"vitserve.mean": "[0.1, 0.2]"}, "inconsistent"),
    ({"vitserve.std": "[0.0]"}, "inconsistent"),
    ({"vitserve.precision": "int4"}, "inconsistent"),
    ({"vitserve.labels": "[]"}, "inconsistent"),
    ({"vitserve.format_version": str(FORMAT_VERSION + 1)}, "newer than this reader"),
    ({"vitserve.maps": '["relevance"]'}, "inconsistent"),  # every model computes the rollout
    ({"vitserve.maps": '["rollout", "gradcam"]'}, "inconsistent"),
    ({"vitserve.maps": '"rollout"'}, "inconsistent"),
])
def test_metadata_errors(change, message):
    props = {k: v for k, v in {**INFO.to_metadata(), **change}.items() if v is not None}
    with pytest.raises(ArtifactError, match=message):
        ModelInfo.from_metadata(props)


def _tiny_onnx(path, metadata: dict[str, str], opset: int = 17):
    """A one-node graph with the contract's names: enough for the header reader."""
    node = helper.make_node("Identity", [INPUT_NAME], [OUTPUT_NAMES[0]])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info(OUTPUT_NAMES[0], TensorProto.FLOAT, [1])],
                              [helper.make_tensor("w", TensorProto.FLOAT, [4096], np.ones(4096, np.float32))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("com.other", 3),
                                                    helper.make_opsetid("", opset)])
    helper.set_model_props(model, metadata)
    onnx.save(model, str(path))
    return model


def test_header_reader_matches_onnx(tmp_path):
    model = _tiny_onnx(tmp_path / "m.onnx", INFO.to_metadata(), opset=18)
    header = read_header(tmp_path / "m.onnx")
    assert header.opset == 18 and header.metadata == {p.key: p.value for p in model.metadata_props}
    assert read_model_info(tmp_path / "m.onnx") == replace(INFO, opset=18)


@pytest.mark.parametrize("content, message", [
    (None, "not found"), (b"", "empty"), (b"\x0a\xff\xff\xff\x0f" + b"x" * 10, "not an ONNX model"),
    (b"\x0f" * 8, "not an ONNX model"), (b"\xff" * 12, "malformed varint"),
])
def test_header_reader_refuses_what_is_not_onnx(tmp_path, content, message):
    path = tmp_path / "bad.onnx"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ArtifactError, match=message):
        read_header(path)


def test_a_foreign_onnx_file_is_named_as_such(tmp_path):
    _tiny_onnx(tmp_path / "foreign.onnx", {})
    with pytest.raises(ArtifactError, match="was it exported by `vitserve export`"):
        read_model_info(tmp_path / "foreign.onnx")


def test_normalize_pixels_is_the_formula_in_float32():
    pixels = np.array([[[[0, 51, 255]]], [[[255, 0, 51]]]], np.uint8)  # (2, 1, 1, 3)
    out = normalize_pixels(pixels, [0.2], [0.5])
    assert out.dtype == np.float32 and out.shape == (2, 1, 1, 3)
    np.testing.assert_allclose(out[0, 0, 0], [-0.4, 0.0, 1.6], atol=1e-6)
    rgb = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)  # (H, W, C)
    out = normalize_pixels(rgb, [0.5, 0.25, 0.0], [0.5, 0.25, 2.0], channel_axis=-1)
    expected = (rgb.astype(np.float32) / np.float32(255) - np.float32([0.5, 0.25, 0.0])) / np.float32([0.5, 0.25, 2])
    assert np.array_equal(out, expected)


def test_the_contract_needs_neither_torch_nor_onnxruntime():
    import subprocess
    code = ("import sys, vitserve.artifact, vitserve.onnx_header; "
            "print(sorted(m for m in ('torch', 'onnxruntime', 'onnx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_directory_is_named_as_such_with_the_models_inside(tmp_path):
    with pytest.raises(ArtifactError, match=r"is a directory, not a model file; give the .onnx file"):
        read_header(tmp_path)
    _tiny_onnx(tmp_path / "model.onnx", INFO.to_metadata())
    with pytest.raises(ArtifactError, match=rf"it holds model.onnx: give the file, e.g. {tmp_path}/model.onnx"):
        read_header(tmp_path)
