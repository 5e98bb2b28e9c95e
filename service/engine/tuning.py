"""The measurements behind a recorded plan (service/engine/serving_plan.py), made once on a quiet machine by
`vitserve tune` (or by the first load on an idle machine, `tuning write-when-idle`) and never beside live traffic.

What is measured, on the CPU: every registered runtime's candidates (ONNX Runtime on the file's own precision, then
OpenVINO fp32 and bf16 where the CPU computes it) that agree with ONNX Runtime on the probe images, in alternating
rounds at batch 1 and at the largest batch; the fastest is chosen, ONNX Runtime unless another is faster by more
than `RECORDED_MARGIN`. Then the chosen one's maps-free graph against its rollout graph (kept where it costs at most
`MAPS_FREE_CPU_SHARE` of it), and its batch-1 call with every core (light below `LIGHT_MODEL_MS`).
"""
from __future__ import annotations

import functools
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from vitserve.machine import machine_busy_seconds, process_cpu_seconds
from vitserve.service.engine.cuda_graphs import call_times_ms, median_ms
from vitserve.service.engine.inference_model import Artifact, InferenceModel, Outputs, disagrees, probe_pixels
from vitserve.service.engine.serving_plan import RECORDED_MARGIN, PlanKey, plan_key, write_record
from vitserve.service.ground.errors import ModelLoadError
from vitserve.service.ground.processes import usable_cores
from vitserve.service.ground.settings import Settings

log = logging.getLogger("vitserve.runtime")

# A light model's batch-1 call with every core takes less than this: its server is HTTP-bound (serving_plan.py).
LIGHT_MODEL_MS = 10.0
# The maps-free graph is kept when it costs at most this share of the rollout graph's time: a smaller gain is within
# the measurement's noise, and not worth the second graph's memory.
MAPS_FREE_CPU_SHARE = 0.95
# Each size's cost in a round is the fastest of MAPS_FREE_CALLS calls, or of as many as fit in MAPS_FREE_ROUND_MS
# (at least MAPS_FREE_MIN_CALLS) for a graph whose calls are long (ViT-S/16 at batch 8).
MAPS_FREE_CALLS, MAPS_FREE_MIN_CALLS, MAPS_FREE_ROUND_MS = 7, 3, 1000.0
# The machine is quiet when the other processes kept less than this share of its cores busy over QUIET_WINDOW_S.
QUIET_SHARE, QUIET_WINDOW_S = 0.15, 0.5


def measure(settings: Settings, artifact: Artifact) -> tuple[dict, dict]:
    """The choice (runtime, precision_hint, maps_free, light) and the measurements behind it, on this machine."""
    from vitserve.service.engine.onnx_runtime import ONNX_RUNTIME
    from vitserve.service.engine.runtime import RUNTIMES, runtime_named
    untimed = settings.model_copy(update={"maps_free": "off", "batch_runners": 1})
    reference = ONNX_RUNTIME.load(untimed, artifact)
    candidates: dict[str, tuple[str, str, InferenceModel]] = {
        f"onnxruntime/{reference.info.precision}": ("onnxruntime", "auto", reference)}
    left_out: dict[str, str] = {}
    if settings.runtime == "auto":
        for spec in RUNTIMES.values():
            if spec.candidates is None or not spec.available():
                continue
            for name, model in spec.candidates(untimed, artifact, reference):
                disagreement = disagrees(model, reference)
                if disagreement:
                    left_out[name] = disagreement
                else:
                    candidates[name] = (model.runtime, model.precision_hint, model)
    else:
        model = runtime_named(settings.runtime).load(untimed, artifact)
        computes = model.info.precision if model.precision_hint == "auto" else model.precision_hint
        candidates = {f"{model.runtime}/{computes}": (model.runtime, model.precision_hint, model)}
    costs = candidate_costs({name: model for name, (_, _, model) in candidates.items()}, settings.max_batch_size)
    chosen = fastest(costs)
    runtime, precision, _ = candidates[chosen]
    del candidates, reference
    with_maps = runtime_named(runtime).load(settings.model_copy(update={
        "runtime": runtime, "precision_hint": precision, "maps_free": "on", "batch_runners": 1}), artifact)
    maps_free = with_maps.capabilities.maps_free
    rollout_ms, maps_free_ms = maps_free_costs(with_maps.run, maps_free, with_maps.info, settings.max_batch_size) \
        if maps_free is not None else (0.0, 0.0)
    one_ms = batch_one_ms(with_maps)
    choice = {"runtime": runtime, "precision_hint": precision, "light": one_ms < LIGHT_MODEL_MS,
              "maps_free": maps_free is not None and maps_free_ms <= MAPS_FREE_CPU_SHARE * rollout_ms}
    measured = {"ms_per_image_at_1_plus_max_batch": {name: round(ms, 4) for name, ms in costs.items()},
                "chosen": chosen, "left_out": left_out, "batch_one_ms": round(one_ms, 3),
                "maps_free_ms_per_image": round(maps_free_ms, 4), "rollout_ms_per_image": round(rollout_ms, 4),
                "max_batch_size": settings.max_batch_size, "cores": usable_cores()}
    log.info("tuned %s: %s, maps-free graph %s, %s (ms per image at batch 1 plus at %d: %s)", settings.model_path,
             chosen, "kept" if choice["maps_free"] else "left out", "light" if choice["light"] else "heavy",
             settings.max_batch_size, ", ".join(f"{n} {ms:.3f}" for n, ms in costs.items()))
    return choice, measured


