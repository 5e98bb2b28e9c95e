"""The artifact taken apart at load (service/engine/graph_paths.py): the fast path and the relevance path as graphs
of their own, each giving the one file's answers bit for bit; the CUDA graphs' batch buckets."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from vitserve.service.engine.cuda_graphs import bucket_sizes
from vitserve.service.engine.graph_paths import split_paths, symbolic_dims
from vitserve.service.engine.onnx_runtime import OnnxModel
from service_fixtures import settings_for
from vitserve.artifact import EMBEDDING_NAME, INPUT_NAME, OUTPUT_NAMES, RELEVANCE_NAME, TARGET_NAME

ort = pytest.importorskip("onnxruntime")


def whole_file_session(path):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def test_the_file_splits_into_a_fast_graph_without_control_flow_and_a_relevance_graph(tiny_onnx):
    paths = split_paths(onnx.load(str(tiny_onnx)))
    fast, relevance = paths.fast.graph, paths.relevance.graph
    assert [o.name for o in fast.output] == [*OUTPUT_NAMES, EMBEDDING_NAME]
    assert [i.name for i in fast.input] == [INPUT_NAME]
    assert "If" not in {n.op_type for n in fast.node} and "If" not in {n.op_type for n in relevance.node}
    assert [o.name for o in relevance.output] == [*OUTPUT_NAMES, RELEVANCE_NAME, EMBEDDING_NAME]
    assert [i.name for i in relevance.input] == [INPUT_NAME, TARGET_NAME]
    assert TARGET_NAME not in {t.name for t in relevance.initializer}  # required, not the empty default
    # the fast graph carries none of the gradient graph's weights or nodes
    assert len(fast.node) < len(relevance.node)
    assert symbolic_dims(paths) == ("batch", "height", "width")
    onnx.checker.check_model(paths.fast)
    onnx.checker.check_model(paths.relevance)


@pytest.mark.parametrize("batch, height, width", [(1, 32, 32), (3, 32, 32), (16, 32, 32), (2, 48, 40),
                                                   (1, 64, 64), (5, 16, 32)])
def test_the_split_paths_answer_as_the_file_does_bit_for_bit(tiny_onnx, batch, height, width):
    model, whole = OnnxModel.load(settings_for(tiny_onnx)), whole_file_session(tiny_onnx)
    x = np.random.default_rng(batch * height).standard_normal((batch, 3, height, width)).astype(np.float32)
    ran = model.run(x)
    assert len(ran) == 3  # logits, rollout, embedding
    for mine, theirs in zip(ran, whole.run([*OUTPUT_NAMES, EMBEDDING_NAME], {INPUT_NAME: x})):
        assert mine.shape == theirs.shape and np.array_equal(mine, theirs)
    targets = np.arange(batch, dtype=np.int64) % 4 - 1  # -1 (the top-1) and classes 0-2
    explained = model.explain(x, targets)
    expected = whole.run([*OUTPUT_NAMES, RELEVANCE_NAME, EMBEDDING_NAME], {INPUT_NAME: x, TARGET_NAME: targets})
    assert len(explained) == len(expected) == 4
    for mine, theirs in zip(explained, expected):
        assert mine.shape == theirs.shape and np.array_equal(mine, theirs)


def test_the_relevance_session_is_made_only_when_a_request_asks_for_it(tiny_onnx):
    model = OnnxModel.load(settings_for(tiny_onnx))
    assert not model.relevance.made
    model.run(np.zeros((1, 3, 32, 32), np.float32))
    assert not model.relevance.made
    model.explain(np.zeros((1, 3, 32, 32), np.float32), np.array([-1]))
    first = model.relevance_session()
    assert model.relevance.made
    model.explain(np.zeros((2, 3, 32, 32), np.float32), np.array([0, 1]))
    assert model.relevance_session() is first  # made once


def test_a_file_without_the_relevance_path_is_its_own_fast_graph(tiny_checkpoint, tmp_path):
    from vitserve.export.onnx_export import export_onnx

    path = tmp_path / "fast-only.onnx"
    export_onnx(tiny_checkpoint, path, verify=False, relevance=False, inspection_images=0)
    proto = onnx.load(str(path))
    paths = split_paths(proto)
    assert paths.relevance is None and paths.fast is proto
    model = OnnxModel.load(settings_for(path))
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    assert all(np.array_equal(a, b) for a, b in zip(model.run(x), whole_file_session(path).run(
        list(OUTPUT_NAMES), {INPUT_NAME: x})))
    with pytest.raises(Exception, match="no relevance path"):
        model.explain(x, np.array([-1, -1]))


@pytest.mark.parametrize("largest, buckets", [(1, [1]), (2, [1, 2]), (16, [1, 2, 4, 8, 16]),
                                              (12, [1, 2, 4, 8, 12]), (64, [1, 2, 4, 8, 16, 32, 64])])
def test_cuda_graph_buckets_pad_a_batch_to_at_most_twice_its_size(largest, buckets):
    assert bucket_sizes(largest) == buckets


def test_a_batch_runs_captured_only_where_its_bucket_was_kept():
    """Buckets 1, 2, 4 captured at load; 4 lost to the dynamic session and was dropped: a batch of 3 or 4 (bucket
    4) and any other image size run dynamic, a batch of 1 or 2 runs its graph."""
    from vitserve.service.engine.cuda_graphs import CudaGraphBuckets

    class Bucket:
        def __init__(self, size):
            self.size = size

        def run(self, pixels, fill=None):
            return [np.full((len(pixels), 1), self.size)]

    graphs = CudaGraphBuckets({1: Bucket(1), 2: Bucket(2)}, [4, 1, 2], (3, 32, 32), {4: (2.0, 1.0)})
    batch = lambda n, size=32: np.zeros((n, 3, size, size), np.float32)  # noqa: E731
    assert [graphs.covers(batch(n)) for n in (1, 2, 3, 4, 5)] == [True, True, False, False, False]
    assert not graphs.covers(batch(1, 48)) and not graphs.covers(batch(0))
    assert graphs.run(batch(1))[0].tolist() == [[1]] and graphs.run(batch(2))[0].tolist() == [[2], [2]]


@pytest.mark.parametrize("step, largest, sizes", [
    (8, 64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]), (8, 12, [1, 2, 4, 8, 12]), (4, 16, [1, 2, 4, 8, 12, 16]),
    (1, 5, [1, 2, 3, 4, 5]), (0, 5, [1, 2, 3, 4, 5])])
def test_a_gpu_batch_on_a_dynamic_session_pads_to_few_sizes_never_below_it_nor_past_the_largest(step, largest, sizes):
    from vitserve.service.engine.cuda_graphs import padded_size

    padded = [padded_size(count, step, largest) for count in range(1, largest + 1)]
    assert sorted(set(padded)) == sizes
    assert all(count <= size <= largest for count, size in zip(range(1, largest + 1), padded))
    assert padded_size(20, 8, 64) == 24 and padded_size(3, 8, 64) == 4 and padded_size(1, 8, 64) == 1


class SeenBatches:
    """A session that records the batch size of every call it is given, and makes it."""

    def __init__(self, session):
        self.session, self.batches = session, []

    def run(self, names, feeds, *args):
        self.batches.append(len(feeds[INPUT_NAME]))
        return self.session.run(names, feeds, *args)

    def __getattr__(self, name):
        return getattr(self.session, name)


def test_a_padded_batch_answers_as_the_unpadded_one_and_load_runs_each_padded_size_twice(tiny_model):
    """The padding a GPU's dynamic session gets (`gpu_batch_step`), forced on the CPU session: here is where it ran
    (no GPU). The session sees the padded batch; the caller gets its own rows, as without the padding; `warm_up`
    runs every size the model pads to, twice, beside the ones it is asked for."""
    from vitserve.service.engine.cuda_graphs import CudaGraphBuckets
    from vitserve.service.engine.runtime import warm_up

    assert tiny_model.batch_step == 0 and tiny_model.padded_batch_sizes == []  # on the CPU, nothing padded
    seen = SeenBatches(tiny_model.session)
    padded = OnnxModel(seen, tiny_model.info)
    padded.batch_step, padded.max_batch_size = 8, 16
    pixels = np.random.default_rng(3).normal(size=(3, 3, 32, 32)).astype(np.float32)
    for plain, from_padded in zip(tiny_model.run(pixels), padded.run(pixels)):
        assert from_padded.shape == plain.shape
        np.testing.assert_allclose(from_padded, plain, rtol=1e-5, atol=1e-6)
    assert seen.batches == [4]
    assert padded.padded_batch_sizes == [1, 2, 4, 8, 16]
    # buckets 1 and 2 captured: the sizes they cover never reach the dynamic session
    padded.captured = CudaGraphBuckets({1: object(), 2: object()}, [1, 2, 4, 8, 16], (3, 32, 32))  # type: ignore
    assert padded.padded_batch_sizes == [4, 8, 16]
    padded.captured, seen.batches = None, []
    padded.capabilities = padded.declared_capabilities()  # as `OnnxModel.load` declares them, once it has made them
    assert padded.capabilities.padded_batch_sizes == (1, 2, 4, 8, 16)
    assert warm_up(padded, [1, 16]) == [1, 2, 4, 8, 16]
    assert seen.batches == [1, 1, 16, 16, 2, 2, 4, 4, 8, 8]  # the sizes asked for first: 1 and the largest
