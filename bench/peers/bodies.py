"""What each server is sent on each path: one request (target, body, headers) per server and path, for the same
image. The Open Inference Protocol bodies are bench/oip.py's (framed by service/schemas/binary_tensors.py), byte for
byte the same to vitserve and to Triton.

- `image`: each server's own way of taking an encoded image. vitserve: `POST /v1/classify`, the PNG as the body
  (Content-Type image/png). Triton: `POST /v2/models/vit-image/infer`, the PNG as a binary BYTES input `image` of
  shape [1, 1], outputs as JSON. LitServe: `POST /predict`, the PNG as the multipart field `file`.
- `oip-json`: `pixel_values` FP32 [1, C, H, W] as a JSON list; `logits` and `rollout` answered as JSON.
- `oip-binary`: the same tensor as raw float32 after the JSON header (binary tensor extension); both outputs binary.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vitserve.bench.oip import binary_request, classify_request, infer_target, json_request
from vitserve.service.schemas.binary_tensors import join_body, pack_bytes

TRITON_IMAGE_MODEL, TRITON_TENSOR_MODEL = "vit-image", "vit-tensor"  # bench/peers/triton_server.py binds these
BOUNDARY = "vitserve-bench-boundary"


@dataclass(frozen=True)
class PeerRequest:
    target: str
    body: bytes
    headers: dict[str, str]


def multipart_image(png: bytes, field: str = "file", boundary: str = BOUNDARY) -> tuple[bytes, dict[str, str]]:
    """The PNG as the one file field of a multipart/form-data body."""
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{field}\"; filename=\"image.png\"\r\n"
            f"Content-Type: image/png\r\n\r\n").encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    return head + png + tail, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def triton_image_request(png: bytes) -> tuple[bytes, dict[str, str]]:
    """The PNG as a one-element binary BYTES input `image` [1, 1] (batch of one); the outputs as JSON."""
    data = pack_bytes([png])
    tensor = {"name": "image", "datatype": "BYTES", "shape": [1, 1], "parameters": {"binary_data_size": len(data)}}
    outputs = [{"name": n} for n in ("top_index", "top_score", "rollout")]
    return join_body({"inputs": [tensor], "outputs": outputs}, [data])


def peer_request(server: str, path: str, png: bytes, pixels: np.ndarray, vitserve_model: str) -> PeerRequest:
    """`server`'s request on `path` for the image `png`, whose vitserve preprocessing is `pixels` (1, C, H, W)."""
    if path == "image":
        body, headers = {"vitserve": classify_request, "triton": triton_image_request,
                         "litserve": multipart_image, "fastapi": multipart_image}[server](png)
        target = {"vitserve": "/v1/classify", "triton": infer_target(TRITON_IMAGE_MODEL), "litserve": "/predict",
                  "fastapi": "/classify"}
        return PeerRequest(target[server], body, headers)
    if server not in ("vitserve", "triton"):
        raise ValueError(f"{server} has no Open Inference Protocol endpoint")
    body, headers = {"oip-json": json_request, "oip-binary": binary_request}[path](pixels)
    model = vitserve_model if server == "vitserve" else TRITON_TENSOR_MODEL
    return PeerRequest(infer_target(model), body, headers)
