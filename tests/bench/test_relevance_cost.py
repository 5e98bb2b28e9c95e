"""bench/relevance_cost.py: the report's structure, its arithmetic and verdicts, its Markdown, and the command writing
Markdown and JSON. Tiny model, tiny durations; speed itself is the benchmark's to measure, never asserted here."""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys

import pytest

from vitserve.bench.relevance_cost import (CASES, RATIOS, add_relevance_cost_command, render_markdown, summarise,
                                  unchanged)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitserve evaluate")
    add_relevance_cost_command(parser.add_subparsers(dest="evaluate_command", required=True))
    return parser


@pytest.fixture(scope="module")
def cli_run(tiny_checkpoint, tmp_path_factory):
    """`relevance-cost` on the tiny checkpoint at batch 1 and 2, one thread, 2 rounds of 10 ms per case."""
    tmp = tmp_path_factory.mktemp("relevance-cost")
    out = tmp / "report" / "cost.md"
    argv = ["relevance-cost", "--checkpoint", str(tiny_checkpoint), "--batch-sizes", "1,2", "--threads", "1",
            "--rounds", "2", "--seconds", "0.01", "--work-dir", str(tmp / "work"), "--out", str(out)]
    args = _parser().parse_args(argv)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["vitserve", "evaluate", *argv])  # what the report quotes as its command
        assert args.func(args) == 0
    return out, json.loads(out.with_suffix(".json").read_text()), argv


def test_parser_defaults():
    args = _parser().parse_args(["relevance-cost"])
    assert (args.checkpoint, args.variant, args.batch_sizes, args.threads, args.rounds, args.size) == (
        "models/vit-fmnist/checkpoint", None, [1, 32], [1, 0], 7, None)
    assert str(args.out) == "build/bench/relevance-cost.md"  # never over a committed report unless asked
    assert _parser().parse_args(["relevance-cost", "--size", "48x32"]).size == (48, 32)
    with pytest.raises(SystemExit):
        _parser().parse_args(["relevance-cost", "--checkpoint", "x", "--variant", "small"])


def test_report_has_every_case_and_ratios_from_the_medians(cli_run):
    _, report, _ = cli_run
    assert [(r["threads"], r["batch_size"]) for r in report["rows"]] == [(1, 1), (1, 2)]
    for row in report["rows"]:
        assert sorted(row["cases"]) == sorted(CASES)
        for case in row["cases"].values():
            assert case["calls"] >= 2 * 3  # 2 rounds, at least 3 calls each
            assert len(case["round_p50_ms"]) == 2
            assert 0 < case["p50_ms"] <= case["p90_ms"]
            assert case["images_per_s"] > 0
        for name, (top, bottom) in RATIOS.items():
            ratio = row["ratios"][name]
            assert ratio["ratio"] == row["cases"][top]["p50_ms"] / row["cases"][bottom]["p50_ms"]
            per_round = [a / b for a, b in zip(row["cases"][top]["round_p50_ms"], row["cases"][bottom]["round_p50_ms"])]
            assert ratio["rounds"] == per_round
            assert (ratio["round_min"], ratio["round_max"]) == (min(per_round), max(per_round))
            assert ratio["round_median"] == statistics.median(per_round)


def test_report_artifacts_and_checks(cli_run):
    _, report, argv = cli_run
    fast, new = report["artifacts"]["fast_only"], report["artifacts"]["with_relevance"]
    assert 0 < fast["size_bytes"] < new["size_bytes"]
    assert report["model"] | {"checkpoint": None} == {
        "checkpoint": None, "name": "tiny-vit", "version": "7", "height": 32, "width": 32, "channels": 3,
        "patch_size": 8}
    assert report["checks"] == [{"threads": 1, "logits_max_abs_diff": report["checks"][0]["logits_max_abs_diff"],
                                 "fast_path_outputs": ["logits", "rollout", "embedding"], "relevance_shape": [2, 4, 4]}]
    assert report["checks"][0]["logits_max_abs_diff"] < 1e-5
    assert report["command"] == shlex.join(["vitserve", "evaluate", *argv])


