"""CUDA graphs for the fast path: one static session per batch bucket at the trained image size.

A ViT's forward is hundreds of small kernels; at small batches the GPU waits for the CPU to launch them (the default
model took 1.86 ms at batch 1 on an H100, docs/bench-gpu.md). ONNX Runtime can capture a session's kernels once
and replay them as one CUDA graph (`enable_cuda_graph`), but only when every node runs on CUDA with fixed shapes
and fixed input and output addresses. The artifact's graph has symbolic batch, height and width, and its shape
arithmetic (the position embeddings' resampling to the image's grid) then runs on the CPU. So each bucket gets its
own session with the dimensions fixed (`add_free_dimension_override_by_name`): ORT folds the shape arithmetic and
the resampled position embeddings into constants, and what is left runs on CUDA. Each bucket's input and outputs
live in device buffers allocated once and bound through an IOBinding; a batch is copied into its bucket's input
(zero-padded up to the bucket) and its rows read back from the outputs.

Only batches at the trained size take this path; any other size runs on the dynamic fast session.
"""
from __future__ import annotations

import logging
import threading

import numpy as np

log = logging.getLogger("vitserve.runtime")

def bucket_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... and `max_batch_size` itself: a batch pads to at most twice its size."""
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch_size]


class CapturedBucket:
    """One batch size's static session, its device buffers and its IOBinding."""

    def __init__(self, session, input_name: str, batch: int, input_shape: tuple[int, ...],
                 outputs: list[tuple[str, tuple[int, ...], type]], device_id: int):
        import onnxruntime as ort

        self.session, self.batch, self.lock = session, batch, threading.Lock()
        self.input = ort.OrtValue.ortvalue_from_shape_and_type(input_shape, np.float32, "cuda", device_id)
        self.binding = session.io_binding()
        self.binding.bind_ortvalue_input(input_name, self.input)
        self.outputs = []
        for name, item_shape, dtype in outputs:
            value = ort.OrtValue.ortvalue_from_shape_and_type([batch, *item_shape], dtype, "cuda", device_id)
            self.binding.bind_ortvalue_output(name, value)
            self.outputs.append(value)

    def run(self, pixel_values: np.ndarray) -> list[np.ndarray]:
        count = len(pixel_values)
        if count < self.batch:  # zero images fill the bucket; their rows are dropped below
            padding = np.zeros((self.batch - count, *pixel_values.shape[1:]), np.float32)
            pixel_values = np.concatenate([pixel_values, padding])
        with self.lock:  # one set of device buffers per bucket
            self.input.update_inplace(np.ascontiguousarray(pixel_values, np.float32))
            self.session.run_with_iobinding(self.binding)  # the first call captures, later calls replay
            return [value.numpy()[:count] for value in self.outputs]


class CudaGraphBuckets:
    """The fast path at the trained size as one captured session per bucket; `covers` says which batches."""

    def __init__(self, buckets: dict[int, CapturedBucket], image_shape: tuple[int, int, int]):
        self.buckets, self.image_shape = buckets, image_shape
        self.largest = max(buckets)

    @classmethod
    def build(cls, make_session, input_name: str, dims: tuple[str | None, str | None, str | None],
              image_shape: tuple[int, int, int], outputs: list[tuple[str, tuple[int, ...], type]], sizes: list[int],
              device_id: int) -> "CudaGraphBuckets":
        """`make_session(overrides, options)` makes a session of the fast graph with the named dimensions fixed and
        `options` added to the CUDA provider's; `dims` the input's batch, height and width names; `outputs` each
        output's name, shape per image and numpy type, in the order `run` returns them."""
        channels, height, width = image_shape
        buckets = {}
        for size in sizes:
            overrides = {name: value for name, value in zip(dims, (size, height, width)) if name}
            session = make_session(overrides, {"enable_cuda_graph": "1"})
            bucket = CapturedBucket(session, input_name, size, (size, channels, height, width), outputs, device_id)
            bucket.run(np.zeros((size, channels, height, width), np.float32))  # capture now, not on a request
            buckets[size] = bucket
        log.info("CUDA graphs captured for batches %s at %dx%d", ", ".join(map(str, sizes)), height, width)
        return cls(buckets, image_shape)

    def covers(self, pixel_values: np.ndarray) -> bool:
        return tuple(pixel_values.shape[1:]) == self.image_shape and 0 < len(pixel_values) <= self.largest

    def run(self, pixel_values: np.ndarray) -> list[np.ndarray]:
        size = min(s for s in self.buckets if s >= len(pixel_values))
        return self.buckets[size].run(pixel_values)
