"""Datasets as uint8 tensors (N, C, H, W) at the training resolution, plus class names.

Fashion-MNIST comes from its IDX files (Debian's `dataset-fashion-mnist` installs them);
a user's own images come from an ImageFolder-style tree (one sub-folder per class),
decoded once with Pillow and split into train/validation with a seed.
"""
from __future__ import annotations

import gzip
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from vitserve.model.config import FASHION_MNIST_DIR, TrainingInputError

FASHION_MNIST_LABELS = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                        "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
# Per-pixel statistics of the 60,000 training images (scaled to [0, 1]).
FASHION_MNIST_MEAN, FASHION_MNIST_STD = [0.2860], [0.3530]
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"}

_IDX_DTYPES: dict[int, np.dtype] = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
                                    0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


@dataclass
class ImageDataset:
    images: torch.Tensor  # uint8 (N, C, H, W)
    labels: torch.Tensor  # int64 (N,)
    classes: list[str]

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class DataSplits:
    train: ImageDataset
    test: ImageDataset  # the held-out split accuracy is reported on
    mean: list[float]
    std: list[float]


def labelled_share(dataset: ImageDataset, fraction: float, seed: int) -> ImageDataset:
    """`fraction` of each class's images (at least one), chosen at random with `seed`, in their original order."""
    generator = torch.Generator().manual_seed(seed)
    kept = []
    for label in torch.unique(dataset.labels):
        members = torch.nonzero(dataset.labels == label).flatten()
        count = max(1, round(len(members) * fraction))
        kept.append(members[torch.randperm(len(members), generator=generator)[:count]])
    index = torch.cat(kept).sort().values
    return ImageDataset(dataset.images[index], dataset.labels[index], dataset.classes)


