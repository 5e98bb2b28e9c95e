"""`make bench-gpu` (`python -m vitserve.bench.gpu`): the GPU kit, in one command. It runs every step this machine
allows and says which it skipped and why, so it runs (and CI keeps it working) on a machine without a GPU too.

1. environment: onnxruntime's version and providers, `nvidia-smi -L`, whether torch (the exporter) is there;
2. install: without the CUDA provider, `pip install onnxruntime-gpu` into build/gpu/venv (with this environment's
   packages visible) and the kit again from there (`--no-install`: not; `--wheels DIR`: from that folder only, on a
   machine without a network);
3. export: each model (the default model from its checkpoint, and the random-weight presets ViT-S/16 and ViT-B/16
   at 224) at each precision (fp32, fp16), with `vitserve export` / `python -m vitserve.export.presets` in child
   processes;
4. verify on the provider: each file on CUDA (else the CPU) against the fp32 file on ONNX Runtime's CPU provider,
   on random images at the trained size and at a larger one: the largest logit difference relative to the
   largest |logit|, top-1 agreement, the largest rollout difference;
5. on a GPU, for each file (`--gpu-steps`): CUDA graphs against the dynamic session, as the server runs them
   (service/engine/cuda_graphs.py: their answers side by side, images/s per batch size, each bucket's load-time
   timing); the maps-free graph with ONNX Runtime's transformer fusions against the rollout graph; the first
   calls at batch sizes the load did not run, with the dynamic session's batches padded (`gpu_batch_step`) and
   not (`first-calls`); and served: a
   real `vitserve serve` loaded by wrk pinned to cores of its own, the GPU's utilisation sampled per level and
   the server's own account of its batches read from /metrics (bench/gpu_served.py), once per
   `--served-variants` settings overlay;
6. without a GPU: `vitserve bench` (raw against served) on the CPU, as a check of the kit;
7. TensorRT: the same bench with the TensorRT provider (its engine cache in build/gpu/trt) when the build has it
   (CPU runs only: the GPU steps above do not cover it yet).

On a GPU machine without network access, `bench/gpu-offline.sh` runs it in one call with what
`python -m vitserve.bench.gpu_wheels` prepared on a machine with it (docs/results/bench-gpu.md, "How to run it").

Writes build/gpu/bench-gpu.md (or `--out`) and its JSON. On a CPU-only machine the default model alone is exported and
measured (at batch 1 and 8, a few seconds), as a check that the kit works, not as a result.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_CHECKPOINT = Path("models/vit-fmnist/checkpoint")
CUDA, TENSORRT, CPU = "CUDAExecutionProvider", "TensorrtExecutionProvider", "CPUExecutionProvider"
VENV = Path("build/gpu/venv")
GPU_STEPS = ("graphs", "fused", "first-calls", "served")


@dataclass
class GpuKitConfig:
    models: str = "default,vit-s16,vit-b16"  # "default": `checkpoint` exported
    checkpoint: Path = DEFAULT_CHECKPOINT
    precisions: str = "fp32,fp16"
    batch_sizes: str = "1,2,4,8,16,32,64"
    concurrency: str = "1,8,32,64"
    duration_s: float = 5.0
    install: bool = True
    wheels: str = ""  # a folder of wheels to install onnxruntime-gpu from, for a machine without a network
    served_concurrency: str = "32,64"  # wrk's connections per served level (on a GPU)
    served_duration_s: int = 5
    served_files: str = ""  # which files get the served step, e.g. "vit-b16:fp16,default:fp32"; empty: every file
    gpu_steps: str = ",".join(GPU_STEPS)  # which of the GPU steps run (fewer: a shorter run)
    # server settings to compare in the served step, each its own run: "name:VITSERVE_X=1,VITSERVE_Y=2;name2:..."
    # ("name:" alone: the kit's own settings); empty: one run with the kit's settings
    served_variants: str = ""
    # config fields changed in the random-weight presets' export, "depth=2": a block's cost measured without the
    # whole model's export (ViT-B/16's takes 109 s on an H200 machine's CPU); the default model is left as trained
    preset_overrides: str = ""
    # the presets' exports without the relevance path: no kit step uses it (the served step asks map=none), and it is
    # two thirds of an export's time (ViT-B/16 at depth 2: 21.3 s with it, 6.7 s without); --no-preset-fast-only
    # keeps it. The default model is exported as shipped, with it.
    preset_fast_only: bool = True
    served_rounds: int = 1  # each variant this many times, the order reversed every other round (speed drifts)
    wrk: str = ""  # the load generator; default: `wrk` on PATH
    work: Path = Path("build/gpu")
    out: Path = Path("build/gpu/bench-gpu.md")  # docs/results/bench-gpu.md is written up by hand from such reports


@dataclass
class Step:
    name: str
    status: str  # "ran", "skipped", "failed"
    detail: str = ""
    result: dict = field(default_factory=dict)


class Kit:
    def __init__(self, cfg: GpuKitConfig):
        self.cfg = cfg
        self.steps: list[Step] = []

    def write(self) -> None:
        """The report as it stands: written after every step, so a run cut short (a time limit, a lost machine)
        still leaves what it measured."""
        self.cfg.out.parent.mkdir(parents=True, exist_ok=True)
        self.cfg.out.write_text(render(self, self.cfg))
        self.cfg.out.with_suffix(".json").write_text(json.dumps(
            {"config": config_strings(self.cfg), "steps": [asdict(s) for s in self.steps]},
            indent=1) + "\n")

    def step(self, name: str, call, *args) -> Step:
        """Run one step; an exception is recorded as a failed step, and the kit goes on."""
        started = time.monotonic()
        try:
            outcome = call(*args)
        except Exception as e:  # noqa: BLE001 - a kit that stops at the first failure tells less
            step = Step(name, "failed", f"{type(e).__name__}: {e}", {"traceback": traceback.format_exc()[-3000:]})
        else:
            step = outcome if isinstance(outcome, Step) else Step(name, "ran", result=outcome or {})
            step.name = name
        step.result["seconds"] = round(time.monotonic() - started, 1)
        self.steps.append(step)
        self.write()
        print(f"[{step.status}] {name}{': ' + step.detail if step.detail else ''}", flush=True)
        return step


def environment() -> dict:
    import onnxruntime as ort

    smi = shutil.which("nvidia-smi")
    gpus = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout.strip() if smi else ""
    try:
        import torch  # noqa: F401 - only whether the exporter can run here
        has_torch = True
    except ImportError:
        has_torch = False
    built_in = ort.get_available_providers()
    return {"onnxruntime": ort.__version__, "providers": [p for p in built_in if p == CPU or loads(p)],
            "built_in": built_in, "gpus": gpus,
            "python": sys.version.split()[0], "torch": has_torch, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                      time.gmtime())}


def loads(provider: str) -> bool:
    """Whether `provider` really runs a graph here: onnxruntime lists every provider it was built with, also one
    whose libraries (CUDA, cuDNN, TensorRT) or GPU are missing, and then falls back to the CPU with a warning."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    if provider not in ort.get_available_providers():  # not in this build: no session to try (ORT would warn)
        return False
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    try:
        s = ort.InferenceSession(model.SerializeToString(), opts, providers=list(dict.fromkeys([provider, CPU])))
    except Exception:  # noqa: BLE001 - a provider that cannot start is the answer
        return False
    return s.get_providers()[0] == provider


