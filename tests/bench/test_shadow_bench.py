"""bench/shadow.py's arithmetic: each arm against the same round's no-shadow arm, the medians, the report; and
the configs it writes are ones the server accepts."""
from __future__ import annotations

import pytest

from vitserve.bench.shadow import Report, config_for, render, summary
from vitserve.service.repository.layout import ModelConfig


def arm(round_: int, clients: int, fraction: float, rate: float, p99: float, cpu: float, **copies) -> dict:
    return {"round": round_, "clients": clients, "fraction": fraction, "ok_per_s": rate, "p50_ms": p99 / 2,
            "p99_ms": p99, "non_2xx": 0, "engine_cpu_ms_per_answer": cpu, **copies}


def test_each_arm_is_compared_with_its_own_rounds_baseline_and_the_medians_are_taken():
    arms = [arm(1, 32, 0, 100, 10, 2), arm(1, 32, 0.1, 95, 11, 2.2, offered=10, compared=5),
            arm(2, 32, 0, 200, 20, 4), arm(2, 32, 0.1, 200, 20, 4, offered=10, compared=10),
            arm(3, 32, 0, 100, 10, 2), arm(3, 32, 0.1, 90, 12, 2.4, offered=10, compared=1)]
    row = summary(Report({}, arms=arms))[32, 0.1]
    assert row["throughput"] == pytest.approx(0.95) and row["p99"] == pytest.approx(1.1)
    assert row["cpu"] == pytest.approx(1.1) and row["compared_share"] == "50.0%"


def test_the_report_has_every_arm_and_the_agreement_table():
    report = Report({"primary": "a.onnx", "shadow": "b.onnx", "clients": "32", "seconds": "1", "rounds": "1",
                     "shadow_priority": "idle"}, "a CPU", [arm(1, 32, 0, 100, 10, 2), arm(1, 32, 1, 99, 10, 2)])
    report.agreement = {"answered_by": ["1"], "served": {"offered": 3, "compared": 3, "dropped": 0, "failed": 0,
                                                         "top1_agreement": 1.0, "mean_js_divergence": 0.01,
                                                         "mean_map_rank_correlation": 0.9, "shadow_latency_ms": {}},
                        "offline": {"top1_agreement": 1.0, "mean_js_divergence": 0.01,
                                    "mean_map_rank_correlation": 0.9},
                        "differences": {"top1_agreement": 0, "mean_js_divergence": 0, "mean_map_rank_correlation": 0}}
    text = render(report)
    assert "| 1 | 32 | 1 | 99.0 |" in text and "| 32 | 1 | 0.990x |" in text and "| top1_agreement | 1.000000 |" in text


def test_the_configs_it_writes_are_valid_model_configs():
    assert ModelConfig.model_validate(config_for(0)).shadow is None
    shadow = ModelConfig.model_validate(config_for(0.1, "low", max_queue_size=1000)).shadow
    assert (shadow.version, shadow.fraction, shadow.cpu_priority, shadow.max_queue_size) == (2, 0.1, "low", 1000)
