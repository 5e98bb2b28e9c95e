"""The second runtime (service/engine/openvino_runtime.py) and `--runtime auto` (service/engine/runtime.py):
OpenVINO answers as ONNX Runtime does, at any size, with the relevance path on ONNX Runtime; auto serves the declared
runtime only where it agrees with the file, and a recorded measurement picks the fastest by a margin; a precision the
CPU lacks is refused in one line."""
from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest

from vitserve.service.ground.errors import ModelLoadError
from vitserve.service.engine import runtime
from vitserve.service.engine.onnx_runtime import OnnxModel
from vitserve.service.engine import openvino_runtime
from vitserve.service.engine.openvino_runtime import auto_precisions
from vitserve.service.engine.runtime import load_model
from vitserve.service.engine.tuning import fastest
from vitserve.service.engine.inference_model import disagrees, probe_pixels
from service_fixtures import settings_for

openvino = pytest.importorskip("openvino")


def test_openvino_answers_as_onnx_runtime_at_any_size_and_explains_through_onnx_runtime(tiny_onnx):
    settings = settings_for(tiny_onnx, runtime="openvino")
    model, reference = load_model(settings), OnnxModel.load(settings_for(tiny_onnx))
    assert model.provider == "OpenVINO/CPU/fp32" and model.info == reference.info
    for shape in [(1, 3, 32, 32), (5, 3, 32, 32), (2, 3, 48, 40)]:
        x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
        (logits, rollout, *_), (want_logits, want_rollout, *_) = model.run(x), reference.run(x)
        assert logits.shape == want_logits.shape and rollout.shape == want_rollout.shape
        np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(rollout, want_rollout, rtol=1e-4, atol=1e-5)
    x = np.zeros((2, 3, 32, 32), np.float32)
    assert not model.relevance.made
    _, _, relevance, *_ = model.explain(x, np.array([-1, 1]))
    assert relevance.shape == (2, 4, 4) and model.relevance.made
    np.testing.assert_array_equal(relevance, reference.explain(x, np.array([-1, 1]))[2])


def test_a_precision_the_cpu_cannot_compute_is_refused_in_one_line(tiny_onnx):
    from vitserve.service.engine.openvino_runtime import cpu_capabilities

    if "BF16" in cpu_capabilities():
        pytest.skip("this CPU computes bfloat16: bf16 loads here")
    with pytest.raises(ModelLoadError, match="this CPU has no bfloat16 arithmetic"):
        load_model(settings_for(tiny_onnx, runtime="openvino", precision_hint="bf16"))
    with pytest.raises(ModelLoadError, match="precision bf16 needs the openvino runtime"):
        load_model(settings_for(tiny_onnx, runtime="onnxruntime", precision_hint="bf16"))


def test_bf16_compiles_to_bfloat16_where_the_cpu_has_it(tiny_onnx):
    from vitserve.service.engine import openvino_runtime

    if "BF16" not in openvino_runtime.cpu_capabilities():
        pytest.skip("this CPU has no bfloat16 arithmetic (AVX512-BF16 or AMX)")
    model = load_model(settings_for(tiny_onnx, runtime="openvino", precision_hint="bf16"))
    assert model.provider == "OpenVINO/CPU/bf16"
    assert openvino_runtime.compiled_precision(model.compiled) == "bf16"
    x = probe_pixels(model.info)
    got, want = model.run(x)[0], OnnxModel.load(settings_for(tiny_onnx)).run(x)[0]
    # bfloat16 really ran (float32 agrees to 1e-6 here), and within auto's gate
    assert 1e-4 < np.abs(got - want).max() < 0.05 * max(1.0, np.abs(want).max())
    assert disagrees(model, OnnxModel.load(settings_for(tiny_onnx))) == ""


def test_auto_tries_bf16_only_where_the_cpu_has_it_and_a_hint_narrows_it():
    assert auto_precisions("auto", {"FP32", "INT8"}) == ["fp32"]
    assert auto_precisions("auto", {"FP32", "BF16"}) == ["fp32", "bf16"]
    assert auto_precisions("bf16", {"FP32", "BF16"}) == ["bf16"]
    assert auto_precisions("bf16", {"FP32"}) == []


class Scripted:
    """A model whose logits are the reference's, permuted or not; its speed is what the test says."""

    def __init__(self, reference, permute=False):
        self.reference, self.info, self.permute, self.provider = reference, reference.info, permute, "x"

    def run(self, pixels):
        logits, rollout, *_ = self.reference.run(pixels)
        return (logits[:, ::-1] if self.permute else logits), rollout


def test_a_candidate_that_changes_the_answers_is_left_out(tiny_model):
    assert disagrees(Scripted(tiny_model), tiny_model) == ""
    assert "change class" in disagrees(Scripted(tiny_model, permute=True), tiny_model)


