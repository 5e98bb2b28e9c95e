"""`python -m vitserve.bench.engine_ceiling`: how many images per second the engine process moves when the model
costs nothing.

On a GPU the model is fast and the serving machinery around it sets the pace. This takes the HTTP side away: an
engine process (service/engine/server.py, as `vitserve serve` starts it) serves a model whose graph does almost no
arithmetic (a mean and an average pool, at 8x8 pixels: `zero_cost_model`), and submitter processes drive it
through the frontends' own client (`RemoteEngine`: shared memory for the pixels, ZeroMQ and msgspec for the
messages), each with many requests in flight, for `--seconds`. Reported per level: images/s, the engine process's
CPU per image (psutil) and the cores it kept busy, and the submitters' CPU per image.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

import numpy as np

IMAGE = (1, 8, 8)  # channels, height, width: one 8x8 patch
PATCH = 8


def zero_cost_model(path: Path) -> Path:
    """A vitserve artifact whose graph costs nearly nothing: logits = the image's mean (twice), rollout = the mean
    of each patch. Its metadata is a real model's (vitserve/artifact.py)."""
    import onnx
    from onnx import TensorProto, helper

    from vitserve.artifact import INPUT_NAME, ModelInfo

    nodes = [helper.make_node("ReduceMean", [INPUT_NAME], ["mean"], axes=[1, 2, 3], keepdims=0),
             helper.make_node("Unsqueeze", ["mean", "one"], ["column"]),
             helper.make_node("Concat", ["column", "column"], ["logits"], axis=1),
             helper.make_node("AveragePool", [INPUT_NAME], ["pooled"], kernel_shape=[PATCH, PATCH],
                              strides=[PATCH, PATCH]),
             helper.make_node("Squeeze", ["pooled", "one"], ["rollout"])]
    graph = helper.make_graph(
        nodes, "zero-cost", [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT,
                                                           ["batch", 1, "height", "width"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 2]),
         helper.make_tensor_value_info("rollout", TensorProto.FLOAT, ["batch", "grid_h", "grid_w"])],
        [helper.make_tensor("one", TensorProto.INT64, [1], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    info = ModelInfo(name="zero", version="1", labels=["a", "b"], patch_size=PATCH, image_size=IMAGE[1:],
                     channels=IMAGE[0], mean=[0.5], std=[0.25], exporter="vitserve.bench.engine_ceiling")
    helper.set_model_props(model, info.to_metadata())
    onnx.save(model, str(path))
    return path


def engine_settings(model: Path, max_batch_size: int):
    from vitserve.service.ground.settings import Settings

    return Settings(model_path=model, runtime="onnxruntime", providers=["cpu"], intra_op_threads=1,
                    max_batch_size=max_batch_size, max_queue_size=100_000, max_queue_delay_ms=0.5,
                    warmup_batch_sizes=[1], grpc_port=0, log_level="warning")


def submitter(settings, in_flight: int, seconds: float, start_at: float, results) -> None:
    """One frontend process: `in_flight` requests at a time through RemoteEngine until the window closes."""
    import resource

    from vitserve.service.engine.remote import RemoteEngine
    from vitserve.service.ground.metrics import ServiceMetrics

    async def drive() -> int:
        engine = RemoteEngine(settings, ServiceMetrics())
        await engine.start()
        while not engine.ready:
            await asyncio.sleep(0.01)
        handle = engine.route("zero")
        pixels = np.random.default_rng(os.getpid()).standard_normal(IMAGE).astype(np.float32)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        done, end = 0, time.time() + seconds

        async def loop() -> None:
            nonlocal done
            while time.time() < end:
                await engine.submit(handle, pixels, timeout_s=30)
                done += 1

        before = resource.getrusage(resource.RUSAGE_SELF)
        await asyncio.gather(*(loop() for _ in range(in_flight)))
        after = resource.getrusage(resource.RUSAGE_SELF)
        results.put((done, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)))
        await engine.close(1.0)
        return done

    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(drive())


def engine_process_cpu_s(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def level(settings, engine_pids: list[int], submitters: int, in_flight: int, seconds: float) -> dict:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    start_at = time.time() + 3.0  # every submitter connected and ready before the window opens
    procs = [context.Process(target=submitter, args=(settings, in_flight, seconds, start_at, results))
             for _ in range(submitters)]
    for proc in procs:
        proc.start()
    time.sleep(max(0.0, start_at - time.time()))
    engine_before = engine_process_cpu_s(engine_pids)
    outcomes = [results.get(timeout=seconds + 120) for _ in procs]
    engine_cpu = engine_process_cpu_s(engine_pids) - engine_before
    for proc in procs:
        proc.join(timeout=30)
    images = sum(done for done, _ in outcomes)
    client_cpu = sum(cpu for _, cpu in outcomes)
    return {"submitters": submitters, "in_flight_each": in_flight, "images": images, "seconds": seconds,
            "images_per_s": images / seconds, "engine_cpu_us_per_image": 1e6 * engine_cpu / max(images, 1),
            "engine_cores": engine_cpu / seconds, "submitter_cpu_us_per_image": 1e6 * client_cpu / max(images, 1)}


def run(levels: list[tuple[int, int]], seconds: float, max_batch_size: int) -> dict:
    import psutil

    from vitserve.service.engine.supervisor import EngineSupervisor

    with tempfile.TemporaryDirectory(prefix="vitserve-ceiling-") as directory:
        model = zero_cost_model(Path(directory) / "zero.onnx")
        settings = engine_settings(model, max_batch_size)
        with EngineSupervisor(settings) as supervisor:
            front = settings.model_copy(update={"engine_addresses": supervisor.addresses})
            me = psutil.Process()
            engines = [p.pid for p in me.children(recursive=True) if "resource_tracker" not in " ".join(p.cmdline())]
            rows = []
            for submitters, in_flight in levels:
                rows.append(level(front, engines, submitters, in_flight, seconds))
                r = rows[-1]
                print(f"  {submitters} submitters x {in_flight} in flight: {r['images_per_s']:10,.0f} images/s, "
                      f"engine {r['engine_cpu_us_per_image']:.1f} us/image ({r['engine_cores']:.2f} cores), "
                      f"submitters {r['submitter_cpu_us_per_image']:.1f} us/image", flush=True)
    return {"cpus": os.cpu_count(), "max_batch_size": max_batch_size, "rows": rows}


def _level(spec: str) -> tuple[int, int]:
    submitters, in_flight = (int(n) for n in spec.split("x"))
    return submitters, in_flight


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vitserve.bench.engine_ceiling", description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="1x64,2x64,4x64", help="SUBMITTERSxIN_FLIGHT, comma separated")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--out", type=Path, help="the JSON report")
    args = p.parse_args(argv)
    levels = [_level(spec) for spec in args.levels.split(",")]
    report = run(levels, args.seconds, args.max_batch_size)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