def pip_install(python: Path, wheels: str) -> list[str]:
    """pip's command for onnxruntime-gpu: from PyPI, or only from `wheels` (a GPU machine without a network; the
    wheel and what it needs beside the CUDA libraries, fetched elsewhere with `pip download`)."""
    offline = ["--no-index", "--find-links", wheels] if wheels else []
    return [str(python), "-m", "pip", "install", "--quiet", *offline, "onnxruntime-gpu"]


def install_and_rerun(cfg: GpuKitConfig, argv: list[str]) -> int | None:
    """Without the CUDA provider: onnxruntime-gpu in build/gpu/venv, and the kit again from there. None when the
    install failed (the kit goes on here, on what this build has)."""
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(VENV)], check=True)
    pip = subprocess.run(pip_install(python, cfg.wheels), capture_output=True, text=True, timeout=1800)
    if pip.returncode != 0:
        print(f"[skipped] install onnxruntime-gpu: {pip.stderr.strip()[-500:]}", flush=True)
        return None
    return subprocess.run([str(python), "-m", "vitserve.bench.gpu", *argv, "--no-install"]).returncode


def export_file(model: str, precision: str, work: Path, checkpoint: Path = DEFAULT_CHECKPOINT,
                overrides: str = "", fast_only: bool = False) -> Path:
    """The model at `precision` as an ONNX file in `work` (made once); a preset with `overrides` ("depth=2,...")
    and, with `fast_only`, without the relevance path."""
    pieces = [item for item in overrides.split(",") if item] if model != "default" else []
    fast_only = fast_only and model != "default"
    name = [model, *[piece.replace("=", "") for piece in pieces], *(["fast"] if fast_only else []), precision]
    out = work / f"{'-'.join(name)}.onnx"
    if out.exists():
        return out
    work.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial.onnx")
    if model == "default":
        argv = [sys.executable, "-m", "vitserve.cli", "export", str(checkpoint), "--out", str(partial),
                "--precision", precision]
    else:
        argv = [sys.executable, "-m", "vitserve.export.presets", model, str(partial), "--precision", precision,
                *[arg for piece in pieces for arg in ("--override", piece)],
                *(["--no-relevance"] if fast_only else [])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {(done.stdout + done.stderr)[-1500:]}")
    partial.replace(out)
    return out


def session(path: Path, provider: str, options: dict | None = None):
    import onnxruntime as ort

    providers = [(provider, options or {})] + ([] if provider == CPU else [(CPU, {})])
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=providers)


