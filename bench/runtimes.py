"""`python -m vitserve.bench.runtimes FILE...`: every runtime and precision this CPU can run, on the same files, side
by side.

For each file, the server's own model objects (`service.engine.runtime.load_model`, as `--runtime onnxruntime` and
`--runtime openvino` with each precision hint OpenVINO can compute here), raw (no server), at each batch size at the
trained resolution: images/s from the median of alternating rounds, so the machine's drift falls on every candidate
alike. Beside the speed, each candidate's largest logit difference from ONNX Runtime on the same file (float32, or
the file's int8 layers) on the probe images
(`service.engine.inference_model.probe_pixels`), and what `--runtime auto` picks for the file on this machine.

`--accuracy DIR` (a Fashion-MNIST IDX directory, for files trained on it): each candidate's accuracy on the whole
test split, its top-1 agreement with ONNX Runtime float32, and the Spearman correlation of its rollout maps with
float32's (mean and minimum over every image): what a reduced precision costs, beside what it gains.

`--peak`: how much of the chip's matrix arithmetic each file's fastest run uses. The file's FLOPs per image are
counted in its fast graph at the trained size (every MatMul and convolution, 2 FLOPs a multiply-add, after OpenVINO
has made the shapes static); the chip's peak is measured, as the best of OpenVINO's own 2048 x 2048 x 2048
MatMul at each precision on every core: what this chip's matrix units deliver to a large GEMM, not a data-sheet
figure (which needs the clock under load and each instruction's issue rate, neither of which this machine shows).
"""
from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np

from vitserve.bench.report import command_line, publish


def candidates(path: Path, threads: int) -> dict:
    from vitserve.service.engine import openvino_runtime
    from vitserve.service.engine.runtime import load_model
    from vitserve.service.ground.settings import Settings

    base: dict[str, Any] = dict(model_path=path, providers=["cpu"], intra_op_threads=threads, max_batch_size=64)
    models = {"onnxruntime": load_model(Settings(**base, runtime="onnxruntime"))}
    if openvino_runtime.available():
        precisions = ["fp32"] + (["bf16"] if "BF16" in openvino_runtime.cpu_capabilities() else [])
        for precision in precisions:
            models[f"openvino {precision}"] = load_model(Settings(**base, runtime="openvino",
                                                                  precision_hint=precision))
    return models


def compare(path: Path, batches: list[int], rounds: int, seconds: float, threads: int,
            accuracy_dir: Path | None = None) -> dict:
    from vitserve.bench.measure import alternating_rounds_ms
    from vitserve.service.engine.inference_model import probe_pixels
    from vitserve.service.engine.runtime import load_model
    from vitserve.service.ground.settings import Settings

    models = candidates(path, threads)
    reference = models["onnxruntime"]
    info = reference.info
    probe = probe_pixels(info)
    want = reference.run(probe)[0]
    rows = []
    for batch in batches:
        pixels = np.resize(probe, (batch, info.channels, *info.image_size)).astype(np.float32)
        times = alternating_rounds_ms({name: (lambda m=m, pixels=pixels: m.run(pixels)) for name, m in models.items()},
                                      rounds, seconds)
        for name, values in times.items():
            ms = float(np.median(values))
            rows.append({"batch": batch, "candidate": name, "ms": ms, "images_per_s": batch * 1000 / ms})
    differences = {name: float(np.abs(m.run(probe)[0] - want).max()) for name, m in models.items()}
    auto = load_model(Settings(model_path=path, providers=["cpu"], intra_op_threads=threads, max_batch_size=64,
                               runtime="auto"))
    return {"file": str(path), "model": f"{info.name} {info.version} ({info.precision})", "rows": rows,
            "max_logit_diff_vs_onnxruntime": differences, "largest_logit": float(np.abs(want).max()),
            "auto_picks": auto.provider, "accuracy": accuracy(models, accuracy_dir) if accuracy_dir else {}}


