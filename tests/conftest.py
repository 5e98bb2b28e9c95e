"""Fixtures shared by every test package: tiny models made once per session."""
from __future__ import annotations

import hashlib
import os
import tempfile

import numpy as np
import pytest

# Tests run beside long jobs on two cores; one intra-op thread keeps them predictable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tuning records of their own (service/engine/serving_plan.py): a developer's ~/.cache/vitserve/tuning must not decide
# how a test's model is served, and the tests' records must not land there.
os.environ.setdefault("VITSERVE_TUNING_DIR", tempfile.mkdtemp(prefix="vitserve-tuning-tests-"))

TINY_LABELS = ["cat", "dog", "bird"]


@pytest.fixture(scope="session", autouse=True)
def trace_each_graph_once():
    """Tracing is most of an export (10 s for the fast graph, 20 s for the relevance graph of the tiny ViT on two
    cores), and the tests export the same few tiny models many times over, once per flag or precision under test.
    The tracer gives equal graphs for equal modules and arguments (tests/export/test_reproducible_export.py checks
    it byte for byte, in child processes that this cache does not reach), so each distinct graph is traced once
    per session; every caller gets its own copy, as it would from a fresh trace."""
    import onnx

    from vitserve.export import onnx_export

    traced: dict[str, onnx.ModelProto] = {}

    def cached(function, key_of):
        def call(*args, **kwargs):
            key = key_of(*args, **kwargs)
            if key is None:
                return function(*args, **kwargs)
            if key not in traced:
                traced[key] = function(*args, **kwargs)
            copy = onnx.ModelProto()
            copy.CopyFrom(traced[key])
            return copy
        return call

    def to_onnx_key(module, patch_size, example, output_names, opset=None, target=None):
        import torch
        if isinstance(module, torch.fx.GraphModule):
            return None  # a traced module's weights live outside its state; relevance_onnx is cached a level up
        return _digest("to_onnx", module, patch_size, example, tuple(output_names), opset,
                       None if target is None else tuple(target.shape))

    def relevance_key(vit, opset=None):
        return _digest("relevance_onnx", vit, opset)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(onnx_export, "to_onnx", cached(onnx_export.to_onnx, to_onnx_key))
        patch.setattr(onnx_export, "relevance_onnx", cached(onnx_export.relevance_onnx, relevance_key))
        yield


def _digest(*parts) -> str:
    """What a trace depends on: a module's class, structure, mode, configs, parameters and buffers; tensors' shapes and
    values; everything else by repr."""
    import torch
    h = hashlib.sha256()

    def add(part):
        if isinstance(part, torch.nn.Module):
            h.update(f"{type(part).__qualname__}{part!r}".encode())
            for module in part.modules():
                h.update(f"{module.training}{getattr(module, 'cfg', None)!r}".encode())
            for name, tensor in [*part.named_parameters(), *part.named_buffers()]:
                h.update(name.encode())
                add(tensor)
        elif isinstance(part, torch.Tensor):
            h.update(f"{part.dtype}{tuple(part.shape)}".encode())
            h.update(part.detach().contiguous().cpu().numpy().tobytes())
        else:
            h.update(repr(part).encode())
    for part in parts:
        add(part)
    return h.hexdigest()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A 3-class, 3-channel, 2-layer ViT on a 4x4 grid of 8-pixel patches, random weights, saved as a checkpoint."""
    from vitserve.export.presets import RandomModel, random_checkpoint

    spec = RandomModel("tiny", dict(image_size=(32, 32), patch_size=8, embed_dim=32, depth=2, num_heads=2,
                                    mlp_dim=64, num_classes=len(TINY_LABELS)),
                       labels=list(TINY_LABELS), mean=[0.5] * 3, std=[0.25] * 3, name="tiny-vit", version="7",
                       metrics={"test_accuracy": 0.5})
    return random_checkpoint(spec, tmp_path_factory.mktemp("tiny") / "checkpoint")


@pytest.fixture(scope="session")
def tiny_onnx(tiny_checkpoint, tmp_path_factory):
    """The tiny ViT exported by `export_onnx` without verification (export's own tests verify it)."""
    from vitserve.export.onnx_export import export_onnx

    out = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    export_onnx(tiny_checkpoint, out, verify=False)
    return out


@pytest.fixture(scope="session")
def tiny_onnx_other(tiny_onnx, tmp_path_factory):
    """The tiny ViT's graph and labels with other weights (every float weight moved by seeded noise of half its
    spread): another version that disagrees now and then (shadow versions' tests). Made from the exported file
    with onnx, as exporting a second model would cost the suite as much again."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(tiny_onnx))
    rng = np.random.default_rng(1)
    for index, tensor in enumerate(model.graph.initializer):
        weights = numpy_helper.to_array(tensor)
        if weights.dtype == np.float32 and weights.size > 1:
            moved = weights + rng.normal(0, 0.5 * (weights.std() or 1), weights.shape).astype(np.float32)
            model.graph.initializer[index].CopyFrom(numpy_helper.from_array(moved, tensor.name))
    out = tmp_path_factory.mktemp("tiny-other") / "tiny-other.onnx"
    onnx.save(model, str(out))
    return out


def write_labelled_folder(root, count: int, seed: int, size=lambda i: (32, 32)):
    """ROOT/<label>/<i>.png, `count` seeded random RGB images for each of the tiny model's labels (image i of
    size(i) = (height, width)): the labelled set `vitserve export --eval` reads. Returns `root`."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for label in TINY_LABELS:
        (root / label).mkdir()
        for i in range(count):
            Image.fromarray(rng.integers(0, 256, (*size(i), 3), np.uint8)).save(root / label / f"{i}.png")
    return root


@pytest.fixture(scope="session")
def labelled_folder_writer():
    """`write_labelled_folder`, for the tests of every folder (a conftest's functions are not importable by name
    from folders that have their own conftest)."""
    return write_labelled_folder

