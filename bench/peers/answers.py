"""Is each server right? One request per server and path, its answer compared with the raw ONNX Runtime session's
result on the same image: the same top class, and the numbers within `TOLERANCE` (logits on the tensor paths; on
the image path, where the answer is the top 5, their probabilities), and a rollout of the model's grid.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np

from vitserve.bench.oip import decode_outputs
from vitserve.bench.peers.bodies import PeerRequest
from vitserve.bench.peers.image_classifier import softmax
from vitserve.service.schemas.binary_tensors import HEADER_LENGTH

TOLERANCE = 1e-4
# a server computing in bfloat16 (8 bits of mantissa) against the float32 session: the default model's logits move by
# up to 0.047 in bf16 (docs/results/bench-runtimes.md), ViT-S/16's by 0.39 of about 5
# (docs/results/bench-runtimes.md#vit-s16)
BF16_TOLERANCE = 0.05


def post(url: str, request: PeerRequest, timeout_s: float) -> tuple[int, bytes, str | None]:
    """(status, body, Inference-Header-Content-Length) of one request on its own connection."""
    req = urllib.request.Request(url + request.target, data=request.body, headers=request.headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read(), r.headers.get(HEADER_LENGTH)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), None


def answer_values(server: str, path: str, body: bytes, header_length: str | None) -> dict:
    """What an answer says: top indices and their scores (image path) or logits (tensor paths), and the rollout
    grid's shape."""
    if path != "image":
        outputs, _ = decode_outputs(body, header_length)
        return {"logits": outputs["logits"].reshape(-1), "grid": list(outputs["rollout"].shape[-2:])}
    if server == "triton":
        outputs, _ = decode_outputs(body, header_length)
        return {"indices": outputs["top_index"].reshape(-1).astype(np.int64),
                "scores": outputs["top_score"].reshape(-1),
                "grid": list(outputs["rollout"].shape[-2:])}
    doc = json.loads(body)  # vitserve's /v1/classify, LitServe's and the FastAPI app's answers share this shape
    rollout = doc["rollout"]
    return {"indices": np.array([p["index"] for p in doc["predictions"]]),
            "scores": np.array([p["score"] for p in doc["predictions"]]), "grid": [rollout["height"], rollout["width"]]}


def compare(values: dict, logits: np.ndarray, grid: list[int], temperature: float = 1.0,
            tolerance: float = TOLERANCE) -> dict:
    """`values` (answer_values) against the raw session's logits (K,) and rollout grid (h, w). Scores may be plain
    softmax (the peers, an older vitserve) or softmax(logits / temperature), the file's calibrated scores."""
    if "logits" in values:
        top1, difference = int(np.argmax(values["logits"])), float(np.max(np.abs(values["logits"] - logits)))
    else:
        top1 = int(values["indices"][0])
        difference = min(float(np.max(np.abs(values["scores"] - softmax(logits / t)[values["indices"]])))
                         for t in {1.0, temperature})
    ok = top1 == int(np.argmax(logits)) and difference <= tolerance and values["grid"] == grid
    return {"ok": bool(ok), "top1": top1, "max_abs_diff": difference, "grid": values["grid"]}


def scale(logits: np.ndarray) -> float:
    """What a logit tolerance is relative to: the largest |logit|, at least 1."""
    return max(1.0, float(np.abs(logits).max()))


def check(server: str, path: str, url: str, request: PeerRequest, logits: np.ndarray, grid: list[int],
          temperature: float = 1.0, timeout_s: float = 120.0, bf16: bool = False) -> dict:
    """One answer of `server` (a family: vitserve, triton, litserve, fastapi) on `path`, against the float32 session's;
    `bf16`: within BF16_TOLERANCE (of the largest logit on the tensor paths, of a probability on the image path)."""
    status, body, header_length = post(url, request, timeout_s)
    if status != 200:
        return {"ok": False, "status": status, "error": body[:300].decode(errors="replace")}
    tolerance = BF16_TOLERANCE * (1.0 if path == "image" else scale(logits)) if bf16 else TOLERANCE
    try:
        return {"status": status, **compare(answer_values(server, path, body, header_length), logits, grid,
                                            temperature, tolerance)}
    except (ValueError, KeyError, TypeError, IndexError) as e:
        return {"ok": False, "status": status, "error": f"{type(e).__name__}: {e}"}
