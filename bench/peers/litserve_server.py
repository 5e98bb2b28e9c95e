"""LitServe as the peer, configured as its documentation recommends for a CPU: `accelerator="cpu"`, one inference
worker per core (`workers_per_device`), batching in the `LitAPI` (max batch 16, batch timeout 5 ms), the ZeroMQ
queue (`fast_queue=True`, "for high-throughput scenarios"), and `run()`'s production example's `log_level="warning"`
and `generate_client_file=False`; API servers left at their default (one per inference worker).

The image endpoint is `POST /predict` with the image as the multipart field `file`: LitServe 0.2's request
handler parses a body as a form or as JSON only, so a raw image body is not something it takes. Each worker does
vitserve's per-image work (bench/peers/image_classifier.py): decode_request prepares the image, predict runs one
ORT call per batch, encode_response answers top 5 and the rollout grid in vitserve's JSON shape.

Run in the LitServe venv (bench/peers/venvs.py) with the repository on PYTHONPATH:
`python -m vitserve.bench.peers.litserve_server --model M --port P`.
"""
from __future__ import annotations

import argparse
import os
import sys

import litserve as ls
import numpy as np

from vitserve.bench.peers.image_classifier import ImageClassifier

MAX_BATCH_SIZE, BATCH_TIMEOUT_S = 16, 0.005
IMAGE_FIELD = "file"


class ImageClassifierAPI(ls.LitAPI):
    """decode (prepare the image) -> batch -> predict (one ORT call) -> unbatch -> encode (top 5, rollout grid)."""

    def __init__(self, model_path: str, workers: int, **kwargs):
        super().__init__(**kwargs)
        self.model_path, self.workers = model_path, workers

    def setup(self, device) -> None:
        self.classifier = ImageClassifier(self.model_path, self.workers)

    def decode_request(self, request) -> np.ndarray:  # request: the parsed form
        return self.classifier.prepare(request[IMAGE_FIELD].file.read())  # (C, H, W)

    def batch(self, inputs: list[np.ndarray]) -> np.ndarray:
        return np.stack(inputs)  # (B, C, H, W)

    def predict(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.classifier.run(pixels)

    def unbatch(self, output: tuple[np.ndarray, np.ndarray]) -> list:
        logits, rollout = output
        return list(zip(logits, rollout))

    def encode_response(self, output) -> dict:
        return self.classifier.answer(*output)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="inference workers (default: one "
                                                                            "per core, as LitServe advises)")
    args = p.parse_args(argv)
    api = ImageClassifierAPI(args.model, args.workers, max_batch_size=MAX_BATCH_SIZE, batch_timeout=BATCH_TIMEOUT_S)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=args.workers,
                          fast_queue=True)
    server.run(host="127.0.0.1", port=args.port, log_level="warning", generate_client_file=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
