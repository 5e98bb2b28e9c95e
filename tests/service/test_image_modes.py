"""Every image mode Pillow reads gives the model what its 8-bit original gives: 16- and 32-bit values by their
range (never clipped), float values by theirs, transparency composed over white, CMYK and YCbCr by Pillow's own
conversion. Each case is made by code from an 8-bit original and compared through `prepare_image`."""
from __future__ import annotations

import gzip
import io
import struct
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from PIL import Image

from vitserve.service.usecases.preprocess import prepare_image, to_channels
from vitserve.artifact import ModelInfo
from service_fixtures import REPO, settings_for

SIZE = (32, 32)  # the tiny model's input: no resize, so the comparison is of the conversion alone
INFO_L = ModelInfo(name="grey", version="1", labels=["a", "b"], patch_size=8, image_size=SIZE, channels=1,
                   mean=[0.5], std=[0.25])
FIT = dict(resize="fit", max_bytes=10**7, max_pixels=10**7, max_tokens=64)
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")  # Debian's dataset-fashion-mnist (as model/config.py)
FMNIST_MODEL = REPO / "models" / "vit-fmnist" / "model.onnx"

rng = np.random.default_rng(11)
# Grey and colour originals with structure (a gradient) and noise; both hold 0 and 255, so min-max is exact.
GREY = (np.add.outer(np.arange(32), np.arange(32)) * 4 + rng.integers(0, 8, SIZE)).clip(0, 255).astype(np.uint8)
GREY[0, 0], GREY[-1, -1] = 0, 255
COLOUR = np.stack([GREY, 255 - GREY, rng.integers(0, 256, SIZE, dtype=np.uint8)], axis=-1)
ALPHA = rng.choice(np.array([0, 255, 255, 128, 40, 200], np.uint8), SIZE)  # opaque, transparent and partial
PALETTE = rng.integers(0, 256, (16, 3), dtype=np.uint8)  # 16 colours for palette images
INDICES = (GREY // 16).astype(np.uint8)  # (H, W) palette indices, all 16 used


def encode(image: Image.Image, fmt: str, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save)
    return buffer.getvalue()


def over_white(colour: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """The documented composition: (colour * alpha + 255 * (255 - alpha)) / 255, rounded."""
    a = alpha.astype(int)[..., None] if colour.ndim == 3 else alpha.astype(int)
    return ((colour.astype(int) * a + 255 * (255 - a) + 127) // 255).astype(np.uint8)


def palette_image(transparency=None) -> Image.Image:
    image = Image.fromarray(INDICES, "P")
    image.putpalette(PALETTE.ravel().tolist())
    if transparency is not None:
        image.info["transparency"] = transparency
    return image


def tiff_of(array: np.ndarray, mode: str) -> bytes:
    return encode(Image.frombytes(mode, SIZE[::-1], array.tobytes()), "TIFF")


def sixteen_bit(array: np.ndarray) -> Image.Image:
    return Image.fromarray(array.astype(np.uint16) * 257)  # mode I;16: v * 257 is v on the full 16-bit scale


KEY = 7  # the palette index made transparent (all 16 indices are used)
GREY_KEYED = np.where(GREY == GREY[3, 3], 255, GREY).astype(np.uint8)  # GREY with its value at (3, 3) as the tRNS key
ONE_BIT = Image.fromarray(GREY).convert("1", dither=Image.Dither.NONE)  # a threshold at 128, no dithering
PARTIAL_PALETTE_ALPHA = bytes([0, 255, 128, 40] * 4)  # per palette entry

# id -> (the file's bytes, the 8-bit original it must prepare like, as an array)
CASES: dict[str, Callable[[], tuple[bytes, np.ndarray]]] = {
    "1-png": lambda: (encode(ONE_BIT, "PNG"), np.where(GREY >= 128, 255, 0)),
    "1-bmp": lambda: (encode(ONE_BIT, "BMP"), np.where(GREY >= 128, 255, 0)),
    "L-tiff": lambda: (encode(Image.fromarray(GREY), "TIFF"), GREY),
    "L-trns-png": lambda: (encode(Image.fromarray(GREY), "PNG", transparency=int(GREY[3, 3])), GREY_KEYED),
    "LA-png": lambda: (encode(Image.fromarray(np.stack([GREY, ALPHA], -1), "LA"), "PNG"), over_white(GREY, ALPHA)),
    "LA-tiff": lambda: (encode(Image.fromarray(np.stack([GREY, ALPHA], -1), "LA"), "TIFF"), over_white(GREY, ALPHA)),
    "P-png": lambda: (encode(palette_image(), "PNG"), PALETTE[INDICES]),
    "P-gif": lambda: (encode(palette_image(), "GIF"), PALETTE[INDICES]),
    "P-bmp": lambda: (encode(palette_image(), "BMP"), PALETTE[INDICES]),
    "P-trns-png": lambda: (encode(palette_image(KEY), "PNG", transparency=KEY),
                           np.where((INDICES == KEY)[..., None], 255, PALETTE[INDICES])),
    "P-trns-gif": lambda: (encode(palette_image(KEY), "GIF", transparency=KEY),
                           np.where((INDICES == KEY)[..., None], 255, PALETTE[INDICES])),
    "P-alpha-png": lambda: (encode(palette_image(), "PNG", transparency=PARTIAL_PALETTE_ALPHA),
                            over_white(PALETTE[INDICES], np.frombuffer(PARTIAL_PALETTE_ALPHA, np.uint8)[INDICES])),
    "PA-tiff": lambda: (encode(palette_image().convert("PA"), "TIFF"), PALETTE[INDICES]),
    "RGB-tiff": lambda: (encode(Image.fromarray(COLOUR), "TIFF"), COLOUR),
    "RGB-trns-png": lambda: (encode(Image.fromarray(COLOUR), "PNG", transparency=tuple(int(v) for v in COLOUR[3, 3])),
                             np.where((COLOUR == COLOUR[3, 3]).all(-1)[..., None], 255, COLOUR)),
    "RGBA-png": lambda: (encode(Image.fromarray(np.dstack([COLOUR, ALPHA])), "PNG"), over_white(COLOUR, ALPHA)),
    "RGBA-tiff": lambda: (encode(Image.fromarray(np.dstack([COLOUR, ALPHA])), "TIFF"), over_white(COLOUR, ALPHA)),
    "RGBA-webp": lambda: (encode(Image.fromarray(np.dstack([COLOUR, ALPHA])), "WEBP", lossless=True, exact=True),
                          over_white(COLOUR, ALPHA)),
    "CMYK-tiff": lambda: (encode(Image.fromarray(COLOUR).convert("CMYK"), "TIFF"), COLOUR),
    "YCbCr-tiff": lambda: (encode(Image.fromarray(COLOUR).convert("YCbCr"), "TIFF"),
                           np.asarray(Image.fromarray(COLOUR).convert("YCbCr").convert("RGB"))),
    "I;16-png": lambda: (encode(sixteen_bit(GREY), "PNG"), GREY),
    "I;16-tiff": lambda: (encode(sixteen_bit(GREY), "TIFF"), GREY),
    "I;16B-tiff": lambda: (tiff_of((GREY.astype(np.uint16) * 257).astype(">u2"), "I;16B"), GREY),
    "I;16-trns-png": lambda: (encode(sixteen_bit(GREY), "PNG", transparency=int(GREY[3, 3]) * 257), GREY_KEYED),
    "I-8bit-values-tiff": lambda: (tiff_of(GREY.astype(np.int32), "I"), GREY),
    "I-16bit-values-tiff": lambda: (tiff_of(GREY.astype(np.int32) * 257, "I"), GREY),
    "I-other-values-tiff": lambda: (tiff_of(GREY.astype(np.int32) * 1000 - 5000, "I"), GREY),  # min-max
    "F-unit-tiff": lambda: (tiff_of((GREY / 255).astype(np.float32), "F"), GREY),
    "F-8bit-values-tiff": lambda: (tiff_of(GREY.astype(np.float32), "F"), GREY),
    "F-other-values-tiff": lambda: (tiff_of(GREY.astype(np.float32) * 0.5 - 3, "F"), GREY),  # min-max
}


def expected_image(original: np.ndarray) -> bytes:
    return encode(Image.fromarray(original.astype(np.uint8)), "PNG")


def levels(a: np.ndarray, b: np.ndarray, std: float) -> float:
    """The largest difference of two normalised arrays, in 8-bit levels."""
    return float(np.abs(a - b).max() * std * 255)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_mode_prepares_like_its_8bit_original(case, tiny_model):
    data, original = CASES[case]()
    for info in (INFO_L, tiny_model.info):
        got = prepare_image(data, info, **FIT).pixels
        want = prepare_image(expected_image(original), info, **FIT).pixels
        assert got.shape == want.shape == (info.channels, *SIZE) and got.dtype == np.float32
        assert levels(got, want, info.std[0]) <= 1.0001, f"{case} with {info.channels} channel(s)"
    logits, _, *_ = tiny_model.run(np.stack([got, want]))
    assert logits[0].argmax() == logits[1].argmax()


def test_the_cases_cover_every_mode_pillow_reads_from_our_formats():
    modes = {Image.open(io.BytesIO(make()[0])).mode for make in CASES.values()}
    assert modes >= {"1", "L", "LA", "P", "PA", "RGB", "RGBA", "CMYK", "YCbCr", "I;16", "I;16B", "I", "F"}


def test_sixteen_bit_is_rescaled_through_a_resize_too(tiny_model):
    """At a size that needs resizing (and cropping), 16-bit still prepares exactly as 8-bit."""
    big = np.asarray(Image.fromarray(GREY).resize((80, 60), Image.Resampling.BICUBIC))
    for resize in ("fit", "native"):
        limits = dict(FIT, resize=resize)
        got = prepare_image(encode(sixteen_bit(big), "PNG"), tiny_model.info, **limits).pixels
        want = prepare_image(encode(Image.fromarray(big), "PNG"), tiny_model.info, **limits).pixels
        assert np.array_equal(got, want)


@pytest.mark.parametrize("mode, dtype", [("I;16", "<u2"), ("I;16L", "<u2"), ("I;16B", ">u2"), ("I;16N", "=u2")])
def test_every_16bit_layout_divides_by_257(mode, dtype):
    image = Image.frombytes(mode, SIZE[::-1], (GREY.astype(np.uint16) * 257).astype(dtype).tobytes())
    assert np.array_equal(np.asarray(to_channels(image, 1)), GREY)
    assert np.array_equal(np.asarray(to_channels(image, 3)), np.dstack([GREY] * 3))


@pytest.mark.parametrize("mode", ["La", "RGBa", "RGBX", "HSV"])
def test_in_memory_modes_convert_through_pillow(mode):
    rgba = Image.fromarray(np.dstack([COLOUR, np.full(SIZE, 255, np.uint8)]))
    image = Image.fromarray(np.dstack([GREY, np.full(SIZE, 255, np.uint8)]), "LA").convert("La") \
        if mode == "La" else rgba.convert(mode)
    want = GREY if mode == "La" else np.asarray(image.convert("RGB").convert("L"))
    assert np.abs(np.asarray(to_channels(image, 1), int) - want).max() <= 1


@pytest.mark.parametrize("values, want", [
    ([[np.nan, 0.0, 0.5, 1.0, np.inf, -np.inf]], [[0, 0, 128, 255, 255, 0]]),  # NaN -> 0, inf -> the extremes
    ([[-1.0, 0.0, 1.0]], [[0, 128, 255]]),  # outside 0..255: min-max
    ([[2.0, 2.0]], [[2, 2]]),  # within 0..255: kept
    ([[300.0, 300.0]], [[255, 255]]),  # constant outside 0..255: clipped, min-max has no scale
    ([[np.nan, np.nan]], [[0, 0]]),
])
def test_float_rule_edges(values, want):
    image = Image.fromarray(np.array(values, np.float32), "F")
    assert np.asarray(to_channels(image, 1)).tolist() == want


@pytest.mark.parametrize("values, want", [
    ([[0, 255]], [[0, 255]]),  # within 0..255: kept
    ([[0, 256, 65535]], [[0, 1, 255]]),  # within 0..65535: 16-bit
    ([[-10, 0, 10]], [[0, 128, 255]]),  # otherwise min-max
    ([[-2**31, 2**31 - 1]], [[0, 255]]),  # the whole 32-bit range, without overflow
    ([[70_000, 70_000]], [[255, 255]]),  # constant outside: clipped
])
def test_int_rule_edges(values, want):
    image = Image.fromarray(np.array(values, np.int32), "I")
    assert np.asarray(to_channels(image, 1)).tolist() == want


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (uint8 data, as Fashion-MNIST's are), read with numpy: service tests never import torch."""
    data = gzip.decompress(path.read_bytes())
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)


@pytest.fixture(scope="module")
def fmnist_model():
    if not FMNIST_MODEL.is_file():
        pytest.skip(f"{FMNIST_MODEL} is absent")
    from vitserve.service.engine.onnx_runtime import OnnxModel
    return OnnxModel.load(settings_for(FMNIST_MODEL))


@pytest.mark.slow
def test_fashion_mnist_as_16bit_png_classifies_as_8bit(fmnist_model):
    images_path = FASHION_MNIST_DIR / "t10k-images-idx3-ubyte.gz"
    if not images_path.is_file():
        pytest.skip(f"{images_path} is absent (Debian's dataset-fashion-mnist)")
    images = read_idx(images_path)[:200]
    labels = read_idx(FASHION_MNIST_DIR / "t10k-labels-idx1-ubyte.gz")[:200]
    info = fmnist_model.info

    def prepared(encoded: list[bytes]) -> np.ndarray:
        return np.stack([prepare_image(data, info, **FIT).pixels for data in encoded])

    eight = prepared([encode(Image.fromarray(image), "PNG") for image in images])
    sixteen = prepared([encode(sixteen_bit(image), "PNG") for image in images])
    assert np.array_equal(eight, sixteen)
    top1_eight, top1_sixteen = (fmnist_model.run(batch)[0].argmax(axis=1) for batch in (eight, sixteen))
    assert np.array_equal(top1_eight, top1_sixteen)
    assert (top1_sixteen == labels).mean() >= 0.85  # the model's real accuracy, not the clipped 66%
