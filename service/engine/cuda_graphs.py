"""CUDA graphs for the fast path: one static session per batch bucket at the trained image size.

A ViT's forward is hundreds of small kernels; at small batches the GPU waits for the CPU to launch them (the default
model in fp32 takes 1.67 ms dynamic and 0.468 ms captured at batch 1 on an H100, docs/results/bench-gpu.md). ONNX
Runtime can capture a session's kernels once and replay them as one CUDA graph (`enable_cuda_graph`), but only when
every node runs on CUDA with fixed shapes and fixed input and output addresses. The artifact's graph has symbolic batch,
height and width, and its shape arithmetic (the position embeddings' resampling to the image's grid) then runs on the
CPU. So each bucket gets its own session with the dimensions fixed (`add_free_dimension_override_by_name`): ORT folds
the shape arithmetic and the resampled position embeddings into constants, and what is left runs on CUDA. Each bucket's
input and outputs live in device buffers allocated once and bound through an IOBinding; a batch is copied into its
bucket's input (zero-padded up to the bucket) and its rows read back from the outputs.

Only batches at the trained size take this path; any other size runs on the dynamic fast session.
"""
from __future__ import annotations

import functools
import logging
import threading
import time

import numpy as np

log = logging.getLogger("vitserve.runtime")


def bucket_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... and `max_batch_size` itself: a batch pads to at most twice its size."""
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch_size]


def pad_rows(pixel_values: np.ndarray, size: int) -> np.ndarray:
    """`pixel_values` with zero images after them up to `size` rows (itself where it has as many)."""
    count = len(pixel_values)
    if count >= size:
        return pixel_values
    padding = np.zeros((size - count, *pixel_values.shape[1:]), pixel_values.dtype)
    return np.concatenate([pixel_values, padding])


def padded_size(count: int, step: int, largest: int) -> int:
    """`count` rounded up to a multiple of `step`, or below `step` to a power of two (1, 2, 4, ... as vLLM's CUDA
    graph sizes: a lone image stays one), but not past `largest` (nor below `count`); `step` 0 or 1: itself."""
    if step <= 1:
        return count
    rounded = -(-count // step) * step if count > step // 2 else 1 << (count - 1).bit_length()
    return max(count, min(rounded, largest))


class CapturedBucket:
    """One batch size's static session, its device buffers and its IOBinding."""

    def __init__(self, session, input_name: str, batch: int, input_shape: tuple[int, ...],
                 outputs: list[tuple[str, tuple[int, ...], type]], device_id: int, device: str = "cuda"):
        """`device`: where the buffers live ("cpu" only in tests: the same binding without a GPU)."""
        import onnxruntime as ort

        self.session, self.batch, self.lock = session, batch, threading.Lock()
        self.input = ort.OrtValue.ortvalue_from_shape_and_type(input_shape, np.float32, device, device_id)
        self.binding = session.io_binding()
        self.binding.bind_ortvalue_input(input_name, self.input)
        self.outputs = []
        for name, item_shape, dtype in outputs:
            value = ort.OrtValue.ortvalue_from_shape_and_type([batch, *item_shape], dtype, device, device_id)
            self.binding.bind_ortvalue_output(name, value)
            self.outputs.append(value)

    def run(self, pixel_values: np.ndarray, fill=None) -> list[np.ndarray]:
        """`fill(pixels, device_input)`: writes raw pixels into the bucket's input on the device (the engine's
        normaliser: service/engine/pixels.py); None: `pixel_values` are the float32 input itself."""
        count = len(pixel_values)
        pixel_values = pad_rows(pixel_values, self.batch)  # their rows are dropped below
        with self.lock:  # one set of device buffers per bucket
            if fill is None:
                self.input.update_inplace(np.ascontiguousarray(pixel_values, np.float32))
            else:
                fill(pixel_values, self.input)
            self.session.run_with_iobinding(self.binding)  # the first call captures, later calls replay
            return [value.numpy()[:count] for value in self.outputs]