def verify_on(path: Path, reference: Path, provider: str) -> dict:
    """`path` on `provider` against `reference` (fp32) on the CPU: random images, trained size and 1.5x."""
    from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES
    from vitserve.onnx_header import read_model_info

    info = read_model_info(path)
    tested, ref = session(path, provider), session(reference, CPU)
    height, width = info.image_size
    worst_logits, worst_rollout, agree, total = 0.0, 0.0, 0, 0
    for scale in (1.0, 1.5):
        size = (int(height * scale) // info.patch_size * info.patch_size,
                int(width * scale) // info.patch_size * info.patch_size)
        x = np.random.default_rng(0).standard_normal((8, info.channels, *size)).astype(np.float32)
        (l1, r1), (l0, r0) = (s.run(list(OUTPUT_NAMES), {INPUT_NAME: x}) for s in (tested, ref))
        worst_logits = max(worst_logits, float(np.abs(l1 - l0).max() / max(1.0, np.abs(l0).max())))
        worst_rollout = max(worst_rollout, float(np.abs(r1 - r0).max()))
        agree, total = agree + int((l1.argmax(1) == l0.argmax(1)).sum()), total + len(x)
    return {"provider": tested.get_providers()[0], "max_logits_diff_relative": worst_logits,
            "max_rollout_diff": worst_rollout, "top1_agreement": agree / total}


def server_model(path: Path, **settings):
    """The server's own model object (service/engine/onnx_runtime.py): the fast path's session, CUDA graphs per bucket
    unless `cuda_graphs=False`."""
    from vitserve.service.engine.onnx_runtime import OnnxModel
    from vitserve.service.ground.settings import Settings

    return OnnxModel.load(Settings(model_path=path, providers=["cuda", "cpu"], **settings))


def cuda_graphs_raw(path: Path, batch_sizes: list[int], seconds: float) -> dict:
    """The fast path with and without CUDA graphs, as the server runs it: their answers side by side (the captured
    bucket must agree with the dynamic session), and each fed float32 pixels or uint8 ones normalised on the device
    (service/engine/pixels.py: the same answers, bit for bit, expected), images/s at each batch size, alternating
    rounds."""
    from vitserve.artifact import normalize_pixels
    from vitserve.bench.measure import alternating_rounds_ms

    largest = max(batch_sizes)
    started = time.monotonic()
    graphs = server_model(path, max_batch_size=largest, pixel_transport="uint8")
    capture_s = time.monotonic() - started
    dynamic = server_model(path, max_batch_size=largest, cuda_graphs=False, pixel_transport="uint8")
    if graphs.captured is None:
        return {"captured": False, "detail": "ORT refused to capture (see the log)"}
    info = graphs.info
    rng = np.random.default_rng(0)
    rows, worst_logits, worst_rollout, worst_raw, agree, total = [], 0.0, 0.0, 0.0, 0, 0
    worst_maps_free, agree_maps_free = 0.0, 0
    for batch in batch_sizes:
        raw = rng.integers(0, 256, (batch, info.channels, *info.image_size), dtype=np.uint8)
        x = normalize_pixels(raw, info.mean, info.std)
        (l1, r1, *_), (l0, r0, *_) = graphs.run(x), dynamic.run(x)
        worst_logits = max(worst_logits, float(np.abs(l1 - l0).max() / max(1.0, np.abs(l0).max())))
        worst_rollout = max(worst_rollout, float(np.abs(r1 - r0).max()))
        for model, floats in ((graphs, l1), (dynamic, l0)):
            worst_raw = max(worst_raw, float(np.abs(model.run(raw)[0] - floats).max()))
        agree, total = agree + int((l1.argmax(1) == l0.argmax(1)).sum()), total + batch
        calls: dict[str, Callable[[], Any]] = {
            "graphs": partial(graphs.run, x), "dynamic": partial(dynamic.run, x),
            "graphs_uint8": partial(graphs.run, raw), "dynamic_uint8": partial(dynamic.run, raw)}
        if graphs.run_maps_free is not None:  # the maps-free graph as the server runs it (map=none)
            calls["maps_free_uint8"] = partial(graphs.run_maps_free, raw)
            lean = graphs.run_maps_free(raw)[0]
            worst_maps_free = max(worst_maps_free, float(np.abs(lean - l1).max() / max(1.0, np.abs(l1).max())))
            agree_maps_free += int((lean.argmax(1) == l1.argmax(1)).sum())
        ms = alternating_rounds_ms(calls, rounds=5, seconds=seconds / 5)
        row: dict[str, float] = {"batch_size": batch}
        for name, times in ms.items():
            median = float(np.median(times))
            row.update({f"{name}_ms": median, f"{name}_images_per_s": batch * 1000 / median})
        rows.append(row)
    load_timings = {f"batch {size}": f"{captured:.2f} captured vs {dynamic:.2f} dynamic ms"
                    for size, (captured, dynamic) in graphs.captured.timings.items()}
    return {"captured": True, "buckets": sorted(graphs.captured.buckets), "load_and_capture_s": round(capture_s, 1),
            "load_timings": load_timings,
            "max_logits_diff_relative": worst_logits, "max_rollout_diff": worst_rollout,
            "uint8_vs_float32_max_logits_diff": worst_raw,
            "top1_agreement": agree / total,
            "maps_free": {"served": graphs.maps_free_path is not None,
                          "captured": graphs.maps_free_path is not None and graphs.maps_free_path.captured is not None,
                          "max_logits_diff_relative": worst_maps_free, "top1_agreement": agree_maps_free / total},
            "rows": rows}


def first_calls(path: Path, sizes: tuple[int, ...] = (17, 21, 25, 29, 33, 37, 41, 45, 50, 58),
                largest: int = 64) -> dict:
    """The first three calls at batch sizes the load did not run, on each graph the server runs (the rollout graph
    and the maps-free one), each model loaded and warmed up as the engine does it (uint8 pixels, CUDA graphs), its
    dynamic session's batches padded (`gpu_batch_step` 8) and not (0), the two alternating size by size. On the
    CUDA provider a new batch size's first calls can cost many times its later ones."""
    from vitserve.service.engine.cuda_graphs import call_times_ms
    from vitserve.service.engine.runtime import warm_up

    models, warmed = {}, {}
    for step in (0, 8):
        started = time.monotonic()
        models[step] = server_model(path, max_batch_size=largest, pixel_transport="uint8", gpu_batch_step=step,
                                    maps_free="on")
        sizes_run = warm_up(models[step], [1, largest])
        warmed[f"step {step}"] = f"{sizes_run} in {time.monotonic() - started:.1f} s (load and warm-up)"
    info = models[0].info
    rng = np.random.default_rng(0)
    rows = []
    for batch in sizes:
        raw = rng.integers(0, 256, (batch, info.channels, *info.image_size), dtype=np.uint8)
        row: dict = {"batch_size": batch}
        for step, model in models.items():
            for graph, call in (("rollout", model.run), ("maps_free", model.run_maps_free)):
                if call is not None:
                    times = call_times_ms(lambda c=call, r=raw: c(r), 3, set_up=False)
                    row[f"{graph}_step{step}_ms"] = " / ".join(f"{t:.1f}" for t in times)
        rows.append(row)
    return {"warmed_up": warmed, "rows": rows}


def maps_free_fused(path: Path, batch_sizes: list[int], seconds: float, work: Path) -> dict:
    """The fast path with its rollout against two maps-free graphs, each a dynamic CUDA session with IOBinding,
    images/s per batch size in alternating rounds (ONNX Runtime's own profiler would time each CUDA kernel's launch,
    not its run, so the graphs' difference is the measure):
    - maps_free: the fast graph without the rollout, through ONNX Runtime's transformer optimizer (`model_type="vit"`:
      SkipLayerNormalization and BiasGelu; it finds none of this export's attention);
    - attention: the same with each block's attention one MultiHeadAttention (service/engine/attention_fusion.py),
      flash or memory-efficient attention on the GPU."""
    import onnx
    from onnxruntime.transformers.optimizer import optimize_model

    from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES
    from vitserve.bench.measure import alternating_rounds_ms
    from vitserve.onnx_header import read_model_info
    from vitserve.service.engine.attention_fusion import count_fused, fuse_attention
    from vitserve.service.engine.graph_paths import prune_outputs, split_paths
    from vitserve.service.engine.onnx_runtime import run_session

    info = read_model_info(path)
    fast = split_paths(onnx.load(str(path))).fast
    maps_free = prune_outputs(fast, {OUTPUT_NAMES[1]})  # the rollout
    graphs = {"rollout": fast, "maps_free": maps_free, "attention": fuse_attention(maps_free)}
    files, fused_ops = {}, {}
    for name, graph in graphs.items():
        plain = work / f"{path.stem}-{name}.onnx"
        onnx.save(graph, str(plain))
        if name == "rollout":  # the server's own graph, as the server loads it
            files[name] = plain
            continue
        optimized = optimize_model(str(plain), model_type="vit", num_heads=int(info.architecture.get("num_heads", 0)),
                                   hidden_size=int(info.architecture.get("embed_dim", 0)), use_gpu=True,
                                   only_onnxruntime=False)
        files[name] = work / f"{path.stem}-{name}-optimized.onnx"
        optimized.save_model_to_file(str(files[name]))
        counts: dict[str, int] = {}
        for node in optimized.model.graph.node:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
        fused_ops[name] = {k: v for k, v in counts.items() if k in (
            "Attention", "MultiHeadAttention", "SkipLayerNormalization", "BiasGelu", "FastGelu", "LayerNormalization",
            "Softmax")}
    fused_ops["attention"]["blocks_fused"] = count_fused(graphs["attention"])
    sessions = {name: session(file, CUDA) for name, file in files.items()}
    device = "cuda" if sessions["rollout"].get_providers()[0] == CUDA else None
    rng = np.random.default_rng(0)
    rows = []
    for batch in batch_sizes:
        x = rng.standard_normal((batch, info.channels, *info.image_size)).astype(np.float32)
        calls = {name: (lambda s=s, g=graphs[name], x=x: run_session(s, tuple(o.name for o in g.graph.output),
                                                                        {INPUT_NAME: x}, device))
                 for name, s in sessions.items()}  # every output each graph has: the rollout's cost is the point
        answers = {name: call()[0] for name, call in calls.items()}
        reference = answers["rollout"]
        ms = alternating_rounds_ms(calls, rounds=5, seconds=seconds / 5)
        row: dict = {"batch_size": batch}
        for name, times in ms.items():
            median = float(np.median(times))
            row.update({f"{name}_ms": median, f"{name}_images_per_s": batch * 1000 / median})
        for name in ("maps_free", "attention"):
            row[f"{name}_max_logits_diff_relative"] = float(np.abs(answers[name] - reference).max()
                                                            / max(1.0, np.abs(reference).max()))
            row[f"{name}_top1_agreement"] = float((answers[name].argmax(1) == reference.argmax(1)).mean())
        rows.append(row)
    return {"fused_ops": fused_ops, "rows": rows}


def jpeg_for(info) -> bytes:
    """One JPEG at the model's trained size (a smooth test image from the bench's own generator, resized)."""
    import io

    from PIL import Image

    from vitserve.bench.load import make_images

    source = Image.open(io.BytesIO(make_images("jpeg", (480, 640), 3, 1)[0]))
    image = source.resize(info.image_size[::-1]).convert("L" if info.channels == 1 else "RGB")
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


def served_variants(spec: str) -> list[tuple[str, dict[str, str]]]:
    """`--served-variants` as (name, environment overlay) pairs; [("", {})] when there are none."""
    variants = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, settings = part.partition(":")
        overlay = {}
        for setting in filter(None, (s.strip() for s in settings.split(","))):
            key, eq, value = setting.partition("=")
            if not eq or not key.startswith("VITSERVE_"):
                raise ValueError(f"--served-variants: {setting!r} is not VITSERVE_NAME=value")
            overlay[key] = value
        if not name.strip():
            raise ValueError(f"--served-variants: {part!r} has no name before ':'")
        variants.append((name.strip(), overlay))
    return variants or [("", {})]


def served_schedule(spec: str, rounds: int) -> list[tuple[int, str, dict[str, str]]]:
    """(round, name, overlay) in the order they run: every variant each round, reversed every other round (ABBA),
    so a drift of the machine's speed weighs on each alike."""
    variants = served_variants(spec)
    return [(r + 1, name, overlay) for r in range(rounds)
            for name, overlay in (variants if r % 2 == 0 else variants[::-1])]


def served_with_wrk(path: Path, cfg: GpuKitConfig, overlay: dict[str, str] | None = None) -> dict | Step:
    """A real `vitserve serve` on CUDA (batches up to 64, CUDA graphs) loaded by wrk on its own cores; `overlay`
    changes the server's settings for a comparison."""
    from vitserve.bench.gpu_served import served_levels
    from vitserve.onnx_header import read_model_info

    wrk = cfg.wrk or shutil.which("wrk")
    if not wrk:
        return Step("", "skipped", "no wrk (carry Debian's binary and its libluajit; docs/results/bench-gpu.md)")
    # gRPC off: the kit's wheels leave out grpcio (7 MiB, `--leave-out grpcio`), and wrk speaks HTTP
    env = {"VITSERVE_PROVIDERS": "cuda,cpu", "VITSERVE_MAX_BATCH_SIZE": "64", "VITSERVE_MAX_QUEUE_SIZE": "1024",
           "VITSERVE_MAX_REQUESTS_IN_FLIGHT": "256", "VITSERVE_GRPC_PORT": "0", **(overlay or {})}
    return served_levels(path, jpeg_for(read_model_info(path)), [int(c) for c in cfg.served_concurrency.split(",")],
                         cfg.served_duration_s, env, wrk, cfg.work)


def bench_served(path: Path, provider: str, cfg: GpuKitConfig, batch_sizes: list[int], concurrency: list[int],
                 duration_s: float) -> dict:
    """`vitserve bench` on `path` with `provider` first: raw at each batch size, then served."""
    from vitserve.bench.config import BenchConfig
    from vitserve.bench.run import run_bench

    name = {CUDA: "cuda", TENSORRT: "tensorrt", CPU: "cpu"}[provider]
    overrides = {"providers": name if provider == CPU else f"{name},cpu"}
    if provider == TENSORRT:
        overrides["tensorrt_cache_dir"] = str((cfg.work / "trt").absolute())
    bench_cfg = BenchConfig(model=str(path), batch_sizes=batch_sizes, concurrency=concurrency, inputs=["png"],
                            duration_s=duration_s, raw_duration_s=duration_s / 2, pairs=10, bare="off",
                            max_batch_size=max(batch_sizes), time_limit_s=900, log_dir=cfg.work / "logs",
                            out=cfg.work / f"{path.stem}-{name}.md")
    report = run_bench(bench_cfg, overrides, command="python -m vitserve.bench.gpu")
    return {"provider": report["model"]["provider"],
            "raw": [{k: r[k] for k in ("batch_size", "images_per_s", "p50_ms")} for r in report["raw"]],
            "served": [{k: r.get(k) for k in ("batching", "concurrency", "requests_per_s", "p50_ms", "p99_ms")}
                       for r in report["served"] if "skipped" not in r and r.get("batching") == "on"]}


def run(cfg: GpuKitConfig) -> Kit:
    kit = Kit(cfg)
    env = kit.step("environment", environment).result
    on_gpu = CUDA in env.get("providers", [])
    provider = CUDA if on_gpu else CPU
    models = cfg.models.split(",") if on_gpu else ["default"]
    precisions = cfg.precisions.split(",")
    batch_sizes = [int(b) for b in cfg.batch_sizes.split(",")] if on_gpu else [1, 8]
    concurrency = [int(c) for c in cfg.concurrency.split(",")] if on_gpu else [1, 8]
    duration = cfg.duration_s if on_gpu else 1.0
    if not on_gpu:
        for skipped in sorted(set(cfg.models.split(",")) - {"default"}):
            kit.steps.append(Step(f"{skipped}: every step", "skipped", "no CUDA provider: the CPU run is a check "
                                                                       "of the kit, on the default model only"))
    for model in models:
        name = model if model == "default" or not cfg.preset_overrides else f"{model}[{cfg.preset_overrides}]"
        files = {}
        for precision in precisions:
            if not env.get("torch"):
                kit.steps.append(Step(f"{name} {precision}: export", "skipped", "torch is not installed here"))
                continue
            made = kit.step(f"{name} {precision}: export", lambda m=model, p=precision: {"path": str(
                export_file(m, p, cfg.work, cfg.checkpoint, cfg.preset_overrides, cfg.preset_fast_only))})
            if made.status == "ran":
                files[precision] = Path(made.result["path"])
        reference = files.get("fp32")
        for precision, path in files.items():
            if reference is not None:
                kit.step(f"{name} {precision}: verify on {provider}", verify_on, path, reference, provider)
            if on_gpu:
                steps = cfg.gpu_steps.split(",")
                if "graphs" in steps:
                    kit.step(f"{name} {precision}: CUDA graphs vs dynamic, raw", cuda_graphs_raw, path, batch_sizes,
                             duration)
                if "fused" in steps:
                    kit.step(f"{name} {precision}: fused maps-free vs rollout, raw", maps_free_fused, path,
                             batch_sizes, duration, cfg.work)
                if "first-calls" in steps:
                    kit.step(f"{name} {precision}: first calls at new batch sizes", first_calls, path)
                if "served" in steps and (not cfg.served_files
                                          or f"{model}:{precision}" in cfg.served_files.split(",")):
                    for round_, variant, overlay in served_schedule(cfg.served_variants, cfg.served_rounds):
                        label = ", ".join(filter(None, (variant, f"round {round_}" if cfg.served_rounds > 1 else "")))
                        kit.step(f"{name} {precision}: served, wrk, JPEG" + (f" ({label})" if label else ""),
                                 served_with_wrk, path, cfg, overlay)
                continue
            if precision == "fp16":
                kit.steps.append(Step(f"{name} fp16: raw and served", "skipped", "float16 is for GPUs: on the CPU "
                                                                                    "it measures nothing of use"))
                continue
            kit.step(f"{name} {precision}: raw and served on {provider}", bench_served, path, provider, cfg,
                     batch_sizes, concurrency, duration)
            if TENSORRT in env.get("providers", []):
                kit.step(f"{name} {precision}: raw and served on TensorRT", bench_served, path, TENSORRT, cfg,
                         batch_sizes, concurrency, duration)
            else:
                kit.steps.append(Step(f"{name} {precision}: TensorRT", "skipped",
                                      "no TensorrtExecutionProvider in this onnxruntime build"))
    return kit


def config_strings(cfg: GpuKitConfig) -> dict[str, str]:
    return {k: str(v) for k, v in asdict(cfg).items()}


def unloadable(env: dict) -> str:
    missing = [p for p in env.get("built_in", []) if p not in env.get("providers", [])]
    return f" (built in but not starting here: {', '.join(missing)})" if missing else ""


def render(kit: Kit, cfg: GpuKitConfig) -> str:
    env = kit.steps[0].result if kit.steps and kit.steps[0].status == "ran" else {}
    lines = ["# The GPU kit", "",
             "What `make bench-gpu` did on the machine below. Without a GPU it is a check that the kit works, not a "
             "result: the GPU figures come from a run on a GPU.", "",
             f"`python -m vitserve.bench.gpu` ({json.dumps(config_strings(cfg))})",
             "", f"Machine: {env.get('gpus') or 'no GPU (nvidia-smi absent or silent)'}; onnxruntime "
                 f"{env.get('onnxruntime')} with {', '.join(env.get('providers', []))}{unloadable(env)}; "
                 f"Python {env.get('python')}; "
                 f"{env.get('date')}.", "", "| step | status | detail |", "|---|---|---|"]
    for s in kit.steps[1:]:
        detail = s.detail or ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                       for k, v in s.result.items()
                                       if k not in ("raw", "served", "traceback", "rows", "levels"))
        lines.append(f"| {s.name} | {s.status} | {detail.replace('|', '/')} |")
    for s in kit.steps:
        lines += step_tables(s)
        if "raw" in s.result:
            lines += ["", f"## {s.name} ({s.result['provider']})", "", "| batch | raw images/s | raw p50 ms |",
                      "|---|---|---|"]
            lines += [f"| {r['batch_size']} | {r['images_per_s']:.1f} | {r['p50_ms']:.2f} |" for r in s.result["raw"]]
            lines += ["", "| clients | served req/s | p50 ms | p99 ms |", "|---|---|---|---|"]
            lines += [f"| {r['concurrency']} | {r['requests_per_s']:.1f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |"
                      for r in s.result["served"]]
    return "\n".join(lines) + "\n"


