"""`vitserve bench`: flags onto `bench.config.BenchConfig`, whose field defaults are the only defaults (a flag
left out keeps its field's default, or `--quick`'s). Only the standard library, bench.config and bench.presets
load here, since `vitserve` imports this module for every command; the measuring modules load when one runs.
"""
from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import fields
from pathlib import Path

from bench.config import INPUT_KINDS, QUICK, BenchConfig
from bench.presets import PRESETS


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _csv(values: list) -> str:
    return ",".join(map(str, values))


def _setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (a Settings field), got {text!r}")
    return name.strip().lower().removeprefix("vitserve_"), value


def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="raw ONNX Runtime vs served throughput and latency, in one run",
        description="Measures the raw ONNX Runtime session, then a real `vitserve serve` process under closed-loop "
                    "load (batching on and off, pre-sized PNGs and 640x480 JPEGs), and for fast models a bare "
                    "FastAPI endpoint; writes a Markdown table, its JSON and a latency/throughput plot.")
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
    p.set_defaults(func=run_bench_command)


def _add_timing_and_paths(p: argparse.ArgumentParser, d: BenchConfig) -> None:
    seconds = {"type": float, "metavar": "SECONDS"}
    p.add_argument("--duration", dest="duration_s", **seconds, help=f"measured per served level (default "
                                                                    f"{d.duration_s:g})")
    p.add_argument("--warmup", dest="warmup_s", **seconds, help=f"discarded before each served level (default "
                                                                f"{d.warmup_s:g})")
    p.add_argument("--raw-duration", dest="raw_duration_s", **seconds, help=f"per raw batch size (default "
                                                                            f"{d.raw_duration_s:g})")
    p.add_argument("--time-limit", dest="time_limit_s", **seconds, help=f"the whole run; later levels skip (default "
                                                                        f"{d.time_limit_s:g})")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: raw batch sizes {_csv(QUICK['batch_sizes'])}; "
                        f"{' and '.join(map(str, QUICK['concurrency']))} clients; {QUICK['duration_s']:g} s levels "
                        f"(flags given still win)")
    p.add_argument("--cache-dir", type=Path, metavar="DIR", help=f"where preset models are exported (default "
                                                                 f"{d.cache_dir})")
    p.add_argument("--log-dir", type=Path, metavar="DIR", help=f"the servers' logs (default {d.log_dir})")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """BenchConfig's defaults, then --quick's, then the flags given."""
    given = {f.name: getattr(args, f.name) for f in fields(BenchConfig) if getattr(args, f.name, None) is not None}
    cfg = BenchConfig(**{**(copy.deepcopy(QUICK) if args.quick else {}), **given})
    bad = set(cfg.inputs) - set(INPUT_KINDS)
    if bad:
        raise SystemExit(f"vitserve bench: unknown --inputs {sorted(bad)}; use png and/or jpeg")
    return cfg


def run_bench_command(args: argparse.Namespace) -> int:
    from bench.report import targets_lines, write_report
    from bench.run import run_bench

    cfg = config_from_args(args)
    report = run_bench(cfg, dict(args.settings), command="vitserve bench " + " ".join(sys.argv[2:]))
    for path in write_report(report, cfg.out):
        print(f"wrote {path}")
    print("\n".join(targets_lines(report["targets"])))
    return 0
