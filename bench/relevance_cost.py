"""`vitserve evaluate relevance-cost`: what the relevance path costs, and whether carrying it slows the fast path.

One checkpoint is exported twice (export/onnx_export.py): fast-only (`relevance=False`, the graph every model had
before the relevance path) and with the relevance path (one `If` on whether `target_class` has elements). Three
cases then run on the same normalised random images at the trained size:

- `fast_only`: the fast-only artifact, fed `pixel_values`, asked for logits and rollout;
- `fast_path`: the new artifact fed only `pixel_values` (its `If` takes the fast branch), logits and rollout;
- `relevance_path`: the new artifact fed `target_class` = -1 (the top-1) for every image, logits and relevance.

Sessions are the server's own: `service.engine.onnx_runtime.OnnxModel.load(Settings(model_path=..., intra_op_threads=N,
providers=["cpu"]))`, its session options (sequential, no spinning, every graph optimisation); the timed call is
`model.session.run(outputs, feeds)`. This machine's speed drifts, so for each thread setting and batch size the
three cases take turns for `rounds` rounds (the order reversed every other round), each running for `seconds` per
round. Per case: the median and p90 of every call's latency and images/s; per pair, the ratio of the medians and,
beside it the per-round ratios (one case's median over the other's in the same round, paired against drift):
their median, smallest and largest.

The targets: relevance_path / fast_path <= 3.0 at every batch size; fast_path / fast_only unchanged,
which this report grants only when the per-round ratios span 1.0, or all lie within 1.00 +- 0.03.

With the command's parser only the standard library and bench.reliability (which `vitserve` loads anyway) load;
numpy, onnxruntime and torch load when it runs.
"""
from __future__ import annotations

import shlex
import statistics
import sys
from pathlib import Path
from typing import TypedDict

from vitserve.bench.measure import timed_calls
from vitserve.bench.reliability import number, table, write_report
from vitserve.help_format import DefaultsHelpFormatter

CASES = ("fast_only", "fast_path", "relevance_path")
CASE_LABELS = {"fast_only": "(a) fast-only artifact", "fast_path": "(b) new artifact, fast path",
               "relevance_path": "(c) new artifact, relevance path"}
# ratio name -> (numerator case, denominator case)
RATIOS = {"fast_path/fast_only": ("fast_path", "fast_only"),
          "relevance_path/fast_path": ("relevance_path", "fast_path")}
RELEVANCE_TARGET = 3.0  # relevance_path / fast_path, at most
UNCHANGED_BAND = 0.03  # fast_path / fast_only: every round within 1 +- this, or the rounds on both sides of 1
MIN_CALLS = 3  # per case per round, however long a call takes


def relevance_cost(checkpoint_dir: str | Path, batch_sizes=(1, 32), threads=(1, 0), rounds: int = 7,
                   seconds_per_case: float = 1.0, size: tuple[int, int] | None = None,
                   work_dir: str | Path = "build/relevance-cost", verify: bool = False, command: str = "") -> dict:
    """Export `checkpoint_dir` both ways into `work_dir`, then time the three cases at every thread setting (0: ONNX
    Runtime's default, one thread per core) and batch size; returns the report `render_markdown` renders."""
    from vitserve.bench.run import environment

    env = environment()
    artifacts = export_both(checkpoint_dir, Path(work_dir), verify)
    report = measure_artifacts(artifacts, batch_sizes, threads, rounds, seconds_per_case, size)
    other = [row["other_cores"] for row in report["rows"]]
    report["environment"] = {**env, "loadavg_end": _load_average(), "other_cores_mean": sum(other) / len(other)}
    report["model"]["checkpoint"] = str(checkpoint_dir)
    report["settings"]["verified"] = verify
    return {"command": command, **report}


