"""Decoding, limits, channel conversion, resize policies and normalisation, as pure functions."""
from __future__ import annotations

import io
import struct
from functools import cache

import numpy as np
import pytest
from PIL import Image

from vitserve.service.ground.errors import ImageDecodeError, ImageTooLarge, PayloadTooLarge, UnsupportedMediaType
from vitserve.service.usecases.preprocess import (OVER_WHITE_ROWS, decode_image, decode_need, fit_box, load_first_frame,
                                native_size, normalize_image, peek_pixels, prepare_image, render_size,
                                stored_box, to_channels)
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


def test_transparency_is_composed_strip_by_strip_like_the_whole_image():
    # taller than a strip (OVER_WHITE_ROWS), with a last strip that is cut short
    rng = np.random.default_rng(3)
    colour = rng.integers(0, 256, (2 * OVER_WHITE_ROWS + 37, 19, 3), dtype=np.uint8)
    alpha = rng.integers(0, 256, colour.shape[:2], dtype=np.uint8)
    a = alpha.astype(int)[..., None]
    want = (colour.astype(int) * a + 255 * (255 - a) + 127) // 255  # the documented composition, per band
    got = np.asarray(to_channels(Image.fromarray(np.dstack([colour, alpha]), "RGBA"), 3)).astype(int)
    assert np.abs(got - want).max() <= 1
    grey = np.asarray(to_channels(Image.fromarray(np.dstack([colour, alpha]), "RGBA"), 1)).astype(int)
    luma = np.asarray(Image.fromarray(want.astype(np.uint8)).convert("L")).astype(int)
    assert grey.shape == alpha.shape and np.abs(grey - luma).max() <= 1
    # a palette's transparent entry, in every strip
    palette = Image.fromarray((np.arange(colour.shape[0] * 19) % 4).astype(np.uint8).reshape(-1, 19), "P")
    palette.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255])
    palette.info["transparency"] = 0
    composed = np.asarray(to_channels(palette, 3))
    assert (composed[np.asarray(palette) == 0] == 255).all() and (composed[np.asarray(palette) == 1] == [255, 0, 0]).all()


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
    assert native.size == (80, 40) and native.source.size == (80, 40) and native.render_size == (80, 40)


@pytest.mark.parametrize("data, error", [
    (b"", ImageDecodeError),
    (b"this is not an image at all" * 4, ImageDecodeError),
    (png_declaring(100_000, 100_000), ImageTooLarge),
    (png_declaring(1001, 1000), ImageTooLarge),
    (image_bytes("ICO", size=(16, 16)), UnsupportedMediaType),
    (b"\xff" * 1_000_001, PayloadTooLarge),
])
def test_peek_pixels_raises_what_decode_image_raises(data, error):
    with pytest.raises(error):
        peek_pixels(data, **LIMITS)
    with pytest.raises(error):
        decode_image(data, **LIMITS)


def test_peek_pixels_reads_the_header_only(monkeypatch):
    png, jpeg, loaded = png_declaring(1000, 700), image_bytes("JPEG", size=(40, 30)), []
    monkeypatch.setattr(Image.Image, "load", lambda self: loaded.append(1))
    assert peek_pixels(png, **LIMITS) == 700_000
    assert peek_pixels(jpeg, **LIMITS) == 1200
    assert loaded == []


def test_fit_box_never_crops_to_nothing():
    assert fit_box(10_000, 1, (32, 8)) == ((8, 32), (4999, 0, 5000, 1))  # round(0.25) would be an empty crop


def test_render_size_bounds_the_longest_side():
    assert render_size(80, 40, 1024) == (80, 40)
    assert render_size(6320, 6320, 1024) == (1024, 1024)
    assert render_size(6000, 4000, 1024) == (1024, 683)
    assert render_size(4000, 6000, 1024) == (683, 1024)
    assert render_size(100_000, 3, 1024) == (1024, 1)


def test_decode_need_keeps_the_reducing_gap_and_the_render_size():
    # a 28x28 fit of the centre 4000x4000 of 6000x4000: the box keeps 3 x 28 = 84 pixels each way
    assert decode_need((6000, 4000), (28, 28), (1000, 0, 5000, 4000), (1, 1)) == (126, 84)
    assert decode_need((6000, 4000), (28, 28), (1000, 0, 5000, 4000), (1024, 683)) == (1024, 683)
    assert decode_need((50, 40), (28, 28), (5, 0, 45, 40), (50, 40)) == (50, 40)  # never above the input


