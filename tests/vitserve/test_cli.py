"""The `vitserve` command's error contract: one line on stderr and exit 1, the traceback only with --debug."""
from __future__ import annotations

import pytest

from vitserve.cli import main


def test_an_error_is_one_line_and_exit_1(tmp_path, capsys):
    assert main(["export", str(tmp_path / "absent"), "--out", str(tmp_path / "m.onnx")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"vitserve export: {tmp_path / 'absent'}/config.json not found")
    assert err.rstrip().endswith("(--debug shows the traceback)")


@pytest.mark.parametrize("argv, said", [
    (["train", "--distill-weight", "x"], "vitserve train: error: argument --distill-weight: invalid float value"),
    (["train", "--epochs", "x"], "vitserve train: error: argument --epochs: invalid int value"),
    (["export", "ckpt", "--opset", "x"], "vitserve export: error: argument --opset: invalid int value"),
    (["train", "--no-such-flag"], "vitserve: error: unrecognized arguments: --no-such-flag")])
def test_a_wrong_flag_is_one_line_and_exit_2(argv, said, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(said) and err.rstrip().endswith("(--help lists the options)")


def test_debug_anywhere_shows_the_traceback(tmp_path):
    from vitserve.model.checkpoint import CheckpointError

    for argv in (["--debug", "export", str(tmp_path), "--out", "m.onnx"],
                 ["export", str(tmp_path), "--out", "m.onnx", "--debug"]):
        with pytest.raises(CheckpointError):
            main(argv)


def test_a_missing_training_tool_names_the_install(monkeypatch, capsys):
    import vitserve.export.cli

    def needs_torch(args):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(vitserve.export.cli, "run_export", needs_torch)
    assert main(["export", "ckpt", "--out", "m.onnx"]) == 1
    err = capsys.readouterr().err
    assert "needs torch, part of the training and export tools" in err and "make setup-dev" in err


def test_an_interrupt_is_exit_130_without_a_traceback(monkeypatch, capsys):
    import vitserve.export.cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(vitserve.export.cli, "run_export", interrupted)
    assert main(["export", "ckpt", "--out", "m.onnx"]) == 130
    assert capsys.readouterr().err == "vitserve export: interrupted\n"


@pytest.mark.parametrize("command, runner", [  # as docs/results.md, docs/explanations.md, docs/results/bench-relevance.md
    ("evaluate accuracy models/vit-fmnist/model.onnx --sizes 28,20,24,36,44,56", "vitserve.evaluation.cli.run_accuracy"),
    ("evaluate calibration models/vit-fmnist/model.onnx --eval /usr/share/datasets/fashion-mnist "
     "--out docs/calibration.md", "vitserve.evaluation.cli.run_calibration"),
    ("evaluate bench --variant small --batch-sizes 1,32 --threads 2 --seconds 2", "vitserve.bench.cli.run_evaluate_bench"),
    ("evaluate explanations models/vit-fmnist/checkpoint --data-dir /usr/share/datasets/fashion-mnist --limit 1000 "
     "--batch-size 64 --seed 0 --blur-sigma 3.0 --threads 1 --out docs/explanations.md",
     "vitserve.evaluation.explanations.run_explanations"),
    ("evaluate relevance-cost --checkpoint models/vit-fmnist/checkpoint --batch-sizes 1,32 --threads 1,0 --rounds 9 "
     "--seconds 1.0 --out docs/results/bench-relevance.md", "vitserve.bench.relevance_cost.run_relevance_cost")])
def test_the_documented_evaluate_commands_reach_their_runners(command, runner):
    """`vitserve evaluate` gathers evaluation/'s subcommands and bench/'s: each documented line still parses."""
    from vitserve.cli import build_parser

    args = build_parser().parse_args(command.split())
    assert f"{args.func.__module__}.{args.func.__name__}" == runner
