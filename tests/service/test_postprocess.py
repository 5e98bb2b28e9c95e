"""Softmax, top-k, rollout scaling and heat-map rendering."""
from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image

from service.postprocess import colorize, heatmap, overlay, png_base64, scale_unit, softmax, top_k


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
