"""The latency budget bench's own arithmetic (bench/latency_budget.py); the servers it starts are the ones every
other bench test starts."""
from __future__ import annotations

from vitserve.bench import latency_budget


def test_a_stage_that_repeats_is_summed_and_the_header_read_in_order():
    stages = latency_budget.stages_of("accept;dur=0.100, decode;dur=0.400, decode;dur=0.600, total;dur=2.000")
    assert list(stages) == ["accept", "decode", "total"]
    assert stages == {"accept": 0.1, "decode": 1.0, "total": 2.0}


def test_the_report_gives_the_budget_and_what_the_server_adds_to_the_work():
    def arm(p50, stages=None):
        return {"p50_ms": p50, "p99_ms": p50 * 2, "mean_ms": p50, **({"stages_p50_us": stages} if stages else {})}

    rounds = [{"order": ["in-process", "FastAPI app", "vitserve"], "in-process": arm(3.0), "FastAPI app": arm(5.0),
               "vitserve": arm(6.0 + shift, {"decode": 400.0, "inference": 2500.0, "total": 5000.0 + 1000 * shift})}
              for shift in (0.0, 0.5, 1.0)]
    text = latency_budget.markdown({"command": "python -m vitserve.bench.latency_budget", "machine": "m",
                                    "model": "x.onnx", "image": "a.png", "requests": 10, "rounds": rounds})
    assert "| vitserve | 6.50 | 13.00 |" in text and "| in-process | 3.00 | 6.00 |" in text
    assert "at p50: **3.50 ms**" in text and "**1.30x** (6.50 against 5.00 ms)" in text
    assert "| inference | 2500 |" in text and "| total | 5500 |" in text
    assert "| outside the app (client p50 less the server's total) | 1000 |" in text


def test_the_multipart_body_is_one_file_field():
    body = latency_budget.multipart(b"\x89PNG")
    assert body.startswith(b"--vitserve-budget\r\nContent-Disposition: form-data; name=\"file\"")
    assert body.endswith(b"\x89PNG\r\n--vitserve-budget--\r\n")
