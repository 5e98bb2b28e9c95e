"""Softmax, top-k, rollout scaling and heat-map rendering (at a bounded size)."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from vitserve.service.usecases.postprocess import (colorize, encode_result, heatmap, overlay, png_base64, ramp_colors, scale_box,
                                 scale_unit, softmax, top_k)
from vitserve.service.usecases.preprocess import prepare_image
from vitserve.artifact import ModelInfo


def test_softmax_is_stable_and_sums_to_one():
    p = softmax(np.array([1000.0, 1001.0, 1002.0], np.float32))
    np.testing.assert_allclose(p, softmax(np.array([0.0, 1.0, 2.0])), rtol=1e-12)
    assert abs(p.sum() - 1) < 1e-12 and p.argmax() == 2


def test_top_k_orders_by_score_and_breaks_ties_by_index():
    assert top_k(np.array([0.1, 0.4, 0.1, 0.4]), 3) == [(1, 0.4), (3, 0.4), (0, 0.1)]
    assert len(top_k(np.array([0.5, 0.5]), 5)) == 2


def test_scale_unit():
    np.testing.assert_allclose(scale_unit(np.array([[2.0, 4.0], [6.0, 10.0]])), [[0, 0.25], [0.5, 1]])
    assert not scale_unit(np.full((2, 2), 3.0)).any()


def test_colorize_endpoints():
    colors = colorize(np.array([[0.0, 1.0]]))
    assert colors.shape == (1, 2, 3) and colors.dtype == np.uint8
    assert tuple(colors[0, 0]) == (48, 18, 59) and tuple(colors[0, 1]) == (122, 4, 3)


def test_heatmap_covers_only_the_crop_box():
    heat = np.asarray(heatmap(np.ones((2, 2), np.float32), (10, 6), (2, 0, 8, 6)))
    assert heat.shape == (6, 10, 3)
    assert tuple(heat[3, 0]) == (48, 18, 59) and tuple(heat[3, 5]) == (122, 4, 3)


def test_png_base64_round_trip_and_overlay_size():
    image = Image.new("RGB", (7, 5), (10, 20, 30))
    blended = overlay(image, Image.new("RGB", (7, 5), (30, 40, 50)))
    assert blended.getpixel((0, 0)) == (20, 30, 40)
    decoded = Image.open(io.BytesIO(base64.b64decode(png_base64(blended))))
    assert decoded.format == "PNG" and decoded.size == (7, 5)


def test_colorize_is_within_a_level_of_the_exact_ramp():
    unit = np.random.default_rng(0).random((200, 300)).astype(np.float32)
    assert np.abs(colorize(unit).astype(int) - ramp_colors(unit).astype(int)).max() <= 1
    assert tuple(colorize(np.array([[-1.0, 2.0]]))[0, 1]) == (122, 4, 3)  # out of range is clipped


def test_scale_box_maps_to_the_render_size_and_never_empties():
    assert scale_box((1000, 0, 5000, 4000), (6000, 4000), (1024, 683)) == (171, 0, 853, 683)
    assert scale_box((20, 0, 60, 40), (80, 40), (80, 40)) == (20, 0, 60, 40)
    assert scale_box((4999, 0, 5000, 1), (10_000, 1), (1024, 1)) == (512, 0, 513, 1)  # a 0.1-pixel crop
    assert scale_box((9999, 0, 10_000, 1), (10_000, 1), (1024, 1)) == (1023, 0, 1024, 1)


INFO = ModelInfo(name="m", version="1", labels=["a", "b", "c"], patch_size=8, image_size=(32, 32), channels=3,
                 mean=[0.5] * 3, std=[0.25] * 3)


def big_png(size: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 60)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("rollout_format", ["png", "overlay"])
def test_rollout_images_are_drawn_at_the_bounded_render_size(rollout_format):
    prepared = prepare_image(big_png((3000, 1000)), INFO, resize="fit", max_bytes=10**7, max_pixels=10**7,
                             max_tokens=64, keep_source=rollout_format == "overlay", max_render_side=600)
    assert prepared.size == (3000, 1000) and prepared.render_size == (600, 200)
    assert prepared.crop_box == (1000, 0, 2000, 1000)
    rollout = np.arange(16, dtype=np.float32).reshape(4, 4)
    _, image = encode_result(INFO.labels, prepared, np.array([0.0, 1.0, 2.0]), rollout, 2, rollout_format)
    assert (image.width, image.height) == (600, 200)
    decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(image.data))).convert("RGB"))
    assert decoded.shape == (200, 600, 3)
    if rollout_format == "png":  # outside the crop (x < 200 or x >= 400) is the ramp's zero colour
        assert (decoded[:, :200] == (48, 18, 59)).all() and (decoded[:, 400:] == (48, 18, 59)).all()
        assert tuple(decoded[199, 399]) == (122, 4, 3)  # the grid's maximum is its bottom-right patch
