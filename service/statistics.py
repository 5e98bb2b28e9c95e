"""Triton's statistics extension (`GET /v2/models/{name}/stats`), kept from the numbers the service already
reports to its metrics: plain counters and nanosecond sums, in this process.

The meaning follows Triton's `docs/protocol/extension_statistics.md`, with our units of work:
- `success` / `fail`: inference requests (/v1/classify, /v1/classify/batch, /v2 infer) and their whole
  duration, by outcome;
- `queue`, `compute_input`, `compute_infer`, `compute_output`: per image: its wait in the batch queue,
  its preparation (image decoding and preprocessing, or a tensor's parse), the model call of its batch, and
  its encoding (top-k, maps, the response tensors);
- `inference_count`: images run; `execution_count`: model calls (batches); `batch_stats`: per batch size,
  the model calls (`compute_infer`) and the stacking of their inputs (`compute_input`).
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * 1e9) * count

    def to_json(self) -> dict:
        return {"count": self.count, "ns": self.ns}


class InferenceStatistics:
    """The running totals of one served model in this process."""

    STAGES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")

    def __init__(self):
        self.stages = {stage: Duration() for stage in self.STAGES}
        self.batches: dict[int, dict[str, Duration]] = defaultdict(lambda: {"compute_input": Duration(),
                                                                           "compute_infer": Duration()})
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0

    def request_done(self, succeeded: bool, seconds: float) -> None:
        self.stages["success" if succeeded else "fail"].add(seconds)

    def image_prepared(self, seconds: float) -> None:
        self.stages["compute_input"].add(seconds)

    def image_encoded(self, seconds: float) -> None:
        self.stages["compute_output"].add(seconds)

    def queue_wait(self, seconds: float) -> None:
        self.stages["queue"].add(seconds)

    def batch_done(self, size: int, seconds: float, stack_seconds: float) -> None:
        self.inference_count += size
        self.execution_count += 1
        self.last_inference_ms = int(time.time() * 1000)
        self.stages["compute_infer"].add(seconds, count=size)  # each image waited for its whole batch
        self.batches[size]["compute_infer"].add(seconds)
        self.batches[size]["compute_input"].add(stack_seconds)

    def to_triton(self, name: str, version: str) -> dict:
        """One entry of the extension's `model_stats` list."""
        return {"name": name, "version": version, "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count, "execution_count": self.execution_count,
                "inference_stats": {**{stage: d.to_json() for stage, d in self.stages.items()},
                                    "cache_hit": Duration().to_json(), "cache_miss": Duration().to_json()},
                "response_stats": {},  # per-response statistics of decoupled (streaming) models: none here
                "batch_stats": [{"batch_size": size, **{k: d.to_json() for k, d in stages.items()}}
                                for size, stages in sorted(self.batches.items())],
                "memory_usage": []}
