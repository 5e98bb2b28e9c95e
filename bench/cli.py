"""`vitserve bench`: flags onto `bench.config.BenchConfig`, whose field defaults are the only defaults (a flag
left out keeps its field's default, or `--quick`'s). `--mode overload|hol|soak` runs a reliability mode instead,
its flags onto `bench.reliability.ReliabilityConfig` the same way, and `--mode oip` onto `bench.oip.OipConfig`.
Also the benchmarks among `vitserve evaluate`'s subcommands: `bench` (ONNX Runtime against PyTorch eager,
bench/raw.py) and `relevance-cost` (bench/relevance_cost.py); vitserve/cli.py puts them beside the evaluation
research's. Only the standard library, bench.config, bench.presets, bench.reliability and bench.relevance_cost's
parser (with numpy, through bench.measure) load here, since `vitserve` imports this module for every command; the
measuring modules (bench.oip among them) load when one runs.
"""
from __future__ import annotations

import argparse
import copy
import shlex
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from vitserve.bench.config import INPUT_KINDS, OIP_ONLY, QUICK, THROUGHPUT_ONLY, BenchConfig
from vitserve.bench.presets import PRESETS
from vitserve.bench.relevance_cost import add_relevance_cost_command  # noqa: F401 (vitserve/cli.py's _COMMANDS names it here)
from vitserve.bench.reliability import ARMS, FULL_BUDGET_ARM, MODES, ReliabilityConfig, arms_under_test, parse_cpu_list
from vitserve.help_format import DefaultsHelpFormatter


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _cpu_list(text: str) -> tuple[int, ...]:
    try:
        return parse_cpu_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _csv(values: list) -> str:
    return ",".join(map(str, values))


def _settings_text(settings: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in settings.items())


def _setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (a Settings field), got {text!r}")
    return name.strip().lower().removeprefix("vitserve_"), value


def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="raw ONNX Runtime vs served throughput and latency, in one run; or overload, head-of-line, "
                      "soak (--mode)",
        description="Measures the raw ONNX Runtime session, then a real `vitserve serve` process under closed-loop "
                    "load (batching on and off, pre-sized PNGs and 640x480 JPEGs), and for fast models a bare "
                    "FastAPI endpoint; writes a Markdown table, its JSON and a latency/throughput plot. "
                    "--mode overload|hol|soak measures how the server holds up instead (docs/reliability.md).")
    p.add_argument("--mode", choices=("throughput", *MODES, "oip", "peers"), default="throughput",
                   help="throughput (default): raw vs served; overload: an open loop at twice the measured "
                        "saturation (--overload-factor; --arms refuse,degrade: refusing against degrading); hol: "
                        "small requests while heavy ones run, and memory; soak: mixed traffic for minutes, memory "
                        "and file descriptors; oip: the Open Inference Protocol's request "
                        "encodings (JSON, binary tensors, the PNG as BYTES) and /v1/classify, side by side; peers: "
                        "side by side with Triton and LitServe under wrk (bench/peers/cli.py, "
                        "docs/results/bench-peers.md)")
    d = BenchConfig()  # for the help text only: a flag not given stays None, and the field's default holds
    p.add_argument("--model", metavar="MODEL", help=f"an ONNX artifact, or a preset made on first use with random "
                                                    f"weights (needs torch): {', '.join(PRESETS)} (default {d.model})")
    p.add_argument("--out", type=Path, metavar="REPORT.md",
                   help=f"Markdown report; .json and .png beside it (default {d.out}; `make bench` writes docs/)")
    p.add_argument("--batch-sizes", type=_ints, metavar="N,N", help=f"raw session batch sizes (default "
                                                                    f"{_csv(d.batch_sizes)})")
    p.add_argument("--concurrency", type=_ints, metavar="N,N", help=f"served closed-loop client counts (default "
                                                                    f"{_csv(d.concurrency)})")
    p.add_argument("--inputs", type=lambda t: t.split(","), metavar="KIND,KIND",
                   help=f"png and/or jpeg (default {_csv(d.inputs)})")
    p.add_argument("--max-batch-size", type=int, metavar="N", help="batching on (off is 1); default: the server's")
    p.add_argument("--max-queue-delay-ms", type=float, metavar="MS", help="default: the server's")
    p.add_argument("--pairs", type=int, metavar="N", help=f"paired one-client measurements per server: a raw batch-1 "
                                                          f"call, then a served request, in turn (default {d.pairs}; "
                                                          f"0 = none)")
    p.add_argument("--bare", choices=("auto", "on", "off"), help=f"bare constant endpoint; auto = when raw batch-1 "
                                                                 f"latency is under {d.bare_threshold_ms:g} ms "
                                                                 f"(HTTP-bound) (default {d.bare})")
    p.add_argument("--set", dest="settings", type=_setting, action="append", default=[], metavar="NAME=VALUE",
                   help="a server setting under test, e.g. --set intra_op_spinning=false (also for the raw session)")
    _add_timing_and_paths(p, d)
    _add_reliability_flags(p.add_argument_group("overload, hol and soak (--mode); --model, --out, --set, "
                                                "--cache-dir and --log-dir apply too"))
    g = p.add_argument_group(
        "oip (--mode oip)", "--model, --out, --concurrency, --duration, --warmup, --time-limit, --quick, --rounds, "
                            "--serve-flags, --set, --cache-dir and --log-dir apply, with this mode's own defaults "
                            "(bench/oip.py: OipConfig): 1, 8 and 32 clients, 3 rounds, 3 s windows, "
                            "build/bench/oip.md")
    g.add_argument("--encodings", type=lambda t: t.split(","), metavar="NAME,NAME",
                   help="any of json, binary, image, classify (default: all four)")
    p.set_defaults(func=run_bench_command)


