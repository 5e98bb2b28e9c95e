"""A seeded mutation fuzzer over small valid images of every accepted format, made by code: whatever the bytes,
`prepare_image` returns a well-formed PreparedImage or raises one of the documented service errors; anything
else (struct.error, TypeError, ...) would escape as a 500. Deterministic: case `seed` is always the same bytes;
reproduce a failure with `fuzz_case(seed)`."""
from __future__ import annotations

import io
import random
import struct
import warnings
import zlib
from dataclasses import dataclass
from functools import cache
from typing import Callable

import numpy as np
import pytest
from PIL import Image

from vitserve.service.ground.errors import ImageDecodeError, ImageTooLarge, PayloadTooLarge, UnsupportedMediaType
from vitserve.service.usecases.postprocess import encode_result
from vitserve.service.usecases.preprocess import PreparedImage, peek_pixels, prepare_image
from vitserve.artifact import ModelInfo

DOCUMENTED_ERRORS = (ImageDecodeError, ImageTooLarge, PayloadTooLarge, UnsupportedMediaType)
CASES_PER_FORMAT = 2000  # 12,000 cases in all: about 12 s on two shared cores
LIMITS = dict(max_bytes=1_000_000, max_pixels=1_000_000)  # a mutated header may declare up to this many pixels
INFOS = [ModelInfo(name=f"c{c}", version="1", labels=["a", "b"], patch_size=8, image_size=(32, 24), channels=c,
                   mean=[0.5] * c, std=[0.25] * c) for c in (1, 3)]
MAX_TOKENS = 48
INTERESTING = [0, 1, 2, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0x8000, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF]


def encode(image: Image.Image, fmt: str, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save)
    return buffer.getvalue()


def content(size=(24, 18), mode="RGB") -> Image.Image:
    """A small non-constant image (noise over a gradient), so every codec has real data to carry."""
    rng = np.random.default_rng(size[0] * 31 + size[1])
    base = np.add.outer(np.arange(size[1]), np.arange(size[0])) * 5 % 256
    pixels = (base[..., None] + rng.integers(0, 40, (size[1], size[0], 3))).clip(0, 255).astype(np.uint8)
    return Image.fromarray(pixels).convert(mode)


def frames(fmt: str, **save) -> bytes:
    first, second = content(), content((24, 18)).transpose(Image.Transpose.ROTATE_180)
    return encode(first, fmt, save_all=True, append_images=[second], **save)


def with_orientation(orientation: int) -> Image.Exif:
    """EXIF with an orientation and a few tags of other types (text, rational, a sub-IFD), for the parsers."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    exif[0x010F], exif[0x0110], exif[0x0132] = "Camera", "Model 1", "2024:01:02 03:04:05"  # Make, Model, DateTime
    exif[0x011A], exif[0x0128] = 72.0, 2  # XResolution (rational), ResolutionUnit
    exif.get_ifd(0x8769)[0x9003] = "2024:01:02 03:04:05"  # Exif IFD: DateTimeOriginal
    return exif


@cache
def base_images() -> dict[str, list[bytes]]:
    """Valid seeds per format: several modes, codecs and layouts each (made once; a few kB in all)."""
    sixteen = Image.fromarray((np.asarray(content(mode="L")).astype(np.uint16) * 257))
    return {
        "JPEG": [encode(content(), "JPEG", quality=80), encode(content(), "JPEG", progressive=True),
                 encode(content(mode="L"), "JPEG"), encode(content(), "JPEG", exif=with_orientation(6)),
                 encode(content(), "JPEG", exif=with_orientation(3)),
                 encode(content(mode="CMYK"), "JPEG"), encode(content((300, 200)), "JPEG", quality=60)],
        "PNG": [encode(content(), "PNG"), encode(content(mode="L"), "PNG"), encode(content(mode="RGBA"), "PNG"),
                encode(content(mode="P"), "PNG", transparency=3), encode(sixteen, "PNG"),
                encode(content(), "PNG", exif=with_orientation(8)), frames("PNG")],
        "WEBP": [encode(content(), "WEBP", quality=70), encode(content(mode="RGBA"), "WEBP", lossless=True),
                 frames("WEBP"), encode(content(), "WEBP", exif=with_orientation(5))],
        "GIF": [encode(content(mode="P"), "GIF"), frames("GIF", transparency=0, duration=50),
                encode(content(mode="L"), "GIF")],
        "BMP": [encode(content(), "BMP"), encode(content(mode="P"), "BMP"), encode(content(mode="1"), "BMP"),
                encode(content(mode="L"), "BMP")],
        "TIFF": [encode(content(), "TIFF"), encode(content(), "TIFF", compression="tiff_lzw"),
                 encode(content(), "TIFF", compression="tiff_adobe_deflate"), encode(content(), "TIFF",
                                                                                    compression="packbits"),
                 encode(content(), "TIFF", compression="jpeg"), encode(sixteen, "TIFF"),
                 encode(content(mode="CMYK"), "TIFF"), encode(content(mode="L").convert("F"), "TIFF"),
                 encode(content(), "TIFF", exif=with_orientation(3)), frames("TIFF")],
    }


def flip_bytes(rng: random.Random, data: bytearray) -> str:
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return "flip bytes"


def flip_bits(rng: random.Random, data: bytearray) -> str:
    for _ in range(rng.randint(1, 16)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return "flip bits"


def truncate(rng: random.Random, data: bytearray) -> str:
    cut = rng.randrange(1, len(data))
    del data[cut:]
    return f"truncate at {cut}"


def insert(rng: random.Random, data: bytearray) -> str:
    at = rng.randrange(len(data) + 1)
    data[at:at] = rng.randbytes(rng.randint(1, 64))
    return f"insert at {at}"


def delete(rng: random.Random, data: bytearray) -> str:
    at = rng.randrange(len(data))
    del data[at:at + rng.randint(1, 64)]
    return f"delete at {at}"


def duplicate(rng: random.Random, data: bytearray) -> str:
    start = rng.randrange(len(data))
    piece = data[start:start + rng.randint(1, 256)]
    at = rng.randrange(len(data) + 1)
    data[at:at] = piece
    return f"duplicate {start} at {at}"


def mutate_exif(rng: random.Random, data: bytearray) -> str:
    """Corrupt the EXIF block (its TIFF header, IFD entries and values), parsed by Pillow's own Python code."""
    start = max(data.find(b"Exif\x00\x00"), data.find(b"eXIf"))
    if start < 0:
        return corrupt_length(rng, data)
    for _ in range(rng.randint(1, 4)):
        at = min(len(data) - 1, start + rng.randrange(4, 200))
        data[at] = rng.choice([0, 1, 2, 3, 4, 5, 7, 9, 10, 0x7F, 0x80, 0xFF, rng.randrange(256)])
    return f"EXIF at {start}"


