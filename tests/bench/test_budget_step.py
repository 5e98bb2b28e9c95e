"""bench/budget_step.py: the answers' budgets over time, from /metrics read every fraction of a second."""
from __future__ import annotations

import pytest

from vitserve.bench.budget_step import intervals


def sample(t: float, full: float, cheap: float) -> dict:
    """The counters at `t`: answers at 49 tokens (full budget) and at 25 (degraded by load)."""
    return {"t": t, "tokens": {"49": full, "25": cheap}, "reason": {"full": full, "load": cheap}}


def test_each_row_covers_the_window_before_it():
    samples = [sample(0.0, 0, 0), sample(0.5, 50, 0), sample(1.0, 100, 0), sample(1.5, 100, 100),
               sample(2.0, 100, 200)]
    rows = intervals(samples, window_s=1.0)
    assert [r["t"] for r in rows] == [1.0, 1.5, 2.0]  # the first full second
    assert rows[0] == {"t": 1.0, "answers_per_s": 100.0, "mean_tokens": 49.0, "degraded_share": 0.0}
    assert rows[1]["mean_tokens"] == pytest.approx((50 * 49 + 100 * 25) / 150)
    assert rows[2] == {"t": 2.0, "answers_per_s": 200.0, "mean_tokens": 25.0, "degraded_share": 1.0}


def test_a_window_without_answers_has_no_mean():
    rows = intervals([sample(0.0, 5, 0), sample(1.0, 5, 0)], window_s=1.0)
    assert rows == [{"t": 1.0, "answers_per_s": 0.0, "mean_tokens": None, "degraded_share": None}]