def _add_timing_and_paths(p: argparse.ArgumentParser, d: BenchConfig) -> None:
    seconds: dict[str, Any] = {"type": float, "metavar": "SECONDS"}
    p.add_argument("--duration", dest="duration_s", **seconds, help=f"measured per served level (default "
                                                                    f"{d.duration_s:g})")
    p.add_argument("--warmup", dest="warmup_s", **seconds, help=f"discarded before each served level (default "
                                                                f"{d.warmup_s:g})")
    p.add_argument("--raw-duration", dest="raw_duration_s", **seconds, help=f"per raw batch size (default "
                                                                            f"{d.raw_duration_s:g})")
    p.add_argument("--time-limit", dest="time_limit_s", **seconds, help=f"the whole run; later levels skip (default "
                                                                        f"{d.time_limit_s:g})")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: raw batch sizes {_csv(QUICK['batch_sizes'])} and the server's max batch size; "
                        f"{' and '.join(map(str, QUICK['concurrency']))} clients; {QUICK['duration_s']:g} s levels "
                        f"(flags given still win)")
    p.add_argument("--cache-dir", type=Path, metavar="DIR", help=f"where preset models are exported (default "
                                                                 f"{d.cache_dir})")
    p.add_argument("--log-dir", type=Path, metavar="DIR", help=f"the servers' logs (default {d.log_dir})")


def _shape(text: str) -> tuple[int, int, int]:
    values = tuple(int(v) for v in text.lower().split("x"))
    if len(values) != 3 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected BATCHxHEIGHTxWIDTH, e.g. 32x128x128, got {text!r}")
    return values