def length_fields(data: bytes) -> list[tuple[int, str]]:
    """Offsets and struct formats of the length / size / offset fields of PNG chunks and JPEG segments; for the
    other formats (TIFF IFDs, BMP/GIF/RIFF headers) every aligned integer of the first 256 bytes."""
    if data.startswith(b"\x89PNG"):
        fields, at = [(16, ">I"), (20, ">I")], 8  # IHDR width and height, then each chunk's length
        while at + 8 <= len(data):
            fields.append((at, ">I"))
            at += 12 + struct.unpack_from(">I", data, at)[0]
        return fields
    if data.startswith(b"\xff\xd8"):
        fields, at = [], 2
        while at + 4 <= len(data) and data[at] == 0xFF and data[at + 1] not in (0xD9, 0xDA):
            fields.append((at + 2, ">H"))  # the segment length; SOF dimensions follow it
            fields += [(at + 5, ">H"), (at + 7, ">H")] if 0xC0 <= data[at + 1] <= 0xC2 else []
            at += 2 + struct.unpack_from(">H", data, at + 2)[0]
        return fields
    little = data[:2] == b"II" or data[:4] == b"RIFF" or data[:2] == b"BM" or data[:3] == b"GIF"
    order = "<" if little else ">"
    head = min(len(data), 256)
    return [(at, order + "H") for at in range(0, head - 1, 2)] + [(at, order + "I") for at in range(0, head - 3, 4)]


def corrupt_length(rng: random.Random, data: bytearray) -> str:
    fields = [(at, fmt) for at, fmt in length_fields(bytes(data)) if at + struct.calcsize(fmt) <= len(data)]
    if not fields:
        return flip_bytes(rng, data)
    at, fmt = rng.choice(fields)
    limit = 0xFFFF if fmt.endswith("H") else 0xFFFFFFFF
    old = struct.unpack_from(fmt, data, at)[0]
    value = rng.choice([v for v in INTERESTING if v <= limit] + [(old + rng.choice([-1, 1, 2, 100])) % (limit + 1)])
    struct.pack_into(fmt, data, at, value)
    return f"length {fmt} at {at}: {old} -> {value}"


def fix_png_crcs(data: bytearray) -> None:
    """Recompute every PNG chunk's CRC, so a mutation reaches the chunk parsers instead of failing the checksum."""
    at = 8
    while at + 12 <= len(data):
        length = struct.unpack_from(">I", data, at)[0]
        if at + 12 + length > len(data):
            return
        struct.pack_into(">I", data, at + 8 + length, zlib.crc32(data[at + 4:at + 8 + length]))
        at += 12 + length


MUTATORS: list[Callable[[random.Random, bytearray], str]] = [
    flip_bytes, flip_bits, truncate, insert, delete, duplicate, corrupt_length, corrupt_length, mutate_exif,
    mutate_exif]


