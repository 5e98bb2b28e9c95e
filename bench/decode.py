"""`python -m vitserve.bench.decode`: what decoding an upload costs one core, per format and decoder.

Decoding is most of a request's CPU once the model runs on a GPU, and the formats differ several-fold (a PNG costs
several times a JPEG of the same size). For real photos (scikit-image's) at 224x224, 640x480 and 1920x1080, encoded
as PNG and as JPEG (quality 90), each decoder runs alone on one thread (the server decodes on a pool of such
threads): the median ms per image over alternating rounds, and images/s per core. Two columns decode to the model's
input, 224x224 RGB: the full decode followed by a resize, and what the server does (service/usecases/preprocess.py:
Pillow's JPEG draft mode, which lets libjpeg scale by 1/2, 1/4 or 1/8 inside the DCT, then the resize).

Decoders: Pillow (the server's), Pillow with `draft`, and simplejpeg (libjpeg-turbo's API, with its own DCT
scaling through `min_height`/`min_width`) where installed.
"""
from __future__ import annotations

import argparse
import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

import numpy as np
from PIL import Image

from vitserve.bench.report import command_line, publish

SIZES = {"224x224": (224, 224), "640x480": (640, 480), "1920x1080": (1920, 1080)}
TARGET = (224, 224)


def photo(size: tuple[int, int]) -> Image.Image:
    """scikit-image's astronaut (512x512), resized to `size` (width, height): a real photo's statistics."""
    import skimage.data

    return Image.fromarray(skimage.data.astronaut()).resize(size, Image.Resampling.BICUBIC)


def encoded(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return out.getvalue()


def pillow_full(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


def pillow_to_target(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB").resize(TARGET, Image.Resampling.BICUBIC))


def pillow_draft_to_target(data: bytes) -> np.ndarray:
    """As the server: draft (JPEG only: DCT scaling to at least the target), then the resize."""
    with Image.open(io.BytesIO(data)) as image:
        image.draft("RGB", TARGET)
        return np.asarray(image.convert("RGB").resize(TARGET, Image.Resampling.BICUBIC))


class Decoder(TypedDict):
    formats: tuple[str, ...]  # the image formats it reads
    full: Callable[[bytes], np.ndarray] | None  # the image at its own size
    to_target: Callable[[bytes], np.ndarray]  # the image at TARGET, by the decoder's cheapest way there


def decoders() -> dict[str, Decoder]:
    """{name: {"formats", "full", "to_target"}}: each decoder's calls, None where it has no such mode."""
    table: dict[str, Decoder] = {
        "Pillow": {"formats": ("PNG", "JPEG"), "full": pillow_full, "to_target": pillow_to_target},
        "Pillow draft": {"formats": ("JPEG",), "full": None, "to_target": pillow_draft_to_target}}
    try:
        import simplejpeg
    except ImportError:
        return table

    def simplejpeg_to_target(data: bytes) -> np.ndarray:
        scaled = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=TARGET[1], min_width=TARGET[0])
        return np.asarray(Image.fromarray(scaled).resize(TARGET, Image.Resampling.BICUBIC))

    table["simplejpeg"] = {"formats": ("JPEG",), "full": lambda data: simplejpeg.decode_jpeg(data, colorspace="RGB"),
                           "to_target": simplejpeg_to_target}
    return table


def median_ms(call, data: bytes, seconds: float) -> float:
    call(data)
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - started < seconds:
        begun = time.perf_counter()
        call(data)
        times.append((time.perf_counter() - begun) * 1000)
    return float(np.median(times))


def measure(rounds: int, seconds: float) -> list[dict]:
    rows = []
    for size_name, size in SIZES.items():
        image = photo(size)
        for fmt in ("PNG", "JPEG"):
            data = encoded(image, fmt)
            cases = {(name, mode): calls[mode] for name, calls in decoders().items() if fmt in calls["formats"]
                     for mode in ("full", "to_target") if calls[mode] is not None}
            times: dict[tuple, list[float]] = {case: [] for case in cases}
            for _ in range(rounds):  # alternating: a burst of load elsewhere costs one round, not one decoder
                for case, call in cases.items():
                    times[case].append(median_ms(call, data, seconds))
            for (name, mode), values in times.items():
                ms = float(np.median(values))
                rows.append({"size": size_name, "format": fmt, "bytes": len(data), "decoder": name, "mode": mode,
                             "ms": ms, "images_per_s_per_core": 1000 / ms})
    return rows


def render(rows: list[dict], command: str) -> str:
    lines = ["# Decode cost per core", "", f"`{command}`: one thread, the median of alternating rounds (bench/"
             "decode.py). `full`: the image as sent; `to 224`: decoded and resized to 224x224 RGB, the model's input "
             "(`Pillow draft` is the server's own path).", "",
             "| image | format | bytes | decoder | mode | ms | images/s per core |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        mode = "full" if r["mode"] == "full" else "to 224"
        lines.append(f"| {r['size']} | {r['format']} | {r['bytes']:,} | {r['decoder']} | {mode} | {r['ms']:.2f} | "
                     f"{r['images_per_s_per_core']:,.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vitserve.bench.decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.3, help="per decoder and round")
    p.add_argument("--out", type=Path, help="write the table here (Markdown) and its JSON beside it")
    args = p.parse_args(argv)
    import os
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = measure(args.rounds, args.seconds)
    publish(render(rows, command_line("python -m vitserve.bench.decode", argv)), rows, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
