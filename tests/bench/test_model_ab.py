"""bench/model_ab.py's report: every arm, and B's medians as ratios to the same round's A."""
from __future__ import annotations

from pathlib import Path

from vitserve.bench.model_ab import render


def row(round_: int, file: str, clients: int, rate: float, p50: float, p99: float, cpu: float = 5.0) -> dict:
    return {"round": round_, "file": file, "clients": clients, "ok_per_s": rate, "p50_ms": p50, "p99_ms": p99,
            "cpu_ms": cpu, "non_2xx": 0}


def test_b_is_compared_with_the_same_rounds_a_and_the_medians_are_taken():
    rows = [row(1, "A", 32, 100, 10, 20), row(1, "B", 32, 90, 11, 30, 6.0), row(2, "B", 32, 200, 20, 40),
            row(2, "A", 32, 200, 20, 40), row(3, "A", 32, 100, 10, 20, 4.0), row(3, "B", 32, 95, 12, 22)]
    text = render(Path("a.onnx"), Path("b.onnx"), rows, 3, 10)
    assert "| 32 | 0.950x | 1.100x | 1.100x | 1.200x |" in text
    assert text.count("| 32 | ") == 8  # six arms, the summary row and its intervals
    assert "| 32 | 0.900-1.000x |" in text  # answers/s ratios 0.9, 1.0, 0.95: the median of any resample within


def test_the_interval_of_a_median_holds_it_and_narrows_with_more_rounds():
    from vitserve.bench.model_ab import median_interval

    rng = [1.0 + 0.1 * ((i * 7) % 11 - 5) / 5 for i in range(40)]  # spread 0.9-1.1 around 1.0
    few, many = median_interval(rng[:6]), median_interval(rng)
    assert few[0] <= 1.0 <= few[1] and many[0] <= 1.0 <= many[1]
    assert many[1] - many[0] < few[1] - few[0]
    assert median_interval([1.2] * 5) == (1.2, 1.2)
