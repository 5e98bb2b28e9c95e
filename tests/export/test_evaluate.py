import numpy as np
import torch

from export.evaluate import accuracy_at_sizes, benchmark, normalise


def test_accuracy_matches_pytorch_predictions(tiny_export, tiny_model):
    from model.data import resize_batch

    images = torch.randint(0, 256, (40, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        labels = tiny_model(torch.from_numpy(normalise(images, [0.5] * 3, [0.25] * 3))).argmax(1)
        small = resize_batch(images, (24, 24))
        expected_small = (tiny_model(torch.from_numpy(normalise(small, [0.5] * 3, [0.25] * 3))).argmax(1) == labels)
    rows = accuracy_at_sizes(tiny_export.path, images, labels, [(32, 32), (24, 24)], batch_size=16)
    assert [r["size"] for r in rows] == [[32, 32], [24, 24]]
    assert rows[0]["accuracy"] == 1.0 and rows[0]["images"] == 40
    assert rows[1]["accuracy"] == int(expected_small.sum()) / 40


def test_benchmark_rows(tiny_model):
    rows = benchmark(tiny_model, [1, 2], threads=1, min_seconds=0.05)
    keys = {(r["runtime"], r["rollout"], r["batch"]) for r in rows}
    assert keys == {(rt, ro, b) for rt in ("torch", "onnxruntime") for ro in (False, True) for b in (1, 2)}
    assert all(r["images_per_s"] > 0 and r["size"] == [32, 32] for r in rows)
    assert np.isfinite([r["images_per_s"] for r in rows]).all()


def test_bench_presets_are_the_exportable_ones():
    from export.presets import PRESETS
    from service.bench import PRESETS as BENCH_PRESETS

    assert set(BENCH_PRESETS) == set(PRESETS)