def graph_gflops(path: Path) -> float:
    """GFLOPs of one image through the file's fast graph at its trained size: 2 x multiply-adds of every MatMul and
    convolution (the rest, softmax and norms, is a few per cent and not matrix work)."""
    import openvino as ov

    from vitserve.service.engine.onnx_runtime import read_artifact

    info, paths = read_artifact(path)
    model = ov.Core().read_model(paths.fast.SerializeToString())
    model.reshape({model.inputs[0].get_any_name(): [1, info.channels, *info.image_size]})
    flops = 0
    for op in model.get_ordered_ops():
        kind = op.get_type_name()
        if kind == "MatMul":
            a = list(op.get_input_shape(0))
            depth = a[-2] if op.get_attributes().get("transpose_a") else a[-1]
            flops += 2 * int(np.prod(list(op.get_output_shape(0)))) * depth
        elif kind in ("Convolution", "GroupConvolution"):
            weights = list(op.get_input_shape(1))  # (out, in, kh, kw) or grouped (g, out/g, in/g, kh, kw)
            flops += 2 * int(np.prod(list(op.get_output_shape(0)))) * int(np.prod(weights[-3:]))
    return flops / 1e9


def matmul_peak_gflops(precision: str, threads: int, size: int = 2048, rounds: int = 5) -> float:
    """The best GFLOP/s of OpenVINO's `size`-cubed MatMul at `precision` on this CPU (a large GEMM: what the matrix
    units deliver when nothing else limits them)."""
    import openvino as ov
    from openvino import opset13 as ops

    from vitserve.bench.measure import timed_calls
    from vitserve.service.engine.openvino_runtime import PRECISION_HINTS, signal_stack_kept

    a = ops.parameter([size, size], ov.Type.f32)
    b = ops.constant(np.random.default_rng(0).standard_normal((size, size)).astype(np.float32))
    config = {"INFERENCE_PRECISION_HINT": PRECISION_HINTS[precision], "PERFORMANCE_HINT": "LATENCY"}
    if threads:
        config["INFERENCE_NUM_THREADS"] = str(threads)
    with signal_stack_kept():
        compiled = ov.Core().compile_model(ov.Model([ops.matmul(a, b, False, False)], [a]), "CPU", config)
    request = compiled.create_infer_request()
    x = np.random.default_rng(1).standard_normal((size, size)).astype(np.float32)
    best = min(min(timed_calls(lambda: request.infer({0: x}), 0.5)) for _ in range(rounds))
    return 2 * size ** 3 / best / 1e9


def peak_fraction(report: dict, path: Path, peaks: dict[str, float]) -> dict:
    """Each OpenVINO candidate's best images/s as GFLOP/s, and as a fraction of the measured peak at its precision."""
    gflops = graph_gflops(path)
    out: dict[str, Any] = {"gflops_per_image": gflops, "candidates": {}}
    for name in {r["candidate"] for r in report["rows"]}:
        precision = "bf16" if name.endswith("bf16") else "fp32"
        best = max((r for r in report["rows"] if r["candidate"] == name), key=lambda r: r["images_per_s"])
        achieved = best["images_per_s"] * gflops
        out["candidates"][name] = {"batch": best["batch"], "images_per_s": best["images_per_s"],
                                   "gflop_per_s": achieved, "peak_gflop_per_s": peaks[precision],
                                   "fraction": achieved / peaks[precision]}
    return out


def accuracy(models: dict, directory: Path, batch: int = 64) -> dict:
    """Each candidate on the labelled test split of `directory` against ONNX Runtime float32 (`models`' first)."""
    from vitserve.artifact import normalize_pixels
    from vitserve.export.accuracy_gate import spearman
    from vitserve.model.data import read_idx

    info = next(iter(models.values())).info
    images, labels = (read_idx(directory / f"t10k-{kind}-idx{dims}-ubyte.gz") for kind, dims in (("images", 3),
                                                                                               ("labels", 1)))
    if (info.channels, *info.image_size) != (1, *images.shape[1:]):
        raise SystemExit(f"--accuracy: {info.name} takes {info.channels}x{info.image_size}, the set is "
                         f"1x{images.shape[1:]}")
    pixels = normalize_pixels(images[:, None], info.mean, info.std, channel_axis=1)
    outputs = {}
    for name, model in models.items():
        runs = [model.run(pixels[i:i + batch]) for i in range(0, len(pixels), batch)]
        outputs[name] = tuple(np.concatenate([r[k] for r in runs]) for k in (0, 1))  # logits, rollout
    want_logits, want_rollout = next(iter(outputs.values()))
    result = {}
    for name, (logits, rollout) in outputs.items():
        rho = spearman(rollout, want_rollout)
        result[name] = {"images": len(labels), "accuracy": float((logits.argmax(1) == labels).mean()),
                        "top1_agreement": float((logits.argmax(1) == want_logits.argmax(1)).mean()),
                        "rollout_spearman_mean": float(rho.mean()), "rollout_spearman_min": float(rho.min())}
    return result