def measure_artifacts(artifacts: dict, batch_sizes, threads, rounds: int, seconds_per_case: float,
                      size: tuple[int, int] | None = None) -> dict:
    """The three cases over `artifacts` (as `export_both` returns them), per thread setting and batch size."""
    rows, checks = [], []
    for n_threads in threads:
        models = {name: load_model(artifacts[name]["path"], n_threads) for name in ("fast_only", "with_relevance")}
        info = models["with_relevance"].info
        pixels = random_pixels(info, max(batch_sizes), size)
        checks.append({"threads": n_threads, **check_cases(models, pixels[:2])})
        for batch in batch_sizes:
            rows.append(measure_batch(models, pixels[:batch], n_threads, rounds, seconds_per_case))
            print(row_line(rows[-1]), flush=True)
    height, width = pixels.shape[-2:]
    return {"model": {"name": info.name, "version": info.version, "height": height, "width": width,
                      "channels": info.channels, "patch_size": info.patch_size},
            "artifacts": artifacts, "checks": checks, "rows": rows,
            "settings": {"batch_sizes": list(batch_sizes), "threads": list(threads), "rounds": rounds,
                         "seconds_per_case": seconds_per_case, "min_calls": MIN_CALLS,
                         "session": "service.engine.onnx_runtime.OnnxModel.load(Settings(model_path, intra_op_threads, "
                                    "providers=['cpu'])).session.run(outputs, feeds)"},
            "targets": {"relevance_path/fast_path": RELEVANCE_TARGET, "unchanged_band": UNCHANGED_BAND}}


def export_both(checkpoint_dir: str | Path, work_dir: Path, verify: bool) -> dict:
    """{"fast_only" | "with_relevance": {"path", "size_bytes", "export_seconds"}}: the checkpoint exported twice."""
    from vitserve.export.onnx_export import export_onnx

    artifacts = {}
    for name, relevance in (("fast_only", False), ("with_relevance", True)):
        print(f"exporting {checkpoint_dir} ({name})", flush=True)
        report = export_onnx(checkpoint_dir, work_dir / f"{name}.onnx", verify=verify, relevance=relevance)
        artifacts[name] = {"path": str(report.path), "size_bytes": report.size_bytes,
                           "export_seconds": round(report.export_seconds, 1)}
    return artifacts


def load_model(path: str | Path, threads: int):
    """The server's session over `path` on the CPU, with `threads` intra-op threads (0: ONNX Runtime's default)."""
    from vitserve.service.engine.onnx_runtime import OnnxModel
    from vitserve.service.ground.settings import Settings

    return OnnxModel.load(Settings(model_path=Path(path), intra_op_threads=threads, providers=["cpu"]))


def random_pixels(info, count: int, size: tuple[int, int] | None = None, seed: int = 0):
    """`count` random uint8 images at `size` (default: the trained size), normalised as the server does:
    (count, C, H, W) float32."""
    import numpy as np

    from vitserve.artifact import normalize_pixels

    height, width = size or info.image_size
    raw = np.random.default_rng(seed).integers(0, 256, (count, info.channels, height, width), dtype=np.uint8)
    return np.ascontiguousarray(normalize_pixels(raw, info.mean, info.std))


def case_calls(models: dict, pixels) -> dict:
    """{case: a call of one batch}: the three cases' `session.run` with their feeds and outputs."""
    import numpy as np

    from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES, RELEVANCE_NAME, TARGET_NAME, TOP1_TARGET

    fast, new = models["fast_only"].session, models["with_relevance"]
    relevance_session = new.relevance_session()
    targets = np.full(len(pixels), TOP1_TARGET, dtype=np.int64)
    logits_and_relevance = [OUTPUT_NAMES[0], RELEVANCE_NAME]
    return {"fast_only": lambda: fast.run(list(OUTPUT_NAMES), {INPUT_NAME: pixels}),
            "fast_path": lambda: new.session.run(list(OUTPUT_NAMES), {INPUT_NAME: pixels}),
            "relevance_path": lambda: relevance_session.run(logits_and_relevance,
                                                            {INPUT_NAME: pixels, TARGET_NAME: targets})}


def check_cases(models: dict, pixels) -> dict:
    """That the cases run the paths they are named for: the same logits from both artifacts' fast paths (the server
    runs a file's fast path as a graph of its own, service/engine/graph_paths.py), a full relevance map
    (B, H/P, W/P) on the relevance path."""
    import numpy as np

    from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES, RELEVANCE_NAME, TARGET_NAME, TOP1_TARGET

    new = models["with_relevance"]
    fast_logits = models["fast_only"].session.run([OUTPUT_NAMES[0]], {INPUT_NAME: pixels})[0]
    logits = new.session.run([OUTPUT_NAMES[0]], {INPUT_NAME: pixels})[0]
    targets = np.full(len(pixels), TOP1_TARGET, dtype=np.int64)
    relevance = new.relevance_session().run([RELEVANCE_NAME], {INPUT_NAME: pixels, TARGET_NAME: targets})[0]
    return {"logits_max_abs_diff": float(np.abs(fast_logits - logits).max()),
            "fast_path_outputs": [o.name for o in new.session.get_outputs()], "relevance_shape": list(relevance.shape)}