@pytest.mark.parametrize("costs, chosen", [({"onnxruntime/fp32": 1.0, "openvino/fp32": 0.5}, "openvino/fp32"),
                                           ({"onnxruntime/fp32": 1.0, "openvino/fp32": 0.95}, "onnxruntime/fp32"),
                                           ({"onnxruntime/fp32": 1.0, "openvino/fp32": 2.0}, "onnxruntime/fp32"),
                                           ({"onnxruntime/fp32": 1.0, "openvino/fp32": 0.8, "openvino/bf16": 0.3},
                                            "openvino/bf16"),
                                           # an int8 file is the reference as it is: 5% is within the margin
                                           ({"onnxruntime/int8": 1.0, "openvino/int8": 0.95,
                                             "openvino/int8+bf16": 1.2}, "onnxruntime/int8")])
def test_a_recorded_choice_keeps_onnx_runtime_unless_another_is_faster_by_the_margin(costs, chosen):
    assert fastest(costs) == chosen


def test_auto_serves_the_declared_runtime_checked_against_the_file(tiny_onnx, caplog):
    """No record: OpenVINO bf16 where this CPU computes bfloat16, ONNX Runtime otherwise; never timed."""
    with caplog.at_level(logging.INFO, logger="vitserve.runtime"):
        model = load_model(settings_for(tiny_onnx, runtime="auto"))
    plan = model.capabilities.plan
    assert plan is not None and plan.source == "declared"
    want_bf16 = openvino_runtime.computes_bf16()
    assert model.provider == ("OpenVINO/CPU/bf16" if want_bf16 else "CPUExecutionProvider"), plan
    assert "declared" in caplog.text and "ms per image" not in caplog.text
    x = np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(np.float32)
    got, want = model.run(x)[0], OnnxModel.load(settings_for(tiny_onnx)).run(x)[0]
    if want_bf16:  # bfloat16's 8-bit mantissa: the load's own gate
        assert np.abs(got - want).max() < 0.05 * max(1.0, np.abs(want).max())
    else:
        np.testing.assert_array_equal(got, want)


def test_a_declared_runtime_that_disagrees_with_the_file_gives_way_to_onnx_runtime(tiny_onnx, monkeypatch, caplog):
    monkeypatch.setattr(runtime, "disagrees", lambda model, reference: "3 of 5 clear probe images change class")
    monkeypatch.setattr(openvino_runtime, "computes_bf16", lambda: True)
    monkeypatch.setitem(runtime.RUNTIMES, "openvino", replace(openvino_runtime.OPENVINO, computes_bf16=lambda: True,
                                                               load=lambda settings, artifact: OnnxModel.load(
                                                                   settings, artifact)))
    with caplog.at_level(logging.WARNING, logger="vitserve.runtime"):
        model = load_model(settings_for(tiny_onnx, runtime="auto"))
    plan = model.capabilities.plan
    assert plan is not None and (plan.runtime, plan.precision_hint) == ("onnxruntime", "auto")
    assert "disagreed" in plan.why and "change class" in caplog.text


def test_compiling_leaves_the_threads_signal_stack_as_it_was(tiny_onnx):
    """OpenVINO's compile_model installs an alternate signal stack on the calling thread and leaves it; dropped with
    the model, the next SIGINT (CPython's handlers use SA_ONSTACK) crashed the process with SIGSEGV."""
    import ctypes
    import gc
    import os
    import signal
    import sys

    from vitserve.service.engine.openvino_runtime import _SignalStack

    if not sys.platform.startswith("linux"):
        pytest.skip("sigaltstack through libc: Linux")
    libc = ctypes.CDLL(None, use_errno=True)

    def signal_stack() -> tuple:
        now = _SignalStack()
        assert libc.sigaltstack(None, ctypes.byref(now)) == 0
        return (now.ss_sp, now.ss_size) if not now.ss_flags & 2 else None

    before = signal_stack()
    model = load_model(settings_for(tiny_onnx, runtime="auto"))
    model.run(np.zeros((2, 3, 32, 32), np.float32))
    assert signal_stack() == before
    del model
    gc.collect()
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        os.kill(os.getpid(), signal.SIGINT)  # with the stack left dangling this killed the test process
    finally:
        signal.signal(signal.SIGINT, previous)
    assert caught == [True]


def test_a_bfloat16_output_widens_to_float32_exactly():
    from vitserve.service.engine.openvino_runtime import widened_bfloat16

    values = np.array([[1.0, -2.5, 3.140625], [0.0, 1e-3, -65280.0]], np.float32)
    words = (values.view(np.uint32) >> 16).astype(np.uint16)  # these values are exact in bfloat16
    # OpenVINO's Python API types a bf16 tensor's 16-bit words as float16
    widened = widened_bfloat16(words.view(np.float16))
    assert widened.dtype == np.float32
    np.testing.assert_array_equal(widened, (words.astype(np.uint32) << 16).view(np.float32))
    np.testing.assert_array_equal(widened[0], values[0])