def step_tables(step: Step) -> list[str]:
    """The per-batch rows and per-level results of the GPU steps as Markdown tables."""
    def table(rows: list[dict]) -> list[str]:
        keys = [k for k in rows[0] if not isinstance(rows[0][k], (dict, list))]
        cells = [[f"{r.get(k):.4g}" if isinstance(r.get(k), float) else str(r.get(k)) for k in keys] for r in rows]
        return ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] + ["| " + " | ".join(c) + " |"
                                                                            for c in cells]
    out = []
    for key in ("rows", "levels"):
        if step.result.get(key):
            out += ["", f"## {step.name}", ""] + table(step.result[key])
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    d = GpuKitConfig()
    p = argparse.ArgumentParser(prog="python -m vitserve.bench.gpu", description=__doc__.split("\n\n")[0])
    for name, default in asdict(d).items():
        if isinstance(default, bool):
            p.add_argument("--no-" + name.replace("_", "-"), dest=name, action="store_false")
        else:
            p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    cfg = GpuKitConfig(**vars(p.parse_args(argv)))
    try:
        served_variants(cfg.served_variants)  # a mistyped variant fails now, not after minutes of exports
    except ValueError as e:
        p.error(str(e))
    if cfg.served_rounds < 1:
        p.error(f"--served-rounds: {cfg.served_rounds} is not a count of rounds (1 or more)")
    unknown = [step for step in cfg.gpu_steps.split(",") if step not in GPU_STEPS]
    if unknown:  # a mistyped step would run nothing, seen only in the report once the GPU's time is spent
        p.error(f"--gpu-steps: no step {', '.join(unknown)} (the steps: {', '.join(GPU_STEPS)})")
    import onnxruntime as ort
    if cfg.install and CUDA not in ort.get_available_providers() and shutil.which("nvidia-smi"):
        rerun = install_and_rerun(cfg, [a for a in argv if a != "--no-install"])
        if rerun is not None:
            return rerun
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    kit = run(cfg)
    kit.write()
    print(f"wrote {cfg.out}", flush=True)
    return 1 if any(s.status == "failed" for s in kit.steps) else 0


if __name__ == "__main__":
    raise SystemExit(main())