def measure_batch(models: dict, pixels, threads: int, rounds: int, seconds: float) -> dict:
    """The three cases at one batch size, alternating round by round; one warm-up call each first."""
    from vitserve.bench.measure import CpuSnapshot

    calls = case_calls(models, pixels)
    for run in calls.values():
        run()
    per_round: dict[str, list[list[float]]] = {case: [] for case in CASES}
    before = CpuSnapshot.take(None)
    for r in range(rounds):
        for case in (CASES if r % 2 == 0 else CASES[::-1]):
            per_round[case].append(timed_calls(calls[case], seconds, MIN_CALLS))
    other = before.usage(CpuSnapshot.take(None))["other_cores"]
    return summarise(per_round, len(pixels), threads, other)


class CaseSummary(TypedDict):
    calls: int
    p50_ms: float
    p90_ms: float
    images_per_s: float
    round_p50_ms: list[float]  # each round's median


def summarise(per_round: dict[str, list[list[float]]], batch: int, threads: int, other_cores: float) -> dict:
    """One row: per case the latency percentiles over every call, images/s and the per-round medians; per ratio
    the ratio of the medians and the range of the per-round ratios."""
    from vitserve.bench.measure import latency_summary

    cases: dict[str, CaseSummary] = {}
    for case, rounds in per_round.items():
        every = [t for times in rounds for t in times]
        summary = latency_summary(every)
        cases[case] = {"calls": len(every), "p50_ms": summary["p50_ms"], "p90_ms": summary["p90_ms"],
                       "images_per_s": batch * len(every) / sum(every),
                       "round_p50_ms": [statistics.median(times) * 1000 for times in rounds]}
    ratios = {}
    for name, (top, bottom) in RATIOS.items():
        per = [a / b for a, b in zip(cases[top]["round_p50_ms"], cases[bottom]["round_p50_ms"])]
        ratios[name] = {"ratio": cases[top]["p50_ms"] / cases[bottom]["p50_ms"], "round_median": statistics.median(per),
                        "round_min": min(per), "round_max": max(per), "rounds": per}
    return {"threads": threads, "batch_size": batch, "cases": cases, "ratios": ratios, "other_cores": other_cores}


def unchanged(ratio: dict) -> bool:
    """fast_path / fast_only counts as unchanged when its per-round ratios span 1.0 or all lie within 1 +- 3%."""
    low, high = ratio["round_min"], ratio["round_max"]
    return low <= 1.0 <= high or (1 - UNCHANGED_BAND <= low and high <= 1 + UNCHANGED_BAND)


def row_line(row: dict) -> str:
    c, r = row["cases"], row["ratios"]
    return (f"  threads {row['threads']} batch {row['batch_size']:3d}: " + "  ".join(
        f"{case} {c[case]['p50_ms']:.2f} ms" for case in CASES) + f"  b/a {r['fast_path/fast_only']['ratio']:.3f}"
        f"  c/b {r['relevance_path/fast_path']['ratio']:.2f}")


def _load_average() -> str:
    from vitserve.machine import load_average

    return load_average()


# ---------------------------------------------------------------------------------------------------- report


def render_markdown(report: dict) -> str:
    """The report as Markdown: setting and method, the targets per thread setting and batch size, then each one's
    three cases."""
    lines = _preamble(report) + ["## Targets", ""] + targets_table(report["rows"]) + [""] + unresolved(report["rows"])
    for row in report["rows"]:
        lines += [f"## {threads_label(row['threads'])}, batch {row['batch_size']}", ""] + cases_table(row) + [""]
    lines += ["## Checks", "", "That each case runs the path it is named for (two images, each thread setting):", ""]
    for c in report["checks"]:
        lines.append(f"- {threads_label(c['threads'])}: logits of (b) vs (a), max abs diff "
                     f"{c['logits_max_abs_diff']:.3g}; the fast path's outputs {c['fast_path_outputs']}, the relevance "
                     f"path's map {c['relevance_shape']}")
    return "\n".join(lines) + "\n"