def _add_reliability_flags(g: argparse._ArgumentGroup) -> None:
    d = ReliabilityConfig()
    s: dict[str, Any] = {"type": float, "metavar": "SECONDS"}
    g.add_argument("--checkout", dest="checkouts", type=Path, action="append", metavar="DIR",
                   help="serve with the code in DIR (its .venv's python if it has one, else this one, with "
                        "PYTHONPATH=DIR); given twice, the two alternate round by round (default: this code)")
    g.add_argument("--arms", type=lambda t: [a.strip() for a in t.split(",") if a.strip()], metavar="ARM,ARM",
                   help=f"this code under different settings, alternated round by round like two checkouts (not "
                        f"with --checkout): {', '.join(f'{a} ({_settings_text(s)})' for a, s in ARMS.items())}; "
                        f"overload measures saturation once, on {FULL_BUDGET_ARM}")
    g.add_argument("--serve-flags", dest="server_args", type=shlex.split, metavar="'--FLAG VALUE ...'",
                   help="extra `vitserve serve` flags for every server, e.g. '--max-queue-size 64'")
    g.add_argument("--rounds", type=int, metavar="N", help=f"overload and hol runs per server (default {d.rounds})")
    g.add_argument("--server-cpus", type=_cpu_list, metavar="LIST", help="the cores the servers run on, as taskset "
                                                                         "lists them: 0, 0,2, 0-3 (default: every "
                                                                         "core, shared with the load)")
    g.add_argument("--client-cpus", type=_cpu_list, metavar="LIST", help="the cores this process, the load "
                                                                         "generator, runs on (default: every core)")
    g.add_argument("--rate", type=float, metavar="REQ/S", help="overload: the open loop's rate (default: "
                                                               "--overload-factor x the measured saturation)")
    g.add_argument("--overload-factor", dest="overload_factors", type=_floats, metavar="X,X",
                   help=f"open-loop rates as multiples of the saturation, each its own section of the report, e.g. "
                        f"2,4 (default {','.join(f'{x:g}' for x in d.overload_factors)})")
    g.add_argument("--saturation-clients", type=_ints, metavar="N,N", help=f"closed-loop levels measuring "
                                                                           f"saturation; the best counts (default "
                                                                           f"{_csv(d.saturation_clients)})")
    g.add_argument("--saturation-duration", dest="saturation_s", **s, help=f"default {d.saturation_s:g}")
    g.add_argument("--overload-duration", dest="overload_s", **s, help=f"measured open loop (default "
                                                                       f"{d.overload_s:g})")
    g.add_argument("--overload-warmup", dest="overload_warmup_s", **s, help=f"open loop before the window "
                                                                            f"(default {d.overload_warmup_s:g})")
    g.add_argument("--probes", type=int, metavar="N", help=f"requests one at a time after the load stops "
                                                           f"(default {d.probes})")
    g.add_argument("--hol-rate", type=float, metavar="REQ/S", help="small requests per second (default: 20, or "
                                                                   "half the one-at-a-time rate when that is lower)")
    g.add_argument("--hol-repeats", type=int, metavar="N", help=f"heavy pairs (default {d.hol_repeats})")
    g.add_argument("--hol-png-side", type=int, metavar="PIXELS", help=f"the heavy greyscale PNG's side (default "
                                                                      f"{d.hol_png_side})")
    g.add_argument("--hol-oip-shape", type=_shape, metavar="BxHxW", help="the heavy Open Inference request, "
                                                                         "channels the model's (default "
                                                                         f"{'x'.join(map(str, d.hol_oip_shape))})")
    g.add_argument("--memory-limit-mb", type=float, metavar="MB", help=f"default {d.memory_limit_mb:g}")
    g.add_argument("--soak-minutes", type=float, metavar="MINUTES", help=f"default {d.soak_minutes:g}")
    g.add_argument("--soak-load", type=float, metavar="X", help=f"soak rate as a fraction of the mix's saturation "
                                                                f"(default {d.soak_load:g})")
    g.add_argument("--soak-rate", type=float, metavar="REQ/S", help="the soak's rate (default: --soak-load x "
                                                                    "saturation)")
    g.add_argument("--sample-every", dest="sample_s", **s, help=f"soak: memory and descriptors read this often "
                                                                f"(default {d.sample_s:g})")


_SHARED = ("model", "out", "cache_dir", "log_dir")


def _given(args: argparse.Namespace, names) -> list[str]:
    return [n for n in names if getattr(args, n, None) is not None]


def reliability_config_from_args(args: argparse.Namespace) -> ReliabilityConfig:
    """ReliabilityConfig's defaults, then the flags given; flags of the throughput mode are refused."""
    stray = _given(args, THROUGHPUT_ONLY + OIP_ONLY) + (["quick"] if args.quick else [])
    if stray:
        raise SystemExit(f"vitserve bench: --mode {args.mode} does not use {', '.join(stray)}")
    given = {f.name: getattr(args, f.name) for f in fields(ReliabilityConfig)
             if getattr(args, f.name, None) is not None}
    cfg = ReliabilityConfig(**{**given, "mode": args.mode})
    if cfg.arms:  # before a preset model is exported, which can take minutes
        arms_under_test(cfg, dict(args.settings))
    return cfg


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """BenchConfig's defaults, then --quick's, then the flags given."""
    given = {f.name: getattr(args, f.name) for f in fields(BenchConfig) if getattr(args, f.name, None) is not None}
    stray = _given(args, [f.name for f in fields(ReliabilityConfig) if f.name not in _SHARED + ("mode",)])
    if stray:
        raise SystemExit(f"vitserve bench: {', '.join(stray)} belong to --mode overload, hol or soak")
    if _given(args, OIP_ONLY):
        raise SystemExit("vitserve bench: encodings belong to --mode oip")
    cfg = BenchConfig(**{**(copy.deepcopy(QUICK) if args.quick else {}), **given})
    bad = set(cfg.inputs) - set(INPUT_KINDS)
    if bad:
        raise SystemExit(f"vitserve bench: unknown --inputs {sorted(bad)}; use png and/or jpeg")
    return cfg