def test_markdown_written_beside_the_json(cli_run):
    out, report, _ = cli_run
    text = out.read_text()
    assert text == render_markdown(report)
    assert "## 1 thread, batch 1" in text and "## 1 thread, batch 2" in text
    row = report["rows"][0]
    ratio = row["ratios"]["relevance_path/fast_path"]
    assert (f"| (c)/(b) | {ratio['ratio']:.2f}x | {ratio['round_median']:.2f} [{ratio['round_min']:.2f}, "
            f"{ratio['round_max']:.2f}] |") in text
    assert f"| (a) fast-only artifact | {row['cases']['fast_only']['calls']} | " in text
    assert f"({report['artifacts']['with_relevance']['size_bytes']} bytes" in text


def _row(fast_only: list[float], fast_path: list[float], relevance: list[float]) -> dict:
    """summarise() of per-round latencies in ms, three calls each round at the given value."""
    per_round = {case: [[v / 1000] * 3 for v in values]
                 for case, values in zip(CASES, (fast_only, fast_path, relevance))}
    return summarise(per_round, batch=4, threads=1, other_cores=0.0)


def test_summarise_arithmetic():
    row = _row([2.0, 4.0], [2.0, 4.4], [5.0, 10.0])
    assert row["cases"]["fast_only"]["round_p50_ms"] == pytest.approx([2.0, 4.0])
    assert row["cases"]["fast_only"]["p50_ms"] == pytest.approx(3.0)
    assert row["cases"]["fast_only"]["images_per_s"] == pytest.approx(4 * 6 / 0.018)
    ratio = row["ratios"]["fast_path/fast_only"]
    assert ratio["ratio"] == pytest.approx(3.2 / 3.0)
    assert (ratio["round_min"], ratio["round_median"], ratio["round_max"]) == pytest.approx((1.0, 1.05, 1.1))
    assert row["ratios"]["relevance_path/fast_path"]["ratio"] == pytest.approx(7.5 / 3.2)


@pytest.mark.parametrize("low, high, expected", [(0.9, 1.2, True), (1.0, 1.0, True), (1.01, 1.03, True),
                                                  (0.97, 0.99, True), (1.01, 1.031, False), (0.96, 0.99, False)])
def test_unchanged_criterion(low, high, expected):
    assert unchanged({"ratio": (low + high) / 2, "round_median": (low + high) / 2, "round_min": low,
                      "round_max": high}) is expected


def test_markdown_cautions_an_unchanged_that_rests_on_noise(cli_run):
    _, report, _ = cli_run
    rows = [_row([2.0, 2.0, 2.0], [1.9, 2.2, 2.2], [6.0, 6.0, 6.0]) | {"batch_size": 1},  # 1.1x, rounds span 1.0
            _row([2.0, 2.0], [2.02, 2.04], [6.0, 6.0]) | {"batch_size": 32}]  # 1.015x, within the band
    text = render_markdown({**report, "rows": rows})
    assert text.count("**unchanged**") == 2
    assert ("- 1 thread, batch 1: (b)/(a) is 1.100x (per-round median 1.100), outside 1.00 +- 0.03; \"unchanged\" "
            "only because the per-round ratios [0.950, 1.100] span 1.0: not resolved at this noise.") in text
    assert "batch 32: (b)/(a)" not in text
    assert "Caution:" not in render_markdown({**report, "rows": rows[1:]})


def test_markdown_verdicts(cli_run):
    _, report, _ = cli_run
    rows = [_row([2.0, 2.0], [2.2, 2.2], [6.0, 7.0]) | {"batch_size": 1},  # 10% slower, relevance 2.9x
            _row([2.0, 2.0], [1.98, 2.02], [8.0, 8.0]) | {"batch_size": 32}]  # unchanged, relevance 4x
    text = render_markdown({**report, "rows": rows})
    assert ("| 1 | 1 | 2.95x | 2.95 [2.73, 3.18] | <= 3.0x | **met** | 1.100x | 1.100 [1.100, 1.100] | unchanged | "
            "**changed** |") in text
    assert ("| 1 | 32 | 4.00x | 4.00 [3.96, 4.04] | <= 3.0x | **missed** | 1.000x | 1.000 [0.990, 1.010] | unchanged "
            "| **unchanged** |") in text
