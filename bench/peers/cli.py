"""`python -m vitserve.bench.peers` flags onto `PeersConfig` (a flag left out keeps the field's default, or
`--quick`'s), and `vitserve bench --mode peers`, which takes the bench command's shared flags (--model, --out,
--concurrency, --duration, --warmup, --rounds, --time-limit, --quick, --cache-dir, --log-dir) onto the same object."""
from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import fields
from pathlib import Path

from vitserve.bench.peers.config import KNOWN_SERVERS, QUICK, SERVERS, PeersConfig
from vitserve.bench.report import command_line


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    d = PeersConfig()
    p = argparse.ArgumentParser(prog="python -m vitserve.bench.peers", description=(
        "vitserve side by side with Triton Inference Server (nvidia-pytriton) and LitServe: same model, same "
        "per-image work, same bodies, Debian's wrk, alternating rounds. Writes Markdown and JSON."))
    p.add_argument("--models", type=_names, metavar="M,M", help=f"ONNX artifacts or presets (default "
                                                                f"{','.join(d.models)})")
    p.add_argument("--servers", type=_names, metavar="S,S", help=f"some of {','.join(KNOWN_SERVERS)} (default: "
                                                                f"{','.join(SERVERS)})")
    p.add_argument("--out", type=Path, metavar="REPORT.md", help=f"default {d.out}; `make bench-peers` writes docs/")
    p.add_argument("--rounds", type=int, metavar="N", help=f"default {d.rounds}")
    p.add_argument("--concurrency", type=_ints, metavar="N,N", help=f"wrk connections (default "
                                                                    f"{','.join(map(str, d.concurrency))})")
    p.add_argument("--duration", dest="duration_s", type=int, metavar="SECONDS", help=f"per level (default "
                                                                                      f"{d.duration_s})")
    p.add_argument("--warmup", dest="warmup_s", type=int, metavar="SECONDS", help=f"default {d.warmup_s}")
    p.add_argument("--time-limit", dest="time_limit_s", type=float, metavar="SECONDS",
                   help=f"the whole run; later levels are skipped (default {d.time_limit_s:g})")
    p.add_argument("--vitserve-commit", metavar="REV", help="serve vitserve from this commit, exported with git "
                                                            "archive (default: this working tree)")
    p.add_argument("--baseline-commit", metavar="REV", help="what the server vitserve-base serves (--servers "
                                                            "vitserve,vitserve-base,...): a change's before, "
                                                            "alternated with its after in one run")
    p.add_argument("--venv-python", metavar="PYTHON", help="interpreter the peers' venvs are made from (default: "
                                                           "this Python's base interpreter)")
    p.add_argument("--quick", action="store_true", help="a smoke run: the default model, 1 round, 1 and 8 "
                                                        "connections, 2 s levels (flags given still win)")
    p.add_argument("--render", type=Path, metavar="REPORT.json", help="measure nothing: write --out's Markdown "
                                                                      "again from a run's JSON")
    p.add_argument("--cache-dir", type=Path, metavar="DIR", help=f"preset models (default {d.cache_dir})")
    p.add_argument("--log-dir", type=Path, metavar="DIR", help=f"the servers' logs (default {d.log_dir})")
    return p


def config_from(given: dict, quick: bool) -> PeersConfig:
    """PeersConfig's defaults, then --quick's, then the values given (None: not given)."""
    names = {f.name for f in fields(PeersConfig)}
    cfg = PeersConfig(**{**(copy.deepcopy(QUICK) if quick else {}),
                         **{k: v for k, v in given.items() if k in names and v is not None}})
    unknown = set(cfg.servers) - set(KNOWN_SERVERS)
    if unknown or not cfg.servers:
        raise SystemExit(f"bench peers: unknown servers {sorted(unknown)}; use some of {', '.join(KNOWN_SERVERS)}")
    return cfg


_BENCH_SHARED = ("out", "concurrency", "duration_s", "warmup_s", "rounds", "time_limit_s", "cache_dir", "log_dir")


def config_from_bench_args(args: argparse.Namespace) -> PeersConfig:
    """`vitserve bench --mode peers`: the shared flags; `--duration`/`--warmup` in whole seconds; other modes'
    flags are refused."""
    from vitserve.bench.config import OIP_ONLY, THROUGHPUT_ONLY
    from vitserve.bench.reliability import ReliabilityConfig

    others = {*THROUGHPUT_ONLY, *OIP_ONLY, *(f.name for f in fields(ReliabilityConfig))} - {*_BENCH_SHARED, "mode",
                                                                                              "model"}
    stray = sorted(n for n in others if getattr(args, n, None) is not None)
    if stray or getattr(args, "settings", None):
        raise SystemExit(f"vitserve bench: --mode peers does not use {', '.join(stray or ['--set'])}")
    given = {n: getattr(args, n, None) for n in _BENCH_SHARED}
    for n in ("duration_s", "warmup_s"):
        seconds = given[n]
        if seconds is not None:
            given[n] = max(1, round(seconds))
    if getattr(args, "model", None):
        given["models"] = [args.model]
    return config_from(given, args.quick)


def run(cfg: PeersConfig, command: str) -> int:
    from vitserve.bench.peers.report import render
    from vitserve.bench.peers.run import run_peers
    from vitserve.bench.reliability import write_report

    report = run_peers(cfg, command)
    # the measurements first: a report that fails to render must not lose the run (--render writes it again)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    for path in write_report(report, render(report), cfg.out):
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    cfg = config_from(vars(args), args.quick)
    if args.render:
        from vitserve.bench.peers.report import render

        cfg.out.write_text(render(json.loads(args.render.read_text())))
        print(f"wrote {cfg.out}")
        return 0
    return run(cfg, command_line("python -m vitserve.bench.peers", argv))
