import torch

from vitserve.evaluation.accuracy import accuracy_at_sizes
from vitserve.artifact import normalize_pixels


def test_accuracy_matches_pytorch_predictions(tiny_onnx, tiny_model):
    from vitserve.model.data import resize_batch

    def predict(images: torch.Tensor) -> torch.Tensor:
        return tiny_model(torch.from_numpy(normalize_pixels(images.numpy(), [0.5] * 3, [0.25] * 3))).argmax(1)

    images = torch.randint(0, 256, (40, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        labels = predict(images)
        expected_small = predict(resize_batch(images, (24, 24))) == labels
    rows = accuracy_at_sizes(tiny_onnx, images, labels, [(32, 32), (24, 24)], batch_size=16)
    assert [r["size"] for r in rows] == [[32, 32], [24, 24]]
    assert [r["trained_size"] for r in rows] == [[32, 32], [32, 32]]
    assert rows[0]["accuracy"] == 1.0 and rows[0]["images"] == 40
    assert rows[1]["accuracy"] == int(expected_small.sum()) / 40
