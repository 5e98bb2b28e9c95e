"""Batched augmentations: each checked on images whose every pixel is known."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vitserve.model.augment import (AugmentConfig, augment_batch, normalize, random_crop_with_padding, random_erasing,
                           random_horizontal_flip, random_resized_crop)
from vitserve.artifact import normalize_pixels


def numbered(b: int, c: int, h: int, w: int) -> torch.Tensor:
    """Images whose pixels are all distinct and positive, so a pixel's value says where it came from."""
    return torch.arange(1, b * c * h * w + 1, dtype=torch.float32).view(b, c, h, w)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_crop_with_padding_is_a_shift_with_zero_fill():
    x = numbered(64, 2, 6, 5)
    out = random_crop_with_padding(x, padding=2, generator=gen())
    assert out.shape == x.shape
    shifts = set()
    for b in range(64):
        # The shift is read off the content: find where the original top-left pixel went, or where row/col 0 is.
        dy, dx = find_shift(x[b], out[b])
        shifts.add((dy, dx))
        expected = torch.zeros_like(x[b])
        ys, xs = slice(max(dy, 0), 6 + min(dy, 0)), slice(max(dx, 0), 5 + min(dx, 0))
        expected[:, ys, xs] = x[b, :, max(-dy, 0):6 - max(dy, 0), max(-dx, 0):5 - max(dx, 0)]
        assert torch.equal(out[b], expected)
    assert all(abs(dy) <= 2 and abs(dx) <= 2 for dy, dx in shifts)
    assert len(shifts) > 10  # many of the 25 offsets occur


def find_shift(src: torch.Tensor, out: torch.Tensor) -> tuple[int, int]:
    """(dy, dx) such that out[:, i, j] == src[:, i - dy, j - dx], from any pixel that survived."""
    i, j = (out[0] != 0).nonzero()[0].tolist()
    si, sj = (src[0] == out[0, i, j]).nonzero()[0].tolist()
    return i - si, j - sj


def test_crop_known_pixel():
    """A single bright pixel moves by the same offset in every channel, and stays within the padding."""
    x = torch.zeros(200, 3, 8, 8)
    x[:, :, 4, 3] = 255.0
    out = random_crop_with_padding(x, padding=1, generator=gen(3))
    positions = (out[:, 0] == 255).nonzero()  # (hits, 3): image, row, col
    assert len(positions) == 200 and torch.equal(positions[:, 0], torch.arange(200))
    assert set(positions[:, 1].tolist()) == {3, 4, 5} and set(positions[:, 2].tolist()) == {2, 3, 4}
    assert torch.equal(out[:, 0], out[:, 1]) and torch.equal(out[:, 0], out[:, 2])
    assert out.sum().item() == 200 * 3 * 255.0


def test_crop_without_padding_is_identity():
    x = numbered(2, 1, 4, 4)
    assert random_crop_with_padding(x, 0, gen()) is x


def test_horizontal_flip():
    x = numbered(100, 3, 4, 6)
    assert torch.equal(random_horizontal_flip(x, p=1.0, generator=gen()), x[..., torch.arange(5, -1, -1)])
    assert torch.equal(random_horizontal_flip(x, p=0.0, generator=gen()), x)
    out = random_horizontal_flip(x, p=0.5, generator=gen())
    flipped = torch.tensor([torch.equal(o, i.flip(-1)) for o, i in zip(out, x)])
    kept = torch.tensor([torch.equal(o, i) for o, i in zip(out, x)])
    assert torch.equal(flipped, ~kept)  # each image exactly one of the two
    assert 30 < flipped.sum().item() < 70


def test_random_erasing_replaces_one_rectangle():
    x = torch.full((100, 3, 20, 16), 7.0)
    scale, ratio = (0.05, 0.25), (0.5, 2.0)
    out = random_erasing(x, p=1.0, scale=scale, ratio=ratio, generator=gen())
    assert out.shape == x.shape and out.dtype == x.dtype
    for b in range(100):
        changed = out[b] != x[b]  # (C, H, W); noise never equals 7.0 exactly
        assert torch.equal(changed[0], changed[1]) and torch.equal(changed[0], changed[2])
        rows, cols = changed[0].any(1).nonzero()[:, 0], changed[0].any(0).nonzero()[:, 0]
        h, w = len(rows), len(cols)
        assert torch.equal(rows, torch.arange(rows[0], rows[0] + h))  # contiguous
        assert torch.equal(cols, torch.arange(cols[0], cols[0] + w))
        assert changed[0].sum().item() == h * w  # a full rectangle
        assert scale[0] * 320 * 0.5 <= h * w <= scale[1] * 320 * 1.5  # area up to rounding of the sides
        assert ratio[0] / 2 <= h / w <= ratio[1] * 2


def test_random_erasing_probability():
    x = torch.full((200, 1, 8, 8), 7.0)
    assert torch.equal(random_erasing(x, 0.0, (0.1, 0.2), (0.5, 2.0), gen()), x)
    out = random_erasing(x, 0.25, (0.1, 0.2), (0.5, 2.0), gen())
    erased = (out != x).flatten(1).any(1).sum().item()
    assert 25 <= erased <= 75


