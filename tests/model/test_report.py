"""The training report renders what the run recorded: last-epoch accuracy, status, wall time, throughput."""
from __future__ import annotations

import csv
import json
import shutil

from vitserve.model.report import main, render_report
from vitserve.model.train import TrainLog


def _fake_run(tmp_path, tiny_checkpoint, epochs_planned: int):
    run = tmp_path / "run"
    shutil.copytree(tiny_checkpoint, run / "checkpoint")
    config = json.loads((run / "checkpoint" / "config.json").read_text())
    config["training"] = {"epochs": epochs_planned, "batch_size": 8, "parameters": 1234, "data": "fashion-mnist",
                          "command": "/x/.venv/bin/vitserve train --epochs 3", "machine": "test box", "torch": "2"}
    (run / "checkpoint" / "config.json").write_text(json.dumps(config))
    with (run / "log.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=TrainLog.FIELDS)
        writer.writeheader()
        for epoch, (acc, rate) in enumerate([(0.5, 100.0), (0.75, 300.0), (0.8125, 200.0)], start=1):
            writer.writerow({"epoch": epoch, "step": 10 * epoch, "lr": 1e-3, "train_loss": 1.0, "train_acc": 0.5,
                             "test_loss": 0.25, "test_acc": acc, "images_per_s": rate, "elapsed_s": 3725.0 * epoch / 3})
    return run


def test_report_states_last_epoch_accuracy_and_progress(tmp_path, tiny_checkpoint):
    text = render_report(_fake_run(tmp_path, tiny_checkpoint, epochs_planned=5))
    assert "**Test accuracy: 81.25%** on the 10,000 Fashion-MNIST held-out test images" in text
    assert "in progress: 3 of 5 epochs" in text
    assert "Wall time: 1 h 02 min" in text
    assert "median 200 training images/s (range 100-300)" in text
    assert "Command: `vitserve train --epochs 3`" in text
    assert text.count("\n| ") == 4  # header, epochs 1 and 3 (first and last); 2 is neither first, last nor a 5th


def test_report_names_the_machine_the_run_recorded_not_the_one_writing_it(tmp_path, tiny_checkpoint):
    run = _fake_run(tmp_path, tiny_checkpoint, epochs_planned=3)
    assert "- Machine: test box; CPU not recorded; torch 2\n" in render_report(run)  # a run from before it was recorded
    config = json.loads((run / "checkpoint" / "config.json").read_text())
    config["training"]["cpu"] = "Training CPU 9000"
    (run / "checkpoint" / "config.json").write_text(json.dumps(config))
    assert "- Machine: test box; Training CPU 9000; torch 2\n" in render_report(run)


def test_report_cli_writes_finished_report(tmp_path, tiny_checkpoint):
    run = _fake_run(tmp_path, tiny_checkpoint, epochs_planned=3)
    assert main([str(run)]) == 0
    assert "Status: finished" in (run / "REPORT.md").read_text()