def read_idx(path: str | Path) -> np.ndarray:
    """Reads an IDX file (LeCun's MNIST format), gzipped or not."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file")
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    array = np.frombuffer(data, dtype=_IDX_DTYPES[dtype_code], offset=4 + 4 * ndim)
    if array.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape}, file holds {array.size} values")
    return array.reshape(shape)


def _find_idx(data_dir: Path, stem: str) -> Path:
    for name in (f"{stem}.gz", stem):
        if (data_dir / name).is_file():
            return data_dir / name
    raise FileNotFoundError(
        f"{data_dir / stem}[.gz] not found; install Debian's dataset-fashion-mnist or pass --data-dir")


def fashion_mnist_test_images(data_dir: str | Path = FASHION_MNIST_DIR) -> torch.Tensor:
    """The 10,000 test images alone, uint8 (N, 1, 28, 28); FileNotFoundError without the dataset."""
    return torch.from_numpy(read_idx(_find_idx(Path(data_dir), "t10k-images-idx3-ubyte")).copy()).unsqueeze(1)


def load_fashion_mnist(data_dir: str | Path = FASHION_MNIST_DIR) -> DataSplits:
    data_dir = Path(data_dir)

    def split(prefix: str) -> ImageDataset:
        images = read_idx(_find_idx(data_dir, f"{prefix}-images-idx3-ubyte"))
        labels = read_idx(_find_idx(data_dir, f"{prefix}-labels-idx1-ubyte"))
        return ImageDataset(torch.from_numpy(images.copy()).unsqueeze(1),  # (N, 1, 28, 28)
                            torch.from_numpy(labels.astype(np.int64)), list(FASHION_MNIST_LABELS))

    return DataSplits(split("train"), split("t10k"), FASHION_MNIST_MEAN, FASHION_MNIST_STD)


def load_image(path: str | Path, size: tuple[int, int], channels: int) -> np.ndarray:
    """Decode, apply EXIF orientation, resize the short side and centre-crop: uint8 (C, H, W)."""
    with Image.open(path) as file:
        im = ImageOps.exif_transpose(file).convert("L" if channels == 1 else "RGB")
        im = ImageOps.fit(im, (size[1], size[0]), Image.Resampling.BICUBIC)
        array = np.asarray(im, dtype=np.uint8)
    return array[None] if channels == 1 else array.transpose(2, 0, 1)


def load_image_folder(root: str | Path, size: tuple[int, int], channels: int = 3,
                      val_fraction: float = 0.1, seed: int = 0,
                      mean: list[float] | None = None, std: list[float] | None = None) -> DataSplits:
    """root/<class>/<image>; classes sorted by folder name, a seeded stratified validation split.

    With val_fraction > 0 every class holds out round(n * val_fraction) images, at least one and at most n - 1,
    so a class needs two images; TrainingInputError says which classes have fewer, or that root is no folder.
    """
    files = class_files(Path(root))
    classes = sorted(files)
    if val_fraction > 0 and (short := [f"{name!r} ({len(files[name])})" for name in classes if len(files[name]) < 2]):
        raise TrainingInputError(f"{root}: every class needs at least 2 images, one to train on and one to hold out "
                                 f"for validation; too few in {', '.join(short)}")
    rng = np.random.default_rng(seed)
    parts: dict[str, tuple[list[np.ndarray], list[int]]] = {"train": ([], []), "val": ([], [])}
    for index, name in enumerate(classes):
        order = rng.permutation(len(files[name]))
        n_val = min(len(order) - 1, max(1, round(len(order) * val_fraction))) if val_fraction > 0 else 0
        for rank, i in enumerate(order):
            images, labels = parts["val" if rank < n_val else "train"]
            images.append(_decode(files[name][i], size, channels))
            labels.append(index)

    def dataset(key: str) -> ImageDataset:
        images, labels = parts[key]
        stacked = torch.from_numpy(np.stack(images)) if images else torch.zeros(0, channels, *size, dtype=torch.uint8)
        return ImageDataset(stacked, torch.tensor(labels, dtype=torch.int64), classes)

    default_mean, default_std = (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else ([0.5], [0.5])
    return DataSplits(dataset("train"), dataset("val"), mean or default_mean, std or default_std)


def class_files(root: Path) -> dict[str, list[Path]]:
    """{class folder name: its image files, sorted}; hidden folders (.git, .ipynb_checkpoints) are not classes."""
    if not root.is_dir():
        raise TrainingInputError(f"{root}: no such directory (an image folder has one sub-folder of images per class)")
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise TrainingInputError(f"{root} has no class sub-folders (one folder of images per class)")
    files = {f.name: sorted(p for p in f.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
             for f in folders}
    if empty := [name for name, paths in files.items() if not paths]:
        raise TrainingInputError(f"{root}: no images ({', '.join(sorted(IMAGE_SUFFIXES))}) in the class folder(s) "
                                 f"{', '.join(map(repr, empty))}")
    return files


def _decode(path: Path, size: tuple[int, int], channels: int) -> np.ndarray:
    try:
        return load_image(path, size, channels)
    except OSError as e:  # PIL's UnidentifiedImageError and truncated files are OSErrors
        raise TrainingInputError(f"{path}: not a readable image ({e})") from e


def resize_batch(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 (N, C, h, w) -> uint8 (N, C, H, W), bicubic; used to train or evaluate at another resolution."""
    if tuple(images.shape[-2:]) == tuple(size):
        return images
    out = torch.nn.functional.interpolate(images.float(), size=size, mode="bicubic", align_corners=False)
    return out.round().clamp(0, 255).to(torch.uint8)


def resize_to_grid(x: torch.Tensor, side: int) -> torch.Tensor:
    """float (B, C, H, W) -> (B, C, side, side), antialiased bilinear: what Pillow's BILINEAR resize, which the
    server uses to answer at a smaller grid, makes of an image (bicubic without antialiasing would alias)."""
    if tuple(x.shape[-2:]) == (side, side):
        return x
    return torch.nn.functional.interpolate(x, size=(side, side), mode="bilinear", antialias=True,
                                           align_corners=False)


def images_at_grid(images: torch.Tensor, side: int) -> torch.Tensor:
    """uint8 (N, C, H, W) -> uint8 (N, C, side, side), as `resize_to_grid` and rounded as Pillow rounds."""
    return resize_to_grid(images.float(), side).round().clamp(0, 255).to(torch.uint8)
