"""evaluation/ood.py's served check: how often the drift alert's condition would hold on in-distribution traffic,
with the alert's share read from the same place Prometheus reads it."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from vitserve.evaluation import ood

REPO = Path(__file__).resolve().parents[2]


def test_the_alert_share_is_the_prometheus_objective():
    rules = (REPO / "docker/prometheus/rules/objectives.rules.yml").read_text()
    objective = re.search(r"record: vitserve:ood_outside_ratio_objective\s+expr: vector\(([0-9.]+)\)", rules)
    assert objective and float(objective.group(1)) == ood.DRIFT_ALERT_SHARE
    minimum = re.search(r"record: vitserve:ood_alert_min_images\s+expr: vector\(([0-9]+)\)", rules)
    assert minimum and int(minimum.group(1)) == ood.DRIFT_ALERT_MIN_IMAGES


def test_windows_fire_as_the_share_above_the_threshold_says():
    threshold = 1.0
    quiet = np.r_[np.full(990, 0.5), np.full(10, 2.0)]  # 1% above: a window of 100 rarely passes 5%
    drifted = np.r_[np.full(800, 0.5), np.full(200, 2.0)]  # 20% above: nearly every window does
    lines = ood.alert_false_alarms({"quiet": quiet, "drifted": drifted}, threshold, seed=0, draws=2000)
    rows = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| quiet") or
            line.startswith("| drifted")}
    quiet_cells = [float(c.strip(" |%")) for c in rows["quiet"].split(" | ")[2:]]
    drifted_cells = [float(c.strip(" |%")) for c in rows["drifted"].split(" | ")[2:]]
    assert "1.00%" in rows["quiet"] and "20.00%" in rows["drifted"]
    assert quiet_cells[-1] == 0.0 and max(quiet_cells) < 5  # 1,000-image windows never; small ones seldom
    assert min(drifted_cells) > 90


def test_the_wilson_interval_holds_the_rate():
    low, high = ood.wilson_interval(27, 2500)
    assert low < 27 / 2500 < high and 0.007 < low and high < 0.016