def tune(settings: Settings, command: str = "") -> tuple[Path, dict]:
    """Measure the file of `settings.model_path` on this machine and write its record; the record's path and choice.
    Refuses (ModelLoadError) where the machine is not quiet: a measurement beside other work measures the work."""
    from vitserve.service.engine.onnx_runtime import read_artifact
    path = Path(settings.model_path)
    artifact = read_artifact(path)  # a file that cannot be served is said first, busy machine or not
    busy = others_busy_share()
    if busy > QUIET_SHARE:
        raise ModelLoadError(f"the machine is busy (other processes kept {busy:.0%} of its {usable_cores()} cores "
                             f"busy): a measurement now would measure them; run it on a quiet machine")
    key = plan_key(path, settings)
    choice, measured = measure(settings, artifact)
    record = write_record(settings, key, choice, measured, command or shlex.join(["vitserve", *sys.argv[1:]]))
    return record, choice


def record_when_idle(settings: Settings, artifact: Artifact, key: PlanKey) -> None:
    """`tuning write-when-idle`: the record of this file on this machine made now, where the machine is idle; else
    nothing (the declared plan serves, and a later idle load records)."""
    busy = others_busy_share()
    if busy > QUIET_SHARE:
        log.info("no tuning record for %s yet, and the machine is busy (%.0f%% of its cores): the declared plan "
                 "serves this load", settings.model_path, 100 * busy)
        return
    started = time.perf_counter()
    choice, measured = measure(settings, artifact)
    record = write_record(settings, key, choice, measured, f"first idle load of {settings.model_path}")
    log.info("recorded %s in %.1f s: later loads with the same key read it", record, time.perf_counter() - started)


def others_busy_share(window_s: float = QUIET_WINDOW_S) -> float:
    """The share of this machine's cores that other processes kept busy over `window_s`."""
    machine, own = machine_busy_seconds(), process_cpu_seconds(os.getpid())
    time.sleep(window_s)
    others = (machine_busy_seconds() - machine) - (process_cpu_seconds(os.getpid()) - own)
    return max(0.0, others) / (window_s * (os.cpu_count() or 1))


def candidate_costs(candidates: dict[str, InferenceModel], max_batch: int, rounds: int = 3) -> dict[str, float]:
    """Each candidate's ms per image at batch 1 plus at `max_batch`, the median of alternating rounds."""
    info = next(iter(candidates.values())).info
    batches = [np.resize(probe_pixels(info), (size, info.channels, *info.image_size)).astype(np.float32)
               for size in sorted({1, max_batch})]
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, model in candidates.items():
            times[name].append(sum(median_ms(functools.partial(model.run, x), 3) / len(x) for x in batches))
    return {name: float(np.median(t)) for name, t in times.items()}


def fastest(costs: dict[str, float]) -> str:
    """The cheapest candidate, the first (ONNX Runtime on the file's own precision) unless another costs less than
    RECORDED_MARGIN of it: a recorded choice never serves a candidate slower than the file as it is."""
    reference = next(iter(costs))
    best = min(costs, key=costs.__getitem__)
    return best if costs[best] <= RECORDED_MARGIN * costs[reference] else reference


def maps_free_costs(run_with_maps: Callable[[np.ndarray], Outputs], run_maps_free: Callable[[np.ndarray], Outputs],
                    info, max_batch: int, rounds: int = 3) -> tuple[float, float]:
    """The rollout graph's and the maps-free graph's ms per image at batch 1 plus at batch min(max_batch, 8), timed
    alternately (each size's fastest call of a round, the median of the rounds)."""
    sizes = sorted({1, max(1, min(max_batch, 8))})
    batches = [np.resize(probe_pixels(info), (size, info.channels, *info.image_size)).astype(np.float32)
               for size in sizes]
    graphs = {"rollout": run_with_maps, "maps-free": run_maps_free}
    calls = {}  # one call of each graph and size sets it up (not counted) and says how many a round can afford
    for name, run in graphs.items():
        for i, x in enumerate(batches):
            set_up_ms = max(call_times_ms(functools.partial(run, x), 1, set_up=False)[0], 1e-3)
            calls[name, i] = max(MAPS_FREE_MIN_CALLS, min(MAPS_FREE_CALLS, int(MAPS_FREE_ROUND_MS // set_up_ms)))
    costs: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, run in graphs.items():
            costs[name].append(sum(min(call_times_ms(functools.partial(run, x), calls[name, i], set_up=False))
                                   / len(x) for i, x in enumerate(batches)))
    return float(np.median(costs["rollout"])), float(np.median(costs["maps-free"]))


def batch_one_ms(model: InferenceModel, calls: int = 9) -> float:
    """The fastest batch-1 call at the trained size (the first call, which sets things up, not counted)."""
    pixels = np.zeros((1, model.info.channels, *model.info.image_size), np.float32)
    return min(call_times_ms(lambda: model.run(pixels), calls))