def render(reports: list[dict], command: str) -> str:
    from vitserve.service.engine import openvino_runtime

    capabilities = sorted(openvino_runtime.cpu_capabilities()) if openvino_runtime.available() else []
    cpu = cpu_name()
    lines = ["# Runtimes and precisions on this CPU", "", f"`{command}` (bench/runtimes.py); {cpu}, {os.cpu_count()} "
             f"cores; OpenVINO's CPU capabilities: {', '.join(capabilities) or 'OpenVINO not installed'}.", ""]
    for report in reports:
        lines += [f"## {report['model']}: `{report['file']}`", "", f"`--runtime auto` picks **{report['auto_picks']}**"
                  " here.", "", "| batch | candidate | ms | images/s | max logit diff vs onnxruntime |",
                  "|---|---|---|---|---|"]
        for r in report["rows"]:
            diff = report["max_logit_diff_vs_onnxruntime"][r["candidate"]]
            lines.append(f"| {r['batch']} | {r['candidate']} | {r['ms']:.2f} | {r['images_per_s']:,.1f} | "
                         f"{diff:.2g} |")
        lines.append("")
        if report.get("peak"):
            peak = report["peak"]
            lines += [f"Matrix arithmetic used: {peak['gflops_per_image']:.2f} GFLOP per image (the fast graph's "
                      "MatMuls and convolutions at the trained size), at each candidate's best batch, against this "
                      "CPU's measured peak at its precision (OpenVINO's 2048-cubed MatMul, every core):", "",
                      "| candidate | batch | images/s | GFLOP/s | peak GFLOP/s | fraction of peak |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| {name} | {c['batch']} | {c['images_per_s']:,.1f} | {c['gflop_per_s']:,.0f} | "
                      f"{c['peak_gflop_per_s']:,.0f} | {c['fraction']:.0%} |"
                      for name, c in sorted(peak["candidates"].items())]
            lines += ["", "The probe GEMM is a lower bound of the peak: a fraction over 100% says the model's own "
                      "matrix shapes ran faster than the 2048-cubed probe, not that the chip exceeded its peak.", ""]
        if report.get("accuracy"):
            lines += [f"On the {next(iter(report['accuracy'].values()))['images']:,} test images:", "",
                      "| candidate | accuracy | top-1 agreement with onnxruntime | rollout Spearman, mean | min |",
                      "|---|---|---|---|---|"]
            lines += [f"| {name} | {a['accuracy']:.2%} | {a['top1_agreement']:.2%} | "
                      f"{a['rollout_spearman_mean']:.4f} | {a['rollout_spearman_min']:.4f} |"
                      for name, a in report["accuracy"].items()]
            lines.append("")
    return "\n".join(lines)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), which says whether it has AMX or AVX-512: figures depend on it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vitserve.bench.runtimes", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.5, help="per candidate and round")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: every core)")
    p.add_argument("--accuracy", type=Path, metavar="DIR", help="a Fashion-MNIST IDX directory: each candidate's "
                   "accuracy, agreement and rollout correlation on its test split")
    p.add_argument("--peak", action="store_true", help="each candidate's share of this CPU's measured matrix peak "
                   "(needs openvino)")
    p.add_argument("--out", type=Path, help="the Markdown report; its JSON beside it")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    reports = [compare(path, batches, args.rounds, args.seconds, args.threads, args.accuracy)
               for path in args.files]
    if args.peak:
        from vitserve.service.engine import openvino_runtime

        precisions = ["fp32"] + (["bf16"] if "BF16" in openvino_runtime.cpu_capabilities() else [])
        peaks = {precision: matmul_peak_gflops(precision, args.threads) for precision in precisions}
        for path, report in zip(args.files, reports):
            report["peak"] = peak_fraction(report, path, peaks)
    publish(render(reports, command_line("python -m vitserve.bench.runtimes", argv)), reports, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
