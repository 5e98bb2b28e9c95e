"""`python -m vitserve.bench.runtimes FILE...`: every runtime and precision this CPU can run, on the same files, side by side.

For each file, the server's own model objects (`service.engine.runtime.load_model`, as `--runtime onnxruntime` and
`--runtime openvino` with each precision hint OpenVINO can compute here), raw (no server), at each batch size at the
trained resolution: images/s from the median of alternating rounds, so the machine's drift falls on every candidate
alike. Beside the speed, each candidate's largest logit difference from ONNX Runtime on the same file (float32, or
the file's int8 layers) on the probe images
(`service.engine.runtime.probe_pixels`), and what `--runtime auto` picks for the file on this machine.
"""
from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

import numpy as np

from vitserve.bench.report import command_line, publish


def candidates(path: Path, threads: int) -> dict:
    from vitserve.service.engine import openvino_runtime
    from vitserve.service.engine.runtime import load_model
    from vitserve.service.ground.settings import Settings

    base = dict(model_path=path, providers=["cpu"], intra_op_threads=threads, max_batch_size=64)
    models = {"onnxruntime": load_model(Settings(**base, runtime="onnxruntime"))}
    if openvino_runtime.available():
        precisions = ["fp32"] + (["bf16"] if "BF16" in openvino_runtime.cpu_capabilities() else [])
        for precision in precisions:
            models[f"openvino {precision}"] = load_model(Settings(**base, runtime="openvino",
                                                                  precision_hint=precision))
    return models


def compare(path: Path, batches: list[int], rounds: int, seconds: float, threads: int) -> dict:
    from vitserve.bench.measure import alternating_rounds_ms
    from vitserve.service.engine.runtime import load_model, probe_pixels
    from vitserve.service.ground.settings import Settings

    models = candidates(path, threads)
    reference = models["onnxruntime"]
    info = reference.info
    probe = probe_pixels(info)
    want = reference.run(probe)[0]
    rows = []
    for batch in batches:
        pixels = np.resize(probe, (batch, info.channels, *info.image_size)).astype(np.float32)
        times = alternating_rounds_ms({name: (lambda m=m: m.run(pixels)) for name, m in models.items()}, rounds,
                                      seconds)
        for name, values in times.items():
            ms = float(np.median(values))
            rows.append({"batch": batch, "candidate": name, "ms": ms, "images_per_s": batch * 1000 / ms})
    differences = {name: float(np.abs(m.run(probe)[0] - want).max()) for name, m in models.items()}
    auto = load_model(Settings(model_path=path, providers=["cpu"], intra_op_threads=threads, max_batch_size=64,
                               runtime="auto"))
    return {"file": str(path), "model": f"{info.name} {info.version} ({info.precision})", "rows": rows,
            "max_logit_diff_vs_onnxruntime": differences, "largest_logit": float(np.abs(want).max()),
            "auto_picks": auto.provider}


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
    p.add_argument("--out", type=Path, help="the Markdown report; its JSON beside it")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    reports = [compare(path, batches, args.rounds, args.seconds, args.threads) for path in args.files]
    publish(render(reports, command_line("python -m vitserve.bench.runtimes", argv)), reports, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