def _preamble(report: dict) -> list[str]:
    env, m, s, a = report["environment"], report["model"], report["settings"], report["artifacts"]
    fast, new = a["fast_only"]["size_bytes"], a["with_relevance"]["size_bytes"]
    contended = env["other_cores_mean"] > 0.25
    return [
        "# `vitserve evaluate relevance-cost`: what the relevance path costs", "",
        f"`{report['command']}`, {env['date']}. Checkpoint `{m['checkpoint']}` ({m['name']} {m['version']}), timed at "
        f"{m['height']}x{m['width']}, {m['channels']} channel(s), patch {m['patch_size']}. {env['cpu']} "
        f"({env['cpus']} CPUs), Python {env['python']}, onnxruntime {env['onnxruntime']}. Load average at start "
        f"{env['loadavg_start']}, at end {env['loadavg_end']}; other processes used **{env['other_cores_mean']:.2f} "
        f"cores** on average while the cases ran ({'contended' if contended else 'quiet machine'}).", "",
        f"Artifacts, exported by this run ({'verified' if s['verified'] else 'not verified: export tests verify'}): "
        f"fast-only {fast / 2**20:.2f} MiB ({fast} bytes), with the relevance path {new / 2**20:.2f} MiB ({new} "
        f"bytes, {100 * (new / fast - 1):+.1f}%).", "",
        f"Sessions: the server's, `{s['session']}`. Cases, on the same normalised random images: (a) the fast-only "
        "artifact fed `pixel_values`, outputs logits and rollout; (b) the artifact with the relevance path fed only "
        "`pixel_values` (the fast branch of its `If`), logits and rollout; (c) the same artifact fed `target_class` "
        "= -1 for every image (explain the top-1), logits and relevance. Per thread setting and batch size, one "
        f"warm-up call each, then {s['rounds']} rounds in which every case runs for {s['seconds_per_case']} s (at "
        f"least {s['min_calls']} calls), the order reversed every other round. p50/p90 are over every timed call; "
        "a ratio is one case's p50 over the other's; beside it, the per-round ratios (the two cases' medians in the "
        "same round, paired against drift): their median and, in brackets, their smallest and largest.", "",
        f"Targets: (c)/(b) <= {RELEVANCE_TARGET:.1f}x; (b)/(a) unchanged, granted only when the per-round ratios "
        f"span 1.0 or all lie within 1.00 +- {UNCHANGED_BAND:.2f}.", ""]


def threads_label(threads: int) -> str:
    return "1 thread" if threads == 1 else ("threads: ONNX Runtime's default (one per core)" if threads == 0
                                            else f"{threads} threads")


def _ratio_text(ratio: dict, fmt: str) -> tuple[str, str]:
    spread = f"{ratio['round_median']:{fmt}} [{ratio['round_min']:{fmt}}, {ratio['round_max']:{fmt}}]"
    return format(ratio["ratio"], fmt) + "x", spread


def targets_table(rows: list[dict]) -> list[str]:
    body = []
    for row in rows:
        relevance, fast = row["ratios"]["relevance_path/fast_path"], row["ratios"]["fast_path/fast_only"]
        met = relevance["ratio"] <= RELEVANCE_TARGET
        body.append([str(row["threads"] or "default"), str(row["batch_size"]), *_ratio_text(relevance, ".2f"),
                     f"<= {RELEVANCE_TARGET:.1f}x", "**met**" if met else "**missed**", *_ratio_text(fast, ".3f"),
                     "unchanged", "**unchanged**" if unchanged(fast) else "**changed**"])
    return table(["threads", "batch", "(c)/(b)", "per round: median [min, max]", "target", "", "(b)/(a)",
                  "per round: median [min, max]", "target", ""],
                 body, text_columns=2)


def unresolved(rows: list[dict]) -> list[str]:
    """A caution for each (b)/(a) called unchanged only because its per-round ratios span 1.0 while the ratio of the
    medians lies outside 1 +- 3%: the rounds were too noisy to tell a change of that size."""
    lines = []
    for row in rows:
        ratio = row["ratios"]["fast_path/fast_only"]
        if unchanged(ratio) and abs(ratio["ratio"] - 1) > UNCHANGED_BAND:
            lines.append(f"- {threads_label(row['threads'])}, batch {row['batch_size']}: (b)/(a) is "
                         f"{ratio['ratio']:.3f}x (per-round median {ratio['round_median']:.3f}), outside 1.00 +- "
                         f"{UNCHANGED_BAND:.2f}; \"unchanged\" only because the per-round ratios "
                         f"[{ratio['round_min']:.3f}, {ratio['round_max']:.3f}] span 1.0: not resolved at this noise.")
    return ["Caution:", "", *lines, ""] if lines else []