def test_bf16_keeps_the_residual_stream_in_bfloat16_when_the_file_has_an_embedding(tiny_onnx):
    """OpenVINO's CPU plugin computes in float32 everything it reaches walking back from a float32 output through
    element-wise and normalisation nodes; from the embedding that walk covered the whole residual stream
    (6-13% of the default model's bf16 batch). Asked for in bf16, the embedding leaves the LayerNorms in bf16."""
    from vitserve.service.engine import openvino_runtime

    if "BF16" not in openvino_runtime.cpu_capabilities():
        pytest.skip("this CPU has no bfloat16 arithmetic (AVX512-BF16 or AMX)")
    model = load_model(settings_for(tiny_onnx, runtime="openvino", precision_hint="bf16"))
    assert "embedding" in model.info.output_names()
    layer_norms = [op.get_rt_info()["runtimePrecision"].astype(str) for op in model.compiled.get_runtime_model()
                   .get_ordered_ops() if op.get_rt_info()["layerType"].astype(str) == "MVN"]
    assert layer_norms and set(layer_norms) == {"bf16"}, layer_norms
    x = probe_pixels(model.info)
    names = model.info.output_names()
    got = dict(zip(names, model.run(x)))
    want = dict(zip(names, OnnxModel.load(settings_for(tiny_onnx)).run(x)))
    assert got["embedding"].dtype == np.float32 and got["embedding"].shape == want["embedding"].shape
    scale = np.abs(want["embedding"]).max()
    assert np.abs(got["embedding"] - want["embedding"]).max() < 0.05 * scale


def test_an_int8_files_candidates_are_named_by_what_they_compute():
    """`chose onnxruntime/fp32` was once logged for an int8 file: the candidates are named by what they compute."""
    assert openvino_runtime.candidate_name("openvino", "int8", "fp32") == "openvino/int8"
    assert openvino_runtime.candidate_name("openvino", "int8", "bf16") == "openvino/int8+bf16"
    assert openvino_runtime.candidate_name("openvino", "fp32", "bf16") == "openvino/bf16"


def test_int8_on_a_cpu_without_dot_product_units_is_served_with_a_warning(tiny_model, caplog):
    from dataclasses import replace

    int8 = replace(tiny_model.info, precision="int8")
    with caplog.at_level(logging.WARNING, logger="vitserve.runtime"):
        assert not runtime.warn_if_int8_does_not_pay(int8, has_dot_product=lambda: True)
        assert not runtime.warn_if_int8_does_not_pay(tiny_model.info, has_dot_product=lambda: False)
        assert not caplog.records
        assert runtime.warn_if_int8_does_not_pay(int8, has_dot_product=lambda: False)
    assert "no int8 dot-product units" in caplog.text and "docs/int8.md" in caplog.text


def test_batch_runners_get_a_stream_each_with_their_threads_and_the_same_answers(tiny_onnx):
    """One stream runs one inference at a time: the batcher's two runners would take turns on it. With two runners
    the model compiles to two streams, the intra-op threads per inference (cores // runners) times two in all, and
    two inferences at once answer as one after the other do."""
    from concurrent.futures import ThreadPoolExecutor

    from vitserve.service.engine.inference_model import intra_op_threads

    settings = settings_for(tiny_onnx, runtime="openvino", batch_runners=2)  # one intra-op thread (settings_for)
    model = load_model(settings)
    assert int(model.compiled.get_property("NUM_STREAMS")) == 2
    assert int(model.compiled.get_property("INFERENCE_NUM_THREADS")) == 2 * intra_op_threads(settings) == 2
    one = load_model(settings_for(tiny_onnx, runtime="openvino"))
    assert int(one.compiled.get_property("NUM_STREAMS")) == 1
    images = [np.random.default_rng(i).standard_normal((3, 3, 32, 32)).astype(np.float32) for i in range(8)]
    alone = [model.run(x)[0] for x in images]
    with ThreadPoolExecutor(2) as runners:
        together = list(runners.map(lambda x: model.run(x)[0], images))
    for got, want, reference in zip(together, alone, (one.run(x)[0] for x in images)):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, reference)


def test_openvino_pins_its_threads_only_where_they_have_every_core(monkeypatch):
    """Each process pins from the first core: two workers' one-thread sessions pinned would share one core."""
    monkeypatch.setattr(openvino_runtime, "usable_cores", lambda: 2)
    assert openvino_runtime.pins_cores(0, 1) and openvino_runtime.pins_cores(2, 1) and openvino_runtime.pins_cores(1, 2)
    assert not openvino_runtime.pins_cores(1, 1)


def test_a_model_compiled_from_openvino_s_cache_answers_as_one_compiled_afresh(tiny_onnx, tmp_path):
    """The compiled-model cache sits beside the tuning records; a load that reads it back gives the same bits."""
    settings = settings_for(tiny_onnx, runtime="openvino", tuning_dir=tmp_path / "tuning")
    fresh = load_model(settings)
    assert list((tmp_path / "tuning" / "openvino").iterdir())  # written by the first compile
    cached = load_model(settings)
    x = np.random.default_rng(6).standard_normal((2, 3, 32, 32)).astype(np.float32)
    for a, b in zip(fresh.run(x), cached.run(x)):
        np.testing.assert_array_equal(a, b)
    assert openvino_runtime.compiled_model_cache(settings.model_copy(update={"tuning": "off"})) is None
