"""The per-image work every peer server does, the same as vitserve's: `service.usecases.preprocess.prepare_image`
(Pillow decode, resize, normalise), one ONNX Runtime call per batch returning logits and rollout, then the top 5
classes and the rollout grid scaled to [0, 1] (as service/usecases/postprocess.py computes them).

It runs inside the peers' own virtual environments (Triton's, LitServe's), which hold numpy, Pillow and onnxruntime
and nothing of vitserve's serving stack: so this module imports only `service.usecases.preprocess` and
`vitserve.onnx_header` (both pure), and writes down vitserve's default limits and session options instead of importing
`service.settings` (pydantic). tests/bench/test_peers.py holds them equal to vitserve's. With `openvino_precision`
(Triton's venv holds onnx and openvino for it) the model is compiled by vitserve's own `OpenVinoModel.compile` and
`graph_paths`, which import no more of the serving stack than its error classes.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TypedDict

import numpy as np

from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES
from vitserve.onnx_header import read_model_info
from vitserve.service.usecases.preprocess import prepare_image

TOP_K = 5


class Limits(TypedDict):
    max_bytes: int
    max_pixels: int
    max_tokens: int


# vitserve's defaults (service/ground/settings.py): max_upload_bytes, max_image_pixels, max_native_tokens
LIMITS: Limits = {"max_bytes": 20 * 2**20, "max_pixels": 40_000_000, "max_tokens": 1024}


def session_options(workers: int = 1):
    """vitserve's default session options: every optimisation, the cores shared out among the worker processes
    (all of them, ORT's default, for one), one inter-op thread, sequential, no spinning between calls."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = 0 if workers == 1 else max(1, (os.cpu_count() or 1) // workers)
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=-1, keepdims=True)


def top_classes(logits: np.ndarray, k: int = TOP_K) -> tuple[np.ndarray, np.ndarray]:
    """(K,) logits -> the k most probable (indices, probabilities), highest first; ties keep the lower index."""
    probabilities = softmax(logits)
    order = np.argsort(-probabilities, kind="stable")[:k]
    return order, probabilities[order]


def unit_grid(rollout: np.ndarray) -> np.ndarray:
    """(h, w) rollout min-max scaled to [0, 1] (a constant map is all zeros)."""
    grid = rollout.astype(np.float32)
    low, high = float(grid.min()), float(grid.max())
    if not np.isfinite(low) or not np.isfinite(high) or high - low <= 1e-12:
        return np.zeros_like(grid)
    return (grid - low) / (high - low)


class ImageClassifier:
    """One ONNX Runtime session over a vitserve artifact, and the work around it; with `openvino_precision`, the
    artifact's fast graph compiled by vitserve's OpenVINO runtime at that precision instead (every core)."""

    def __init__(self, model_path: str | Path, workers: int = 1, openvino_precision: str | None = None):
        import onnxruntime as ort

        self.info = read_model_info(model_path)
        self.session = self.openvino = None
        if openvino_precision:
            self.openvino = openvino_model(model_path, self.info, openvino_precision)
        else:
            self.session = ort.InferenceSession(str(model_path), sess_options=session_options(workers),
                                                providers=["CPUExecutionProvider"])

    def prepare(self, data: bytes) -> np.ndarray:
        """Encoded image -> (C, H, W) float32, exactly as vitserve's /v1/classify prepares it (resize=fit)."""
        return prepare_image(data, self.info, resize="fit", **LIMITS).pixels

    def run(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(B, C, H, W) -> logits (B, K) and rollout (B, h, w): one call."""
        if self.openvino is not None:
            logits, rollout, *_ = self.openvino.run(pixels)  # the file's optional outputs after these two
            return logits, rollout
        assert self.session is not None  # __init__ makes the session where it makes no OpenVINO model
        logits, rollout = self.session.run(list(OUTPUT_NAMES), {INPUT_NAME: pixels})
        return logits, rollout

    def answer(self, logits: np.ndarray, rollout: np.ndarray) -> dict:
        """One image's JSON answer, shaped as vitserve's /v1/classify default (top 5, grid rounded to 6 places)."""
        indices, scores = top_classes(logits)
        grid = unit_grid(rollout)
        return {"predictions": [{"index": int(i), "label": self.info.labels[i], "score": float(s)}
                                for i, s in zip(indices, scores)],
                "rollout": {"height": grid.shape[0], "width": grid.shape[1],
                            "values": [[round(float(v), 6) for v in row] for row in grid]}}


def openvino_model(model_path: str | Path, info, precision: str):
    """The artifact's fast graph compiled as vitserve compiles it (service/engine/openvino_runtime.py), every core."""
    import onnx

    from vitserve.service.engine.graph_paths import split_paths
    from vitserve.service.engine.openvino_runtime import OpenVinoModel

    return OpenVinoModel.compile(split_paths(onnx.load(str(model_path))).fast.SerializeToString(), info, precision,
                                 threads=0)