@cache
def large_jpeg(size=(4000, 3000)) -> bytes:
    """Smooth content (a bicubic blow-up of noise), so DCT-scaled decoding is comparable to a full decode."""
    small = np.random.default_rng(3).integers(0, 256, (size[1] // 250, size[0] // 250, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(small).resize(size, Image.Resampling.BICUBIC).save(buffer, "JPEG", quality=92)
    return buffer.getvalue()


def test_jpeg_decodes_scaled_down_but_never_below_the_need():
    image, scale = load_first_frame(Image.open(io.BytesIO(large_jpeg())), (300, 200))
    assert scale == 8 and image.size == (500, 375)
    image, scale = load_first_frame(Image.open(io.BytesIO(large_jpeg())), (1024, 768))
    assert scale == 2 and image.size == (2000, 1500)  # 1/4 would be 1000x750, below the need
    image, scale = load_first_frame(Image.open(io.BytesIO(image_bytes("PNG", size=(400, 300)))), (50, 40))
    assert scale == 1 and image.size == (400, 300)  # only JPEG can decode scaled


@pytest.mark.parametrize("resize", ["fit", "native"])
def test_large_jpeg_prepares_as_a_full_decode_would(resize):
    data = large_jpeg()
    limits = dict(resize=resize, max_bytes=10**8, max_pixels=10**8, max_tokens=64)
    prepared = prepare_image(data, INFO, **limits)
    full = to_channels(decode_image(data, max_bytes=10**8, max_pixels=10**8), 3)  # no DCT scaling
    reference = full.resize(prepared.pixels.shape[:0:-1], Image.Resampling.BICUBIC, box=prepared.crop_box,
                            reducing_gap=3.0)
    levels = np.abs(prepared.pixels - normalize_image(reference, INFO.mean, INFO.std)) * 0.25 * 255
    assert levels.max() <= 6 and levels.mean() <= 0.5
    assert prepared.size == (4000, 3000) and prepared.render_size == (1024, 768)


def test_the_kept_source_never_changes_the_model_input():
    data = large_jpeg()
    limits = dict(resize="fit", max_bytes=10**8, max_pixels=10**8, max_tokens=64)
    with_source = prepare_image(data, INFO, **limits, keep_source=True, max_render_side=512)
    without = prepare_image(data, INFO, **limits, max_render_side=512)
    assert np.array_equal(with_source.pixels, without.pixels) and without.source is None
    assert with_source.source.size == with_source.render_size == (512, 384)
    assert with_source.crop_box == without.crop_box == (500, 0, 3500, 3000)  # in the input's own pixels


UPRIGHT_FROM = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
                5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE,
                8: Image.Transpose.ROTATE_270}  # the transpose that makes a stored image from an upright one


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("resize", ["fit", "native"])
def test_every_exif_orientation_prepares_like_the_upright_image(orientation, resize):
    rng = np.random.default_rng(orientation)
    upright_image = Image.fromarray(rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)).resize((70, 45))
    stored = upright_image if orientation == 1 else upright_image.transpose(UPRIGHT_FROM[orientation])
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    stored.save(buffer, "PNG", exif=exif)
    limits = dict(resize=resize, max_bytes=10**6, max_pixels=10**6, max_tokens=64, keep_source=True)
    got = prepare_image(buffer.getvalue(), INFO, **limits, max_render_side=35)
    want = prepare_image(image_bytes_of(upright_image), INFO, **limits, max_render_side=35)
    assert got.size == want.size == (70, 45) and got.crop_box == want.crop_box
    assert got.source.size == got.render_size == (35, 22)
    # Resized before the turn: for the axis-swapping orientations (5-8) Pillow's two separable passes run in the
    # other order, each rounding to 8 bits, so a pixel may differ by up to two levels.
    levels = np.abs(got.pixels - want.pixels) * 0.25 * 255
    assert levels.max() <= 2.0001 and levels.mean() <= 0.1
    assert np.abs(np.asarray(got.source, int) - np.asarray(want.source, int)).max() <= 2


def image_bytes_of(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def test_stored_box_maps_an_upright_box_back():
    box, size = (10, 5, 30, 20), (70, 45)  # of the upright image
    assert stored_box(box, size, 1) == box
    assert stored_box(box, size, 2) == (40, 5, 60, 20)
    assert stored_box(box, size, 3) == (40, 25, 60, 40)
    assert stored_box(box, size, 6) == (5, 40, 20, 60)  # stored 45x70, turned clockwise to view


@pytest.mark.parametrize("failure", [struct.error("unpack requires a buffer of 4 bytes"), TypeError("bad tile"),
                                     IndexError("list index out of range"), AssertionError(), ZeroDivisionError()])
def test_any_pillow_failure_is_the_images_decode_error(monkeypatch, failure):
    def load(self):
        raise failure
    data = image_bytes("PNG", size=(8, 8))
    monkeypatch.setattr(Image.Image, "load", load)
    with pytest.raises(ImageDecodeError, match=type(failure).__name__):
        prepare_image(data, INFO, resize="fit", max_bytes=10**6, max_pixels=10**6, max_tokens=64)


@pytest.mark.parametrize("failure", [MemoryError, KeyboardInterrupt, SystemExit])
def test_memory_error_and_interrupts_are_not_the_clients_fault(monkeypatch, failure):
    def load(self):
        raise failure()
    data = image_bytes("PNG", size=(8, 8))
    monkeypatch.setattr(Image.Image, "load", load)
    with pytest.raises(failure):
        prepare_image(data, INFO, resize="fit", max_bytes=10**6, max_pixels=10**6, max_tokens=64)


def test_a_decompression_bomb_stays_image_too_large(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # Pillow's own limit, normally far above ours
    with pytest.raises(ImageTooLarge, match=f"more than 200 pixels; the limit is {LIMITS['max_pixels']}$"):
        decode_image(image_bytes("PNG", size=(20, 20)), **LIMITS)
