"""The model without a server: the ONNX Runtime session alone, timed batch by batch.

Two users: `vitserve bench`'s raw phase (the service's own session and preprocessing, the ceiling a server can
approach), and `vitserve evaluate bench` (`benchmark`: ONNX Runtime against PyTorch eager, with and without the
rollout). The second needs torch and the exporter; they are imported inside the functions that use them.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES
from vitserve.bench.config import BenchConfig
from vitserve.bench.measure import CpuSnapshot, latency_summary, timed_calls


def bench_raw(run_batch, samples: np.ndarray, batch_sizes: list[int], duration_s: float,
              min_calls: int = 3, max_calls: int = 100_000) -> list[dict]:
    """Images/s and per-call latency of `run_batch(pixel_values)` at each batch size.

    Each size gets one warm-up call, then runs for `duration_s` (at least `min_calls`, at most `max_calls` calls).
    `samples` (n, C, H, W) are cycled to fill a batch, so every size sees the same images.
    """
    results = []
    for bs in batch_sizes:
        batch = np.ascontiguousarray(samples[np.arange(bs) % len(samples)])  # (bs, C, H, W)
        run_batch(batch)
        times = timed_calls(lambda batch=batch: run_batch(batch), duration_s, min_calls, max_calls)
        results.append({"batch_size": bs, "calls": len(times), "images_per_s": bs * len(times) / sum(times),
                        **latency_summary(times)})
    return results


def load_raw_model(model_path: Path, server_env: dict[str, str]):
    """The server's own session: `service.engine.onnx_runtime.OnnxModel` with the settings (`VITSERVE_*`) the server
    gets."""
    from vitserve.service.engine.onnx_runtime import OnnxModel
    from vitserve.service.ground.settings import Settings

    values: dict[str, Any] = {k.removeprefix("VITSERVE_").lower(): v for k, v in server_env.items()}
    return OnnxModel.load(Settings(**{**values, "model_path": model_path}))


def model_summary(model, path: Path) -> dict:
    info = model.info  # vitserve.artifact.ModelInfo, as read from the file
    return {"name": info.name, "version": info.version, "path": str(path), "height": info.image_size[0],
            "width": info.image_size[1], "channels": info.channels, "patch_size": info.patch_size,
            "precision": info.precision, "provider": model.provider, "size_mb": path.stat().st_size / 2**20}


def preprocessed(model, images: list[bytes]) -> np.ndarray:
    """The server's own preprocessing of `images` (default settings, resize=fit): (n, C, H, W)."""
    from vitserve.service.ground.settings import Settings
    from vitserve.service.usecases.preprocess import prepare_image

    s = Settings()
    return np.stack([prepare_image(data, model.info, resize="fit", max_bytes=s.max_upload_bytes,
                                   max_pixels=s.max_image_pixels, max_tokens=s.max_native_tokens).pixels
                     for data in images])


def raw_phase(model, samples: np.ndarray, cfg: BenchConfig) -> list[dict]:
    """The session alone, fed the server's own preprocessing of the pre-sized PNGs."""
    if cfg.max_batch_size is None:
        raise ValueError("the server's max batch size is unset: with_server_defaults(cfg) fills it")
    sizes = sorted(set(cfg.batch_sizes) | {cfg.max_batch_size})
    print(f"raw ONNX Runtime, batch sizes {sizes}", flush=True)
    rows = []
    for size in sizes:
        before = CpuSnapshot.take(None)
        rows += bench_raw(model.run, samples, [size], cfg.raw_duration_s)
        usage = before.usage(CpuSnapshot.take(None))  # "client" is this process: the session
        rows[-1].update(session_cores=usage["client_cores"], other_cores=usage["other_cores"])
        r = rows[-1]
        print(f"  raw bs {size:3d}: {r['images_per_s']:8.1f} images/s  p50 {r['p50_ms']:8.2f} ms", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------- vs PyTorch


def variant_model(name: str):
    """A named variant with random weights at its default resolution, e.g. 'small' = ViT-S/16 at 224."""
    import torch

    from vitserve.model.vit import VisionTransformer, vit_config

    torch.manual_seed(0)
    return VisionTransformer(vit_config(name)).eval()


def images_per_second(run, batch: int, min_seconds: float) -> tuple[float, int]:
    """Calls `run()` (one batch) after a warm-up until min_seconds and at least 3 calls have passed."""
    run()
    calls, started = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - started < min_seconds:
        run()
        calls += 1
    return batch * calls / (time.perf_counter() - started), calls


def benchmark(vit, batch_sizes: list[int], *, threads: int | None = None, min_seconds: float = 3.0,
              rounds: int = 3) -> list[dict]:
    """images/s of ONNX Runtime (CPU) and PyTorch eager, logits only (fused attention) and logits + rollout.

    The four cases of a batch size take turns for `rounds` rounds and each keeps its best rate, so a
    burst of load from other processes penalises one round, not one case.
    """
    import torch

    from vitserve.export.onnx_export import example_input

    if threads:
        torch.set_num_threads(threads)
    modules, sessions = _torch_and_onnx(vit, threads or 0)
    rows = []
    for batch in batch_sizes:
        x = example_input(vit, batch)
        feed = {INPUT_NAME: x.numpy()}
        cases = {("torch", r): (lambda r=r, x=x: modules[r](x)) for r in (False, True)}
        cases.update({("onnxruntime", r): (lambda r=r, feed=feed: sessions[r].run(None, feed)) for r in (False, True)})
        best = dict.fromkeys(cases, 0.0)
        with torch.inference_mode():
            for _ in range(rounds):
                for key, run in cases.items():
                    best[key] = max(best[key], images_per_second(run, batch, min_seconds / rounds)[0])
        rows += [{"runtime": runtime, "rollout": rollout, "batch": batch, "images_per_s": round(rate, 1),
                  "size": list(vit.cfg.image_size), "threads": threads or torch.get_num_threads()}
                 for (runtime, rollout), rate in best.items()]
    return rows


def _torch_and_onnx(vit, threads: int) -> tuple[dict, dict]:
    """{with rollout?: torch module} and {with rollout?: ONNX Runtime CPU session} of the same weights."""
    from vitserve.export.onnx_export import ViTWithRollout, example_input, to_onnx
    from vitserve.export.verify import cpu_session

    patch, example = vit.cfg.patch_size, example_input(vit)
    modules = {False: vit, True: ViTWithRollout(vit)}
    sessions = {False: cpu_session(to_onnx(vit, patch, example, OUTPUT_NAMES[:1]), threads=threads),
                True: cpu_session(to_onnx(modules[True], patch, example, OUTPUT_NAMES), threads=threads)}
    return modules, sessions