def oip_config_from_args(args: argparse.Namespace):
    """bench.oip.OipConfig's defaults, then its --quick's, then the flags given; other modes' flags are refused."""
    from vitserve.bench.oip import ENCODINGS, OIP_QUICK, OipConfig

    names = {f.name for f in fields(OipConfig)}
    others = [*THROUGHPUT_ONLY, *(f.name for f in fields(ReliabilityConfig) if f.name != "mode")]
    stray = _given(args, [n for n in others if n not in names])
    if stray:
        raise SystemExit(f"vitserve bench: --mode oip does not use {', '.join(stray)}")
    given = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    cfg = OipConfig(**{**(copy.deepcopy(OIP_QUICK) if args.quick else {}), **given})
    bad = [e for e in cfg.encodings if e not in ENCODINGS]
    if bad or not cfg.encodings:
        raise SystemExit(f"vitserve bench: unknown --encodings {bad}; use some of {', '.join(ENCODINGS)}")
    return cfg


def run_bench_command(args: argparse.Namespace) -> int:
    if args.mode == "peers":
        from vitserve.bench.peers.cli import config_from_bench_args, run
        return run(config_from_bench_args(args), shlex.join(["vitserve", "bench", *sys.argv[2:]]))
    if args.mode == "oip":
        return run_oip_command(args)
    if args.mode != "throughput":
        return run_reliability_command(args)
    from vitserve.bench.report import targets_lines, write_report
    from vitserve.bench.run import run_bench

    cfg = config_from_args(args)
    report = run_bench(cfg, dict(args.settings), command="vitserve bench " + " ".join(sys.argv[2:]))
    for path in write_report(report, cfg.out):
        print(f"wrote {path}")
    print("\n".join(targets_lines(report["targets"])))
    return 0


def run_reliability_command(args: argparse.Namespace) -> int:
    from vitserve.bench import overload, soak
    from vitserve.bench.reliability import write_report

    cfg = reliability_config_from_args(args)
    run, render = {"overload": (overload.run_overload, overload.render_overload),
                   "hol": (soak.run_head_of_line, soak.render_head_of_line),
                   "soak": (soak.run_soak, soak.render_soak)}[cfg.mode]
    report = run(cfg, dict(args.settings), command=shlex.join(["vitserve", "bench", *sys.argv[2:]]))
    for path in write_report(report, render(report), cfg.report_path):
        print(f"wrote {path}")
    for r in report["runs"]:
        print("\n".join(overload.target_lines(r.get("targets", []))))
    print("\n".join(overload.arm_target_lines(report)))
    return 0


def run_oip_command(args: argparse.Namespace) -> int:
    from vitserve.bench.oip import render_oip, run_oip, summary_lines
    from vitserve.bench.reliability import write_report

    cfg = oip_config_from_args(args)
    report = run_oip(cfg, dict(args.settings), command=shlex.join(["vitserve", "bench", *sys.argv[2:]]))
    for path in write_report(report, render_oip(report), cfg.out):
        print(f"wrote {path}")
    print("\n".join(summary_lines(report)))
    return 0


def add_evaluate_bench_parser(commands) -> None:
    """`vitserve evaluate bench`, onto the subparsers of `vitserve evaluate`."""
    p = commands.add_parser("bench", help="images/s: ONNX Runtime vs PyTorch eager, with and without rollout",
                            formatter_class=DefaultsHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="checkpoint directory")
    source.add_argument("--variant", help="random weights of a named variant, e.g. 'small' for ViT-S/16 at 224")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 32])
    p.add_argument("--threads", type=int, help="threads for both runtimes (default: torch's)")
    p.add_argument("--seconds", type=float, default=3.0, help="minimum timed seconds per case")
    p.set_defaults(func=run_evaluate_bench)


def run_evaluate_bench(args: argparse.Namespace) -> int:
    """ONNX Runtime against PyTorch eager (bench/raw.py's `benchmark`), one JSON line per case."""
    import json

    from vitserve.bench.raw import benchmark, variant_model

    if args.checkpoint:
        from vitserve.model.checkpoint import load_checkpoint

        vit, _ = load_checkpoint(args.checkpoint)
    else:
        vit = variant_model(args.variant)
    for row in benchmark(vit, args.batch_sizes, threads=args.threads, min_seconds=args.seconds):
        print(json.dumps(row))
    return 0
