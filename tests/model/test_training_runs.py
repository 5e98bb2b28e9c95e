"""What git keeps of a training run (training/README.md): every run under training/, each with its checkpoint and
log; the optimiser state (train_state.pt, the largest file) only for the runs a Makefile target resumes."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def tracked(pattern: str) -> list[str]:
    return subprocess.run(["git", "ls-files", pattern], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.split()


def resumed_runs(makefile: str) -> set[str]:
    """The run folders the Makefile's *_RUN variables name (the targets that train with --resume)."""
    return set(re.findall(r"^\w+_RUN\s*:?=\s*(\S+)\s*$", makefile, flags=re.M))


def test_optimiser_states_belong_to_runs_a_target_resumes():
    states = {str(Path(p).parent) for p in tracked("*train_state.pt")}
    resumed = resumed_runs((REPO / "Makefile").read_text())
    assert states and states <= resumed, f"train_state.pt kept for runs nothing resumes: {states - resumed}"
    assert all(run.startswith("training/") for run in resumed)


def test_every_run_is_under_training_with_its_checkpoint_and_log():
    runs = {str(Path(p).parent) for p in tracked("*log.csv") if not p.startswith(("tests/", "models/"))}
    assert runs and all(run.startswith("training/") and run.count("/") == 1 for run in runs), runs
    for run in runs:
        assert {f"{run}/checkpoint/config.json", f"{run}/checkpoint/model.safetensors"} <= set(tracked(run)), run
    assert tracked("runs") == []


def test_the_rule_reads_the_makefile_s_runs():
    assert resumed_runs("TRAIN_RUN := training/a\nX := b\nHYBRID_RUN = training/c \n  FOO_RUN := d\n") == {
        "training/a", "training/c"}