class CudaGraphBuckets:
    """The fast path at the trained size as one captured session per bucket; `covers` says which batches.

    A captured graph is not always the faster: on an H100, ViT-B/16 in float16 ran a batch of 64 in 23.3 ms captured
    against 20.7 ms on the dynamic session (with the shapes fixed ORT optimises the graph otherwise: on the CPU it
    turns the MatMuls into Gemms between reshapes), while at batch 1 the graph took 1.4 ms against 3.5 ms. So each
    bucket is timed both ways when it is captured, and kept only where its graph wins; a batch whose bucket lost
    runs on the dynamic session unpadded."""

    def __init__(self, buckets: dict[int, CapturedBucket], sizes: list[int], image_shape: tuple[int, int, int],
                 timings: dict[int, tuple[float, float]] | None = None):
        self.buckets, self.sizes, self.image_shape = buckets, sorted(sizes), image_shape
        self.timings = timings or {}  # bucket -> (captured ms, dynamic ms), as measured at load

    @classmethod
    def build(cls, make_session, input_name: str, dims: tuple[str | None, str | None, str | None],
              image_shape: tuple[int, int, int], outputs: list[tuple[str, tuple[int, ...], type]], sizes: list[int],
              device_id: int, run_dynamic=None, calls: int = 5) -> CudaGraphBuckets:
        """`make_session(overrides, options)` makes a session of the fast graph with the named dimensions fixed and
        `options` added to the CUDA provider's; `dims` the input's batch, height and width names; `outputs` each
        output's name, shape per image and numpy type, in the order `run` returns them. With `run_dynamic` (the
        dynamic session's call), each bucket is kept only if its graph beats it (median of `calls`)."""
        channels, height, width = image_shape
        buckets, timings = {}, {}
        for size in sizes:
            overrides = {name: value for name, value in zip(dims, (size, height, width)) if name}
            session = make_session(overrides, {"enable_cuda_graph": "1"})
            bucket = CapturedBucket(session, input_name, size, (size, channels, height, width), outputs, device_id)
            zeros = np.zeros((size, channels, height, width), np.float32)
            bucket.run(zeros)  # capture now, not on a request
            if run_dynamic is not None:
                timings[size] = (median_ms(functools.partial(bucket.run, zeros), calls),
                                 median_ms(functools.partial(run_dynamic, zeros), calls))
                if timings[size][0] >= timings[size][1]:
                    continue  # the session and its buffers go: the dynamic session serves this bucket
            buckets[size] = bucket
        log.info("CUDA graphs at %dx%d: %s", height, width, ", ".join(
            f"batch {s} {'captured' if s in buckets else 'dynamic'}"
            + (f" ({timings[s][0]:.2f} vs {timings[s][1]:.2f} ms)" if s in timings else "") for s in sizes))
        return cls(buckets, sizes, image_shape, timings)

    def bucket_for(self, count: int) -> int | None:
        return next((s for s in self.sizes if s >= count), None)

    def covers(self, pixel_values: np.ndarray) -> bool:
        return (tuple(pixel_values.shape[1:]) == self.image_shape and len(pixel_values) > 0
                and self.bucket_for(len(pixel_values)) in self.buckets)

    def run(self, pixel_values: np.ndarray, fill=None) -> list[np.ndarray]:
        size = self.bucket_for(len(pixel_values))
        assert size is not None, "the caller checked `covers` first"
        return self.buckets[size].run(pixel_values, fill)


def median_ms(call, calls: int) -> float:
    """The median ms of `calls` calls of `call()`, after one that is not counted (it sets things up)."""
    return float(np.median(call_times_ms(call, calls)))


def call_times_ms(call, calls: int, set_up: bool = True) -> list[float]:
    """The ms of each of `calls` calls of `call()`, after one that is not counted (it sets things up), unless
    `set_up` is False (a caller that made it already)."""
    if set_up:
        call()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    return times
