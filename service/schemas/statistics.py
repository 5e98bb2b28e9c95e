"""Triton's statistics extension (`GET /v2/models/{name}/stats`), read from the service's own Prometheus
metrics: the numbers are those every process already reports (service/ground/metrics.py), so with several HTTP
workers and an engine process the answer is one view across all of them, like a scrape of /metrics.

The meaning follows Triton's `docs/protocol/extension_statistics.md`, with our units of work:
- `success` / `fail`: inference requests (/v1/classify, /v1/classify/batch, /v2 infer, gRPC ModelInfer) answered
  200 / with an error, and their whole duration;
- `queue`, `compute_input`, `compute_infer`, `compute_output`: per image: its wait in the batch queue, its
  preparation (decoding and preprocessing an image, or its share of parsing a tensor request), the model call
  of its batch, and its encoding (top-k, maps, the response tensors);
- `inference_count`: images run; `execution_count`: model calls (batches); `batch_stats`: per batch size, the
  model calls (`compute_infer`) and the stacking of their inputs (`compute_input`); `last_inference`: ms since
  the epoch.
"""
from __future__ import annotations

from collections import defaultdict

SUCCESS_STATUSES = ("200", "OK")  # HTTP's, gRPC's


def triton_statistics(families, name: str, version: str, inference_endpoints: frozenset[str]) -> dict:
    """One entry of the extension's `model_stats` list, from collected metric families."""
    totals: dict[str, float] = defaultdict(float)
    requests = {True: [0.0, 0.0], False: [0.0, 0.0]}  # succeeded -> [count, seconds]
    batches: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for family in families:
        for sample in family.samples:
            labels = sample.labels
            if "model" in labels and (labels["model"], labels.get("version")) != (name, version):
                continue  # another model's, or a request that ran none
            if sample.name.startswith("vitserve_request_duration_seconds_"):
                if labels.get("endpoint") in inference_endpoints and sample.name.endswith(("_count", "_sum")):
                    requests[labels["status"] in SUCCESS_STATUSES][sample.name.endswith("_sum")] += sample.value
            elif "batch_size" in labels and sample.name.startswith("vitserve_batch"):
                batches[int(labels["batch_size"])][sample.name] += sample.value
            else:
                totals[sample.name] += sample.value

    def stage(histogram: str) -> dict:
        return _duration(totals[f"{histogram}_count"], totals[f"{histogram}_sum"])

    def per_image_run(histogram: str) -> dict:
        """A front end's stage, counted per image run (as compute_infer is): the images' count comes from the
        engine, the stage's mean duration from the front ends. The two are recorded in different processes,
        and an image whose client left after its batch ran never reaches encoding; Triton's clients (and
        perf_analyzer, which refuses to go on otherwise) expect the three compute counts to be equal."""
        count, seconds = totals[f"{histogram}_count"], totals[f"{histogram}_sum"]
        images = totals["vitserve_images_total"]
        return _duration(images, seconds / count * images if count else 0.0)

    infer_ns = sum(size * b["vitserve_batch_seconds_total"] for size, b in batches.items())
    return {
        "name": name, "version": version,
        "last_inference": int(totals["vitserve_last_inference_timestamp_seconds"] * 1000),
        "inference_count": int(totals["vitserve_images_total"]),
        "execution_count": int(sum(b["vitserve_batches_total"] for b in batches.values())),
        "inference_stats": {
            "success": _duration(*requests[True]), "fail": _duration(*requests[False]),
            "queue": stage("vitserve_queue_wait_seconds"),
            "compute_input": per_image_run("vitserve_preprocess_seconds"),
            "compute_infer": _duration(totals["vitserve_images_total"], infer_ns),
            "compute_output": per_image_run("vitserve_postprocess_seconds"),
            "cache_hit": _duration(0, 0), "cache_miss": _duration(0, 0)},
        "response_stats": {},  # per-response statistics of decoupled (streaming) models: none here
        "batch_stats": [{"batch_size": size,
                         "compute_input": _duration(b["vitserve_batches_total"],
                                                    b["vitserve_batch_stack_seconds_total"]),
                         "compute_infer": _duration(b["vitserve_batches_total"], b["vitserve_batch_seconds_total"])}
                        for size, b in sorted(batches.items()) if b["vitserve_batches_total"]],  # (a reload's zeros)
        "memory_usage": [],
    }


def _duration(count: float, seconds: float) -> dict:
    return {"count": int(round(count)), "ns": int(round(seconds * 1e9))}
