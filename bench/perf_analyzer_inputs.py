"""Input files for Triton's perf_analyzer against vitserve: `--input-data pixels.json` (the normalised
`pixel_values` tensor) and `--input-data image.json` (the encoded image through the `image` BYTES input).

perf_analyzer sends every input the model's metadata lists unless `--input-data` names the ones to send; for
a BYTES input its `b64` content is the serialised tensor (each element's 4-byte length, then its bytes).

    python -m vitserve.bench.perf_analyzer_inputs --model models/vit-fmnist/model.onnx --out build/perf-analyzer
    perf_analyzer -m vit-fmnist -u 127.0.0.1:8000 -i http --input-data build/perf-analyzer/pixels.json
"""
from __future__ import annotations

import argparse
import base64
import json
from pathlib import Path

import numpy as np

from vitserve.artifact import INPUT_NAME
from vitserve.bench.load import make_images
from vitserve.service.engine.inference_model import read_model_file_info
from vitserve.service.ground.settings import Settings
from vitserve.service.schemas.binary_tensors import pack_bytes
from vitserve.service.schemas.v1 import IMAGE_INPUT_NAME
from vitserve.service.usecases.preprocess import prepare_image


def perf_analyzer_inputs(model_path: Path, count: int = 4) -> dict[str, dict]:
    """{file name: perf_analyzer input data}: `count` distinct test images, as pixels and as PNGs."""
    info, s = read_model_file_info(model_path), Settings()
    images = make_images("png", info.image_size, info.channels, count)
    pixels = np.stack([prepare_image(image, info, resize="fit", max_bytes=s.max_upload_bytes,
                                     max_pixels=s.max_image_pixels, max_tokens=s.max_native_tokens).pixels
                       for image in images])  # (count, C, H, W), as the server prepares them
    return {
        "pixels.json": {"data": [{INPUT_NAME: {"content": p.ravel().tolist(), "shape": list(p.shape)}}
                                 for p in pixels]},
        "image.json": {"data": [{IMAGE_INPUT_NAME: {"b64": base64.b64encode(pack_bytes([image])).decode(),
                                                    "shape": [1]}} for image in images]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vitserve.bench.perf_analyzer_inputs",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/vit-fmnist/model.onnx"))
    parser.add_argument("--out", type=Path, default=Path("build/perf-analyzer"))
    parser.add_argument("--count", type=int, default=4, help="distinct images (default 4)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, document in perf_analyzer_inputs(args.model, args.count).items():
        (args.out / name).write_text(json.dumps(document))
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