def test_random_resized_crop_shapes_and_identity():
    x = numbered(4, 3, 12, 20)
    out = random_resized_crop(x, (0.2, 1.0), (0.75, 1.33), gen())
    assert out.shape == (4, 3, 12, 20) and out.dtype == torch.float32
    assert out.min() >= x.min() and out.max() <= x.max()  # bilinear + border: no new extremes
    whole = random_resized_crop(x, (1.0, 1.0), (1.0, 1.0), gen())  # the whole image, unmoved
    torch.testing.assert_close(whole, x, rtol=0, atol=1e-3)
    uint8 = torch.full((2, 1, 9, 7), 200, dtype=torch.uint8)
    torch.testing.assert_close(random_resized_crop(uint8, (0.1, 0.5), (0.5, 2.0), gen()),
                               torch.full((2, 1, 9, 7), 200.0), rtol=0, atol=1e-4)


def test_random_resized_crop_zooms_in():
    """On a horizontal ramp (pixel value = column), a square quarter-area crop halves the slope: a 2x zoom."""
    x = torch.arange(32.0).expand(50, 1, 32, 32)
    out = random_resized_crop(x, (0.25, 0.25), (1.0, 1.0), gen())
    steps = out[..., 3:29] - out[..., 2:28]  # away from the borders, where sampling may clamp
    torch.testing.assert_close(steps, torch.full_like(steps, 0.5), rtol=0, atol=1e-3)
    torch.testing.assert_close(out, out[:, :, :1].expand_as(out), rtol=0, atol=1e-4)  # still varies along x only
    starts = out[:, 0, 0, 16]
    assert starts.min() >= 7.5 and starts.max() <= 23.5 and starts.max() - starts.min() > 4  # random positions


def test_normalize_values():
    x = torch.tensor([0, 51, 255], dtype=torch.uint8).view(1, 1, 1, 3)
    torch.testing.assert_close(normalize(x, [0.2], [0.5]), torch.tensor([[[[-0.4, 0.0, 1.6]]]]), rtol=0, atol=1e-6)
    rgb = torch.full((2, 3, 2, 2), 255, dtype=torch.uint8)
    out = normalize(rgb, [0.5, 0.25, 0.0], [0.5, 0.25, 2.0])
    assert out.dtype == torch.float32
    assert torch.equal(out[:, 0], torch.full((2, 2, 2), 1.0)) and torch.equal(out[:, 1], torch.full((2, 2, 2), 3.0))
    assert torch.equal(out[:, 2], torch.full((2, 2, 2), 0.5))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.float64])
@pytest.mark.parametrize("mean, std", [([0.2860], [0.3530]), ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
                                       ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])])
def test_normalize_is_normalize_pixels_and_the_old_torch_formula_bit_for_bit(dtype, mean, std):
    g = gen(7)
    shape = (16, len(mean), 13, 11)
    if dtype == torch.uint8:
        x = torch.randint(0, 256, shape, dtype=dtype, generator=g)
    else:  # what augment_batch passes: crops and resizes of the pixels, not whole numbers
        x = (torch.rand(shape, generator=g, dtype=torch.float64) * 255).to(dtype)
    x = torch.cat([x, torch.full((1, *shape[1:]), 255, dtype=dtype), torch.zeros((1, *shape[1:]), dtype=dtype)])
    out = normalize(x, mean, std)
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert torch.equal(out, (x.float() / 255.0 - m) / s)  # what training computed before normalize_pixels
    assert np.array_equal(out.numpy(), normalize_pixels(x.numpy(), mean, std, channel_axis=1))
    assert torch.equal(normalize(x[:, :, 1:, ::2], mean, std), out[:, :, 1:, ::2])  # a strided view, as cropped


def test_augment_batch_without_augmentation_is_normalize():
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    cfg = AugmentConfig(crop="none", hflip=False, erasing_prob=0.0)
    mean, std = [0.5] * 3, [0.25] * 3
    assert torch.equal(augment_batch(images, cfg, mean, std, gen()), normalize(images, mean, std))


@pytest.mark.parametrize("crop", ["pad", "rrc", "none"])
def test_augment_batch_is_deterministic_with_a_seeded_generator(crop):
    images = torch.randint(0, 256, (16, 1, 12, 12), dtype=torch.uint8)
    cfg = AugmentConfig(crop=crop, erasing_prob=0.5)
    a = augment_batch(images, cfg, [0.3], [0.4], gen(5))
    b = augment_batch(images, cfg, [0.3], [0.4], gen(5))
    c = augment_batch(images, cfg, [0.3], [0.4], gen(6))
    assert a.shape == (16, 1, 12, 12) and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    g = gen(5)
    assert not torch.equal(augment_batch(images, cfg, [0.3], [0.4], g), augment_batch(images, cfg, [0.3], [0.4], g))


def test_augment_batch_rejects_unknown_crop():
    with pytest.raises(ValueError, match="unknown crop 'centre'"):
        augment_batch(torch.zeros(1, 1, 4, 4, dtype=torch.uint8), AugmentConfig(crop="centre"), [0.0], [1.0])


def test_default_augment_config():
    cfg = AugmentConfig()
    assert (cfg.crop, cfg.crop_padding, cfg.hflip, cfg.erasing_prob) == ("pad", 2, True, 0.25)
    assert math.isclose(cfg.rrc_ratio[0], 0.75) and cfg.erasing_scale == (0.02, 0.25)
