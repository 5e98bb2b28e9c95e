"""Triton Inference Server as the peer: the real `tritonserver` binary from the `nvidia-pytriton` wheel (its C++
HTTP front end and dynamic batcher), the model code in Triton's Python backend through pytriton's `@batch` infer
functions, configured as pytriton's documentation shows (`Triton().bind(...)`, `serve()`).

Two models over the same ONNX file:
- `vit-image`: input `image`, BYTES [1] (the encoded image); decoded and preprocessed with vitserve's
  `prepare_image`, one ORT call per batch; outputs `top_index` INT64 [5], `top_score` FP32 [5] and `rollout`
  FP32 [h, w] (the grid scaled to [0, 1]).
- `vit-tensor`: input `pixel_values`, FP32 [C, -1, -1]; outputs `logits` FP32 [K] and `rollout` FP32 [h, w], as
  vitserve's /v2 infer answers.

Both batch dynamically: max batch 16, queue delay 5 ms. `--openvino-precision fp32|bf16`: the model on OpenVINO
instead of ONNX Runtime (bench/peers/image_classifier.py), for a side by side at vitserve's runtime and precision.
Run in the Triton venv (bench/peers/venvs.py) with the repository on PYTHONPATH:
`python -m vitserve.bench.peers.triton_server --model M --http-port P --grpc-port G --metrics-port Q`. SIGTERM stops
Triton and exits 0.
"""
from __future__ import annotations

import argparse
import signal
import sys

import numpy as np

from vitserve.artifact import INPUT_NAME
from vitserve.bench.peers.image_classifier import TOP_K, ImageClassifier, top_classes, unit_grid

IMAGE_MODEL, TENSOR_MODEL = "vit-image", "vit-tensor"
MAX_BATCH_SIZE, QUEUE_DELAY_US = 16, 5000


def infer_functions(classifier: ImageClassifier):
    """The two models' `@batch` infer functions: arrays in (batch first), arrays out."""
    from pytriton.decorators import batch

    @batch
    def infer_image(image: np.ndarray) -> dict:  # image: (B, 1) encoded images
        pixels = np.stack([classifier.prepare(bytes(item[0])) for item in image])  # (B, C, H, W)
        logits, rollout = classifier.run(pixels)
        tops = [top_classes(row) for row in logits]
        return {"top_index": np.stack([i for i, _ in tops]).astype(np.int64),
                "top_score": np.stack([s for _, s in tops]).astype(np.float32),
                "rollout": np.stack([unit_grid(r) for r in rollout])}

    @batch
    def infer_tensor(pixel_values: np.ndarray) -> dict:  # (B, C, H, W)
        logits, rollout = classifier.run(pixel_values)
        return {"logits": logits, "rollout": rollout}

    return infer_image, infer_tensor


def serve(model_path: str, http_port: int, grpc_port: int, metrics_port: int,
          openvino_precision: str | None = None) -> None:
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

    classifier = ImageClassifier(model_path, openvino_precision=openvino_precision)
    infer_image, infer_tensor = infer_functions(classifier)
    channels, classes = classifier.info.channels, classifier.info.num_classes
    config = ModelConfig(max_batch_size=MAX_BATCH_SIZE,
                         batcher=DynamicBatcher(max_queue_delay_microseconds=QUEUE_DELAY_US))
    rollout = Tensor(name="rollout", dtype=np.float32, shape=(-1, -1))
    triton_config = TritonConfig(http_address="127.0.0.1", http_port=http_port, grpc_address="127.0.0.1",
                                 grpc_port=grpc_port, metrics_port=metrics_port, log_verbose=0)
    # pytriton puts statistics behind an access token by default; a plain `tritonserver` does not
    security = TritonSecurityConfig(restricted_endpoints=[])
    with Triton(config=triton_config, security_config=security) as triton:
        triton.bind(model_name=IMAGE_MODEL, infer_func=infer_image, config=config, strict=True,
                    inputs=[Tensor(name="image", dtype=np.bytes_, shape=(1,))],
                    outputs=[Tensor(name="top_index", dtype=np.int64, shape=(TOP_K,)),
                             Tensor(name="top_score", dtype=np.float32, shape=(TOP_K,)), rollout])
        triton.bind(model_name=TENSOR_MODEL, infer_func=infer_tensor, config=config, strict=True,
                    inputs=[Tensor(name=INPUT_NAME, dtype=np.float32, shape=(channels, -1, -1))],
                    outputs=[Tensor(name="logits", dtype=np.float32, shape=(classes,)), rollout])
        triton.serve()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--http-port", type=int, required=True)
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--metrics-port", type=int, required=True)
    p.add_argument("--openvino-precision", choices=["fp32", "bf16"],
                   help="run the model on OpenVINO at this precision (default: ONNX Runtime, float32)")
    args = p.parse_args(argv)
    # SIGTERM unwinds through `with Triton()`, which stops tritonserver and the proxy (an unhandled SIGTERM
    # would leave them running)
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(0))
    serve(args.model, args.http_port, args.grpc_port, args.metrics_port, args.openvino_precision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
