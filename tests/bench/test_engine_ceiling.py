"""`python -m vitserve.bench.engine_ceiling`: the zero-cost model is a real artifact the server loads, and a short level
through a real engine process counts images and CPU."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("onnx")


def test_the_zero_cost_model_is_an_artifact_that_computes_its_means(tmp_path):
    from vitserve.bench.engine_ceiling import IMAGE, zero_cost_model
    from vitserve.service.engine.onnx_runtime import OnnxModel
    from vitserve.service.ground.settings import Settings

    path = zero_cost_model(tmp_path / "zero.onnx")
    model = OnnxModel.load(Settings(model_path=path, providers=["cpu"], runtime="onnxruntime"))
    assert model.info.name == "zero" and model.info.image_size == IMAGE[1:]
    pixels = np.arange(3 * 64, dtype=np.float32).reshape(3, *IMAGE)
    logits, rollout, *_ = model.run(pixels)
    np.testing.assert_allclose(logits, np.repeat(pixels.mean(axis=(1, 2, 3))[:, None], 2, axis=1))
    assert rollout.shape == (3, 1, 1)


@pytest.mark.slow
def test_a_short_level_through_a_real_engine_process_counts_images(tmp_path):
    from vitserve.bench.engine_ceiling import main

    out = tmp_path / "ceiling.json"
    assert main(["--levels", "1x4", "--seconds", "0.5", "--max-batch-size", "8", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["submitters"] == 1 and row["in_flight_each"] == 4 and row["images"] > 0
    assert row["engine_cpu_us_per_image"] > 0 and row["submitter_cpu_us_per_image"] > 0
