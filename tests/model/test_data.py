"""Data readers on tiny files written by the tests: IDX (plain and gzipped), Fashion-MNIST, image folders."""
from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from vitserve.model.config import TrainingInputError
from vitserve.model.data import (FASHION_MNIST_LABELS, IMAGENET_MEAN, IMAGENET_STD, load_fashion_mnist, load_image,
                        load_image_folder, read_idx, resize_batch)


def write_idx(path, array: np.ndarray, code: int = 0x08) -> None:
    """LeCun's IDX: two zero bytes, a type code, the number of dimensions, big-endian sizes, then the data."""
    payload = struct.pack(">HBB", 0, code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(payload)


@pytest.mark.parametrize("name", ["images-idx3-ubyte", "images-idx3-ubyte.gz"])
def test_read_idx_uint8(tmp_path, name):
    array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / name, array)
    out = read_idx(tmp_path / name)
    assert out.dtype == np.uint8 and out.shape == (2, 3, 4)
    np.testing.assert_array_equal(out, array)


def test_read_idx_big_endian_types(tmp_path):
    ints = np.array([[-5, 70000], [1, 2]], dtype=">i4")
    write_idx(tmp_path / "ints", ints, code=0x0C)
    np.testing.assert_array_equal(read_idx(tmp_path / "ints"), [[-5, 70000], [1, 2]])
    floats = np.array([0.5, -2.25, 3.0], dtype=">f4")
    write_idx(tmp_path / "floats.gz", floats, code=0x0D)
    np.testing.assert_array_equal(read_idx(tmp_path / "floats.gz"), [0.5, -2.25, 3.0])
    labels = np.array([3, 1, 4, 1, 5], dtype=np.uint8)
    write_idx(tmp_path / "labels", labels)
    assert read_idx(tmp_path / "labels").tolist() == [3, 1, 4, 1, 5]


def test_read_idx_rejects_bad_files(tmp_path):
    (tmp_path / "png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(16))
    with pytest.raises(ValueError, match="is not an IDX file"):
        read_idx(tmp_path / "png")
    (tmp_path / "code").write_bytes(struct.pack(">HBBI", 0, 0x07, 1, 2) + b"\x01\x02")
    with pytest.raises(ValueError, match="is not an IDX file"):
        read_idx(tmp_path / "code")
    (tmp_path / "short").write_bytes(struct.pack(">HBBII", 0, 0x08, 2, 3, 3) + bytes(8))
    with pytest.raises(ValueError, match=r"header says \(3, 3\), file holds 8 values"):
        read_idx(tmp_path / "short")


@pytest.fixture
def fake_fashion_mnist(tmp_path):
    """Six training and four test images, 28x28; training files gzipped, test files plain (both occur)."""
    rng = np.random.default_rng(0)
    train = rng.integers(0, 256, (6, 28, 28), dtype=np.uint8)
    test = rng.integers(0, 256, (4, 28, 28), dtype=np.uint8)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", train)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.array([0, 1, 2, 9, 9, 5], dtype=np.uint8))
    write_idx(tmp_path / "t10k-images-idx3-ubyte", test)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.array([7, 8, 0, 3], dtype=np.uint8))
    return tmp_path, train, test


def test_load_fashion_mnist(fake_fashion_mnist):
    directory, train, test = fake_fashion_mnist
    splits = load_fashion_mnist(directory)
    assert splits.train.images.shape == (6, 1, 28, 28) and splits.train.images.dtype == torch.uint8
    assert splits.test.images.shape == (4, 1, 28, 28)
    assert torch.equal(splits.train.images[:, 0], torch.from_numpy(train))
    assert torch.equal(splits.test.images[:, 0], torch.from_numpy(test))
    assert splits.train.labels.dtype == torch.int64
    assert splits.train.labels.tolist() == [0, 1, 2, 9, 9, 5] and splits.test.labels.tolist() == [7, 8, 0, 3]
    assert splits.train.classes == FASHION_MNIST_LABELS and len(FASHION_MNIST_LABELS) == 10
    assert FASHION_MNIST_LABELS[0] == "T-shirt/top" and FASHION_MNIST_LABELS[9] == "Ankle boot"
    assert (splits.mean, splits.std) == ([0.2860], [0.3530])
    assert len(splits.train) == 6
    splits.train.images[0, 0, 0, 0] = 1  # writable: a copy, not a view of read-only file bytes


