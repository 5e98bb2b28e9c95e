"""8-bit pixels normalised where the model runs.

A frontend sends the engine normalised float32 pixels, or, when the engine runs on a GPU, the decoded uint8 ones
(a quarter of the bytes through shared memory, the batch's stack and the copy to the device; the GPU kit found
the copy of 38 MB of float32 pixels per ViT-B/16 batch of 64 on the runner between two batches). The engine then
normalises them on the device with a graph of its own: the artifact's per-channel table of the 256 values
(`vitserve.artifact.normalization_table`) gathered by pixel value, so the result is bit-identical to the frontend's
and the model sees the same input either way. The model's own graph is not touched: FP32 tensors, the relevance
path and every other runtime keep taking float32 (`host`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from vitserve.artifact import INPUT_NAME, lookup, normalization_table
from vitserve.service.engine.providers import GPU_PROVIDERS

if TYPE_CHECKING:  # onnx is imported where the engine builds the graph, not by every frontend that reads this
    import onnx

RAW_INPUT = "pixels_uint8"
# the normaliser's own graph: any ONNX Runtime of this project runs opset 17's Cast, Add and Gather
NORMALISER_OPSET = 17


def engine_normalises(pixel_transport: str, provider: str) -> bool:
    """Whether the engine takes uint8 pixels and normalises them itself (the `pixel_transport` setting): "auto"
    when its models run on a GPU."""
    return pixel_transport == "uint8" or (pixel_transport == "auto" and provider in GPU_PROVIDERS)


class PixelTable:
    """A model's normalisation (its file's mean and std per channel) as a (C, 256) table: `host` applies it on the
    CPU, `graph` as an ONNX graph."""

    def __init__(self, mean: list[float], std: list[float]):
        self.channels = len(mean)
        self.table = normalization_table(mean, std)  # (C, 256) float32

    def host(self, pixels: np.ndarray) -> np.ndarray:
        """(B, C, H, W) uint8 -> float32, on the CPU: what the frontend would have sent."""
        out = np.empty(pixels.shape, np.float32)
        for c in range(self.channels):
            lookup(self.table[c], pixels[:, c], out=out[:, c])
        return out

    def graph(self) -> onnx.ModelProto:
        """uint8 (B, C, H, W) -> float32: Gather from the table flattened, each channel's values offset by 256 * c.
        A gather, not `(x / 255 - mean) / std` on the device: no arithmetic, so no device can round it otherwise."""
        from onnx import TensorProto, helper, numpy_helper

        dims: list[str | int] = ["batch", self.channels, "height", "width"]
        offsets = (np.arange(self.channels, dtype=np.int32) * 256).reshape(1, self.channels, 1, 1)
        nodes = [helper.make_node("Cast", [RAW_INPUT], ["values"], to=TensorProto.INT32),
                 helper.make_node("Add", ["values", "channel_offsets"], ["indices"]),
                 helper.make_node("Gather", ["table", "indices"], [INPUT_NAME], axis=0)]
        graph = helper.make_graph(
            nodes, "vitserve_normalise_pixels",
            [helper.make_tensor_value_info(RAW_INPUT, TensorProto.UINT8, dims)],
            [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, dims)],
            initializer=[numpy_helper.from_array(self.table.reshape(-1), "table"),
                         numpy_helper.from_array(offsets, "channel_offsets")])
        opsets = [helper.make_opsetid("", NORMALISER_OPSET)]
        # the oldest IR version the opset allows, not the onnx package's newest: onnx 1.23 writes IR 14 by default,
        # which onnxruntime-gpu 1.31 refuses (the first GPU run of this graph failed so)
        return helper.make_model(graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets))


class DeviceNormaliser:
    """The table's graph as an ONNX Runtime session on the model's device: uint8 pixels in from the host, float32
    out into device memory (a buffer it allocates, or a captured bucket's input), never back to the host."""

    def __init__(self, session, device: str, device_id: int = 0):
        self.session, self.device, self.device_id = session, device, device_id

    def to_device(self, pixels: np.ndarray, out=None):
        """`pixels` (B, C, H, W) uint8 normalised into `out` (an OrtValue of that shape) or a new OrtValue on the
        device; returns it."""
        binding = self.session.io_binding()
        binding.bind_cpu_input(RAW_INPUT, np.ascontiguousarray(pixels, np.uint8))
        if out is None:
            binding.bind_output(INPUT_NAME, self.device, self.device_id)
        else:
            binding.bind_ortvalue_output(INPUT_NAME, out)
        self.session.run_with_iobinding(binding)
        return out if out is not None else binding.get_outputs()[0]