@dataclass
class FuzzCase:
    seed: int
    data: bytes
    info: ModelInfo
    resize: str
    keep_source: bool
    what: str  # the base image and the mutations applied, for the failure message


def fuzz_case(seed: int) -> FuzzCase:
    """Case `seed`: one base image of the format the seed picks, one to three mutations, and the call's options."""
    rng = random.Random(seed)
    fmt = sorted(base_images())[seed // CASES_PER_FORMAT % len(base_images())]
    index = rng.randrange(len(base_images()[fmt]))
    data = bytearray(base_images()[fmt][index])
    steps = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        if len(data) < 2:  # deletions can empty it: an empty body is a case of its own
            break
        steps.append(rng.choice(MUTATORS)(rng, data))
    if fmt == "PNG" and rng.random() < 0.8:
        fix_png_crcs(data)
        steps.append("CRCs fixed")
    return FuzzCase(seed, bytes(data), rng.choice(INFOS), rng.choice(["fit", "native"]), rng.random() < 0.5,
                    f"{fmt} base {index}, " + "; ".join(steps))


def check_prepared(case: FuzzCase, prepared: PreparedImage) -> None:
    """A well-formed result: finite float32 (C, H, W), sides multiples of the patch; its rollout renders."""
    pixels, info = prepared.pixels, case.info
    assert isinstance(pixels, np.ndarray) and pixels.dtype == np.float32 and pixels.ndim == 3
    channels, height, width = pixels.shape
    assert channels == info.channels and height > 0 and width > 0
    assert height % info.patch_size == 0 and width % info.patch_size == 0
    if case.resize == "fit":
        assert (height, width) == info.image_size
    else:
        assert (height // info.patch_size) * (width // info.patch_size) <= MAX_TOKENS
    assert np.isfinite(pixels).all()
    grid = np.random.default_rng(case.seed).random((height // info.patch_size, width // info.patch_size))
    _, image = encode_result(info.labels, prepared, np.array([0.2, 0.1]), grid, 1,
                             "overlay" if case.keep_source else "png")
    assert (image.width, image.height) == prepared.render_size


def run_case(case: FuzzCase) -> str | None:
    """None when the case behaved; otherwise what went wrong."""
    try:
        pixels = peek_pixels(case.data, **LIMITS)
    except DOCUMENTED_ERRORS:
        pixels = None
    try:
        prepared = prepare_image(case.data, case.info, resize=case.resize, max_tokens=MAX_TOKENS,
                                 keep_source=case.keep_source, max_render_side=64, **LIMITS)
    except DOCUMENTED_ERRORS:
        return None
    except Exception as e:  # noqa: BLE001 - the point of the test: nothing else may escape
        return f"{type(e).__name__}: {e}"
    try:
        assert pixels == prepared.size[0] * prepared.size[1], "peek_pixels disagrees with the decoded size"
        check_prepared(case, prepared)
    except Exception as e:  # noqa: BLE001
        return f"malformed result: {type(e).__name__}: {e}"
    return None


@pytest.mark.parametrize("fmt_index", range(6), ids=sorted(base_images()))
@pytest.mark.slow
def test_mutated_images_prepare_or_fail_with_a_documented_error(fmt_index):
    failures = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pillow warns about corrupt EXIF and the like: fine, only raising matters
        for seed in range(fmt_index * CASES_PER_FORMAT, (fmt_index + 1) * CASES_PER_FORMAT):
            case = fuzz_case(seed)
            problem = run_case(case)
            if problem is not None:
                failures.append(f"seed {seed} ({case.what}; {case.resize}, {case.info.channels} channel(s), "
                                f"keep_source={case.keep_source}): {problem}")
    assert not failures, f"{len(failures)} cases escaped; reproduce with fuzz_case(seed):\n" + "\n".join(failures[:20])


def test_the_bases_are_valid_and_the_fuzzer_is_deterministic():
    for fmt, images in base_images().items():
        for data in images:
            assert Image.open(io.BytesIO(data)).format == fmt
            assert run_case(FuzzCase(0, data, INFOS[1], "fit", True, fmt)) is None
    assert fuzz_case(1234) == fuzz_case(1234) and fuzz_case(1234).data != fuzz_case(1235).data


def test_mutations_reach_the_decoder():
    """Most cases must get past the header (or the fuzzer only tests Image.open): both outcomes are common."""
    outcomes = {"ok": 0, "error": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed in range(0, 6 * CASES_PER_FORMAT, 25):
            case = fuzz_case(seed)
            try:
                prepare_image(case.data, case.info, resize=case.resize, max_tokens=MAX_TOKENS, **LIMITS)
                outcomes["ok"] += 1
            except DOCUMENTED_ERRORS:
                outcomes["error"] += 1
    assert outcomes["ok"] >= 20 and outcomes["error"] >= 20, outcomes
