"""bench/served_maps.py: the comparison of served maps with the evaluation's, and its report."""
from __future__ import annotations

import numpy as np
import pytest

from vitserve.bench.served_maps import compare, main, render


def test_differences_are_absolute_and_relative_to_each_images_largest_value():
    offline = {"rollout": np.ones((2, 2, 2)), "relevance": np.array([[[1.0, -2.0], [0.5, 0.0]],
                                                                     [[10.0, 3.0], [-1.0, 2.0]]])}
    served = {"rollout": offline["rollout"] + 1e-6, "relevance": offline["relevance"].copy()}
    served["relevance"][0, 0, 0] += 0.02  # image 0's largest |value| is 2: relative 0.01
    served["relevance"][1, 1, 1] += 0.05  # image 1's is 10: relative 0.005
    row = compare(served, offline)
    assert row["rollout"]["max_abs_diff"] == pytest.approx(1e-6)
    assert row["relevance"]["max_abs_diff"] == pytest.approx(0.05)
    assert row["relevance"]["max_rel_diff"] == pytest.approx(0.01)
    assert row["relevance"]["spearman"]["mean"] == pytest.approx(1.0)  # the order is unchanged


def test_the_report_names_each_plan_and_what_served_it():
    row = {"plan": "precision_hint=fp32", "card": {"provider": "CPUExecutionProvider", "precision": "fp32"},
           "rollout": {"max_abs_diff": 1.9e-8}, "relevance": {"max_abs_diff": 1.2e-6, "max_rel_diff": 1.7e-6,
                                                              "spearman": {"mean": 1.0}}}
    text = render([row], "python -m vitserve.bench.served_maps --images 3", 3, "a CPU")
    assert "| precision_hint=fp32 | CPUExecutionProvider, fp32 | 1.90e-08 | 1.20e-06 | 1.70e-06 | 1.000000 |" in text
    assert "`python -m vitserve.bench.served_maps --images 3`. 3 Fashion-MNIST" in text


def test_no_images_is_refused_before_any_work(capsys):
    with pytest.raises(SystemExit):
        main(["--images", "0"])
    assert "--images must be at least 1" in capsys.readouterr().err