def test_load_fashion_mnist_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte.*dataset-fashion-mnist"):
        load_fashion_mnist(tmp_path)


def save_png(path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


@pytest.fixture
def image_folder(tmp_path):
    """Classes 'cat' (10 images), 'ant' (5, one in a sub-folder), 'bee' (2): solid grey levels 10, 20, 30."""
    root = tmp_path / "folder"
    for name, count, level in [("cat", 10, 30), ("ant", 5, 10), ("bee", 2, 20)]:
        for i in range(count):
            sub = root / name / ("nested" if name == "ant" and i == 0 else "")
            save_png(sub / f"{i}.png", np.full((30 + i, 40, 3), level, dtype=np.uint8))
    (root / "cat" / "notes.txt").write_text("not an image")
    (root / "README").write_text("a file beside the class folders is ignored")
    (root / ".ipynb_checkpoints").mkdir()  # a hidden folder is not a class
    return root


def test_load_image_folder(image_folder):
    splits = load_image_folder(image_folder, (16, 24), channels=3, val_fraction=0.2, seed=0)
    assert splits.train.classes == ["ant", "bee", "cat"] == splits.test.classes
    # val: round(5 * 0.2) = 1 ant, round(2 * 0.2) = 0 bees raised to 1 (every class holds one out),
    # round(10 * 0.2) = 2 cats
    assert splits.train.images.shape == (13, 3, 16, 24) and splits.test.images.shape == (4, 3, 16, 24)
    assert splits.train.images.dtype == torch.uint8 and splits.train.labels.dtype == torch.int64
    assert torch.bincount(splits.train.labels, minlength=3).tolist() == [4, 1, 8]
    assert torch.bincount(splits.test.labels, minlength=3).tolist() == [1, 1, 2]
    for split in (splits.train, splits.test):
        for label, level in enumerate([10, 20, 30]):
            images = split.images[split.labels == label]
            assert torch.equal(images, torch.full_like(images, level))
    assert (splits.mean, splits.std) == (IMAGENET_MEAN, IMAGENET_STD)


def test_load_image_folder_grey_and_repeatable(image_folder):
    a = load_image_folder(image_folder, (8, 8), channels=1, val_fraction=0.5, seed=0)
    b = load_image_folder(image_folder, (8, 8), channels=1, val_fraction=0.5, seed=0)
    assert torch.equal(a.train.images, b.train.images) and torch.equal(a.test.labels, b.test.labels)
    # val: round(2.5) = 2 ants (round half to even), 1 bee, 5 cats
    assert a.train.images.shape == (9, 1, 8, 8) and a.test.images.shape == (8, 1, 8, 8)
    assert torch.bincount(a.test.labels, minlength=3).tolist() == [2, 1, 5]
    assert (a.mean, a.std) == ([0.5], [0.5])


def test_load_image_folder_split_depends_on_seed(tmp_path):
    root = tmp_path / "numbered"
    for i in range(20):
        save_png(root / "only" / f"{i:02d}.png", np.full((4, 4), i * 10, dtype=np.uint8))
    val = {seed: sorted(load_image_folder(root, (4, 4), 1, 0.25, seed).test.images[:, 0, 0, 0].tolist())
           for seed in (0, 1)}
    assert len(val[0]) == 5 and val[0] != val[1]
    assert set(val[0]) <= {i * 10 for i in range(20)}


def test_load_image_folder_options(image_folder, tmp_path):
    splits = load_image_folder(image_folder, (8, 8), channels=1, val_fraction=0.0, mean=[0.1], std=[0.2])
    assert len(splits.train) == 17 and len(splits.test) == 0
    assert splits.test.images.shape == (0, 1, 8, 8) and splits.test.images.dtype == torch.uint8
    assert (splits.mean, splits.std) == ([0.1], [0.2])
    (tmp_path / "empty" / ".hidden").mkdir(parents=True)
    with pytest.raises(TrainingInputError, match="has no class sub-folders"):
        load_image_folder(tmp_path / "empty", (8, 8))
    with pytest.raises(TrainingInputError, match="no such directory"):
        load_image_folder(tmp_path / "missing", (8, 8))


@pytest.mark.parametrize("count, held_out", [(2, 1), (3, 1), (4, 1), (9, 1), (15, 2), (16, 2)])
def test_every_class_holds_out_one_image_at_least_and_keeps_one(tmp_path, count, held_out):
    for name in ("a", "b"):
        for i in range(count):
            save_png(tmp_path / name / f"{i}.png", np.full((4, 4), i, dtype=np.uint8))
    splits = load_image_folder(tmp_path, (4, 4), 1, val_fraction=0.1)
    assert torch.bincount(splits.test.labels, minlength=2).tolist() == [held_out, held_out]
    assert torch.bincount(splits.train.labels, minlength=2).tolist() == [count - held_out] * 2
    nearly_all = load_image_folder(tmp_path, (4, 4), 1, val_fraction=0.99)
    assert torch.bincount(nearly_all.train.labels, minlength=2).tolist() == [1, 1]


def test_a_class_of_one_image_or_none_is_named(image_folder):
    (image_folder / "bee" / "1.png").unlink()
    with pytest.raises(TrainingInputError, match=r"every class needs at least 2 images, one to train on and one to "
                                                 r"hold out for validation; too few in 'bee' \(1\)$"):
        load_image_folder(image_folder, (8, 8), val_fraction=0.1)
    assert len(load_image_folder(image_folder, (8, 8), val_fraction=0.0).train) == 16  # nothing held out: it trains
    (image_folder / "bee" / "0.png").unlink()
    with pytest.raises(TrainingInputError, match=r"no images \(.*\) in the class folder\(s\) 'bee'$"):
        load_image_folder(image_folder, (8, 8), val_fraction=0.1)


def test_load_image_resizes_short_side_and_centre_crops(tmp_path):
    array = np.zeros((20, 40, 3), dtype=np.uint8)  # 40 wide, 20 tall: left half black, right half white
    array[:, 20:] = 255
    save_png(tmp_path / "half.png", array)
    out = load_image(tmp_path / "half.png", (10, 10), channels=3)
    assert out.shape == (3, 10, 10) and out.dtype == np.uint8
    # The centre 20x20 is kept: its left half black, its right half white.
    assert (out[:, :, :4] == 0).all() and (out[:, :, 6:] == 255).all()
    grey = load_image(tmp_path / "half.png", (10, 20), channels=1)
    assert grey.shape == (1, 10, 20)
    assert (grey[:, :, :8] == 0).all() and (grey[:, :, 12:] == 255).all()


def test_load_image_converts_modes(tmp_path):
    save_png(tmp_path / "red.png", np.tile(np.array([255, 0, 0], dtype=np.uint8), (4, 4, 1)))
    grey = load_image(tmp_path / "red.png", (4, 4), channels=1)
    assert (grey == 76).all()  # ITU-R 601 luma of pure red: 255 * 299 / 1000
    save_png(tmp_path / "grey.png", np.full((4, 4), 9, dtype=np.uint8))
    rgb = load_image(tmp_path / "grey.png", (4, 4), channels=3)
    assert rgb.shape == (3, 4, 4) and (rgb == 9).all()


def test_resize_batch():
    images = torch.randint(0, 256, (2, 3, 8, 6), dtype=torch.uint8)
    assert resize_batch(images, (8, 6)) is images
    out = resize_batch(images, (12, 10))
    assert out.shape == (2, 3, 12, 10) and out.dtype == torch.uint8
    reference = F.interpolate(images.float(), size=(12, 10), mode="bicubic", align_corners=False)
    assert torch.equal(out, reference.round().clamp(0, 255).to(torch.uint8))
    flat = torch.full((1, 1, 5, 5), 77, dtype=torch.uint8)
    assert torch.equal(resize_batch(flat, (9, 3)), torch.full((1, 1, 9, 3), 77, dtype=torch.uint8))
    edges = torch.zeros(1, 1, 4, 4, dtype=torch.uint8)
    edges[..., ::2] = 255  # bicubic overshoots here: the result must be clamped, not wrapped
    up = resize_batch(edges, (8, 8))
    assert up.max() == 255 and up.min() == 0
