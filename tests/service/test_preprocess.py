"""Decoding, limits, channel conversion, resize policies and normalisation, as pure functions."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from service.errors import ImageDecodeError, ImageTooLarge, PayloadTooLarge, UnsupportedMediaType
from service.preprocess import decode_image, fit_box, native_size, normalize_image, prepare_image, to_channels
from vitserve.artifact import ModelInfo, normalize_pixels
from service_fixtures import image_bytes, png_declaring

LIMITS = dict(max_bytes=1_000_000, max_pixels=1_000_000)
INFO = ModelInfo(name="m", version="1", labels=["a", "b"], patch_size=8, image_size=(32, 32), channels=3,
                 mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25])


def jpeg_with_orientation(orientation: int) -> bytes:
    image = Image.new("RGB", (40, 20), (255, 0, 0))
    image.paste((0, 0, 255), (0, 0, 20, 20))  # left half blue
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", exif=exif, quality=95)
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF"])
def test_decodes_every_supported_format(fmt):
    image = decode_image(image_bytes(fmt, size=(40, 30)), **LIMITS)
    assert image.size == (40, 30)


def test_gif_uses_first_frame():
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 255, 0))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:])
    pixel = to_channels(decode_image(buffer.getvalue(), **LIMITS), 3).getpixel((8, 8))
    assert pixel[0] > 200 and pixel[1] < 50


def test_exif_orientation_is_applied():
    image = decode_image(jpeg_with_orientation(6), **LIMITS)  # 6: rotate 90 degrees clockwise to view
    assert image.size == (20, 40)
    top, bottom = image.getpixel((10, 2)), image.getpixel((10, 37))
    assert top[2] > 200 and bottom[0] > 200  # the blue left half is now on top


def test_channels_conversion_and_transparency_over_white():
    rgba = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    assert to_channels(rgba, 3).getpixel((0, 0)) == (255, 255, 255)
    assert to_channels(Image.new("RGB", (4, 4), (255, 0, 0)), 1).mode == "L"
    assert to_channels(Image.new("L", (4, 4), 9), 3).getpixel((1, 1)) == (9, 9, 9)


@pytest.mark.parametrize("data, error", [
    (b"", ImageDecodeError),
    (b"this is not an image at all" * 4, ImageDecodeError),
    (image_bytes("JPEG", size=(64, 64))[:300], ImageDecodeError),  # truncated
    (png_declaring(100_000, 100_000), ImageTooLarge),
    (png_declaring(1001, 1000), ImageTooLarge),  # just over our own limit, far under Pillow's
    (image_bytes("ICO", size=(16, 16)), UnsupportedMediaType),
    (b"\xff" * 1_000_001, PayloadTooLarge),
])
def test_bad_inputs_raise_their_domain_error(data, error):
    with pytest.raises(error):
        decode_image(data, **LIMITS)


def test_pixel_limit_is_checked_before_decoding(monkeypatch):
    loaded = []
    monkeypatch.setattr(Image.Image, "load", lambda self: loaded.append(1))
    with pytest.raises(ImageTooLarge):
        decode_image(png_declaring(5000, 5000), **LIMITS)
    assert loaded == []


def test_fit_box_scales_and_centre_crops():
    assert fit_box(640, 480, (32, 32)) == ((32, 32), (80, 0, 560, 480))
    assert fit_box(20, 40, (32, 32)) == ((32, 32), (0, 10, 20, 30))
    assert fit_box(64, 32, (16, 32)) == ((32, 16), (0, 0, 64, 32))  # same aspect: nothing cropped


def test_native_size_snaps_to_patches_and_caps_tokens():
    assert native_size(640, 480, 8, 10_000) == (640, 480)
    assert native_size(643, 477, 8, 10_000) == (640, 480)
    assert native_size(3, 3, 8, 10) == (8, 8)  # at least one patch
    width, height = native_size(640, 480, 8, 1024)
    assert width % 8 == 0 and height % 8 == 0 and (width // 8) * (height // 8) <= 1024
    assert abs(width / height - 640 / 480) < 0.05
    assert native_size(1000, 10, 8, 16) == (128, 8)


def test_normalize_image_matches_formula():
    image = Image.new("RGB", (2, 3), (255, 0, 51))
    out = normalize_image(image, [0.5, 0.5, 0.5], [0.25, 0.25, 0.25])
    assert out.shape == (3, 3, 2) and out.dtype == np.float32
    np.testing.assert_allclose(out[:, 0, 0], [(1 - 0.5) / 0.25, (0 - 0.5) / 0.25, (0.2 - 0.5) / 0.25], rtol=1e-6)


@pytest.mark.parametrize("mode, shape", [("RGB", (17, 23, 3)), ("L", (28, 28))])
def test_normalize_image_is_bit_identical_to_the_reference(mode, shape):
    pixels = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    channels = 3 if mode == "RGB" else 1
    mean, std = [0.485, 0.456, 0.406][:channels], [0.229, 0.224, 0.225][:channels]
    out = normalize_image(Image.fromarray(pixels, mode), mean, std)
    expected = normalize_pixels(pixels.reshape(shape[0], shape[1], channels).transpose(2, 0, 1), mean, std,
                                channel_axis=0)
    assert out.shape == expected.shape and out.dtype == np.float32 and out.flags["C_CONTIGUOUS"]
    assert np.array_equal(out, expected)


def test_prepare_image_fit_and_native():
    data = image_bytes("PNG", size=(80, 40))
    fit = prepare_image(data, INFO, resize="fit", max_bytes=10**6, max_pixels=10**6, max_tokens=64)
    assert fit.pixels.shape == (3, 32, 32) and fit.crop_box == (20, 0, 60, 40) and fit.source is None
    native = prepare_image(data, INFO, resize="native", max_bytes=10**6, max_pixels=10**6, max_tokens=64,
                           keep_source=True)
    assert native.pixels.shape == (3, 40, 80) and native.crop_box == (0, 0, 80, 40)
    assert native.size == (80, 40) and native.source.size == (80, 40)