def cases_table(row: dict) -> list[str]:
    c, r = row["cases"], row["ratios"]
    against = {"fast_path": ("(b)/(a)", r["fast_path/fast_only"], ".3f"),
               "relevance_path": ("(c)/(b)", r["relevance_path/fast_path"], ".2f")}
    body = []
    for case in CASES:
        label, ratio, fmt = against.get(case, ("", None, ""))
        figures = _ratio_text(ratio, fmt) if ratio else ("", "")
        body.append([CASE_LABELS[case], str(c[case]["calls"]), number(c[case]["p50_ms"], ".3f"),
                     number(c[case]["p90_ms"], ".3f"), number(c[case]["images_per_s"]), label, *figures])
    lines = table(["case", "calls", "p50 ms", "p90 ms", "images/s", "ratio", "of p50s",
                           "per round: median [min, max]"], body)
    return lines + ["", f"Other processes: {row['other_cores']:.2f} cores on average during these rounds."]


# ---------------------------------------------------------------------------------------------------- command


def _ints(text: str) -> list[int]:
    return [int(p) for p in text.split(",") if p.strip()]


def _size(text: str) -> tuple[int, int]:
    height, _, width = text.lower().partition("x")
    return int(height), int(width or height)


def add_relevance_cost_command(commands) -> None:
    """`vitserve evaluate relevance-cost`, onto the subparsers of `vitserve evaluate`."""
    p = commands.add_parser("relevance-cost", help="the relevance path's latency against the fast path's, and the "
                                                   "fast path's against a fast-only artifact's, side by side",
                            formatter_class=DefaultsHelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", default="models/vit-fmnist/checkpoint", help="checkpoint directory")
    source.add_argument("--variant", help="instead: random weights of a named variant (e.g. 'small' for ViT-S/16 "
                                          "at 224) or of a preset in export/presets.py (e.g. 'vit-s16')")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 32], help="comma-separated")
    p.add_argument("--threads", type=_ints, default=[1, 0],
                   help="intra-op thread settings, comma-separated: 1 as the server runs a light model, 0 for ONNX "
                        "Runtime's default (one per core)")
    p.add_argument("--rounds", type=int, default=7, help="rounds in which every case runs once")
    p.add_argument("--seconds", type=float, default=1.0, help="timed seconds per case per round")
    p.add_argument("--size", type=_size, help="H[xW] to time at (default: the trained size)")
    p.add_argument("--verify", action="store_true", help="verify both exports against PyTorch (slower)")
    p.add_argument("--work-dir", type=Path, default=Path("build/relevance-cost"), help="where the exports go")
    p.add_argument("--out", type=Path, default=Path("build/bench/relevance-cost.md"),
                   help="Markdown report; the JSON beside it, same stem")
    p.set_defaults(func=run_relevance_cost)


def run_relevance_cost(args) -> int:
    checkpoint = variant_checkpoint(args.variant, args.work_dir) if args.variant else args.checkpoint
    given = sys.argv[sys.argv.index("relevance-cost") + 1:] if "relevance-cost" in sys.argv else []
    command = shlex.join(["vitserve", "evaluate", "relevance-cost", *given])
    report = relevance_cost(checkpoint, args.batch_sizes, args.threads, args.rounds, args.seconds, args.size,
                            args.work_dir, verify=args.verify, command=command)
    for path in write_report(report, render_markdown(report), args.out):
        print(f"wrote {path}")
    return 0


def variant_checkpoint(name: str, work_dir: Path) -> Path:
    """A checkpoint with seeded random weights: a preset of export/presets.py by name, else a model.vit variant."""
    from vitserve.export.presets import PRESETS, RandomModel, random_checkpoint

    spec = PRESETS.get(name) or RandomModel(name, name=f"random-{name}")
    return random_checkpoint(spec, work_dir / f"{name.replace('/', '-')}-checkpoint")
