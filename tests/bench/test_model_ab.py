"""bench/model_ab.py's report: every arm, and B's medians as ratios to the same round's A."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vitserve.bench.model_ab import inclusive_shares, render, render_profile


def row(round_: int, file: str, clients: int, rate: float, p50: float, p99: float, cpu: float = 5.0) -> dict:
    return {"round": round_, "file": file, "clients": clients, "ok_per_s": rate, "p50_ms": p50, "p99_ms": p99,
            "cpu_ms": cpu, "engine_cpu_ms": cpu * 0.6, "frontend_cpu_ms": cpu * 0.4, "non_2xx": 0}


def test_b_is_compared_with_the_same_rounds_a_and_the_medians_are_taken():
    rows = [row(1, "A", 32, 100, 10, 20), row(1, "B", 32, 90, 11, 30, 6.0), row(2, "B", 32, 200, 20, 40),
            row(2, "A", 32, 200, 20, 40), row(3, "A", 32, 100, 10, 20, 4.0), row(3, "B", 32, 95, 12, 22)]
    text = render(Path("a.onnx"), Path("b.onnx"), rows, 3, 10)
    assert "| 32 | 0.950x | 1.100x | 1.100x | 1.200x | 1.200x | 1.200x |" in text
    assert text.count("| 32 | ") == 8  # six arms, the summary row and its intervals
    assert "| 32 | 0.900-1.000x |" in text  # answers/s ratios 0.9, 1.0, 0.95: the median of any resample within


def test_the_interval_of_a_median_holds_it_and_narrows_with_more_rounds():
    from vitserve.bench.model_ab import median_interval

    rng = [1.0 + 0.1 * ((i * 7) % 11 - 5) / 5 for i in range(40)]  # spread 0.9-1.1 around 1.0
    few, many = median_interval(rng[:6]), median_interval(rng)
    assert few[0] <= 1.0 <= few[1] and many[0] <= 1.0 <= many[1]
    assert many[1] - many[0] < few[1] - few[0]
    assert median_interval([1.2] * 5) == (1.2, 1.2)


def test_a_function_counts_once_per_sample_at_any_depth_and_its_lines_add_up():
    raw = ("main (app.py:1);handle (app.py:9);encode (out.py:3) 5\n"
           "main (app.py:1);handle (app.py:12);handle (app.py:9) 2\n"  # recursion: still once per sample
           "main (app.py:1);idle (loop.py:4) 3\n"
           "not a py-spy line\n")
    counts, total = inclusive_shares(raw)
    assert total == 10
    assert counts == {"main (app.py)": 10, "handle (app.py)": 7, "encode (out.py)": 5, "idle (loop.py)": 3}


def test_the_profile_table_puts_the_most_certain_moves_first_per_role():
    a = {"file": "A", "roles": {"frontend": {"total": 1000, "functions": {"route (r.py)": 500, "json (j.py)": 100}},
                                "engine": {"total": 10, "functions": {"run (s.py)": 9}}}}
    b = {"file": "B", "roles": {"frontend": {"total": 1000, "functions": {"route (r.py)": 530, "json (j.py)": 100,
                                                                         "ood (i.py)": 10}},
                                "engine": {"total": 10, "functions": {"run (s.py)": 9}}}}
    text = "\n".join(render_profile([a, b], 32, 5))
    assert "frontend: 1,000 samples of A, 1,000 of B" in text
    frontend = text.split("frontend:")[1].split("engine:")[0]
    # a 1% share that is new in B (z 3.2) before a wrapper's 3-point move within its noise (z 1.3)
    assert frontend.index("`ood (i.py)` | 0.00% | 1.00% | +1.00% | +3.2 |") < \
        frontend.index("`route (r.py)` | 50.00% | 53.00% | +3.00% | +1.3 |")
    assert "`json (j.py)` | 10.00% | 10.00% | +0.00% | +0.0 |" in frontend
    assert "`run (s.py)` | 90.00% | 90.00% | +0.00% | +0.0 |" in text.split("engine:")[1]


@pytest.mark.skipif(shutil.which("wrk") is None, reason="needs Debian's wrk")
@pytest.mark.slow
def test_py_spy_samples_the_engine_and_the_frontend_of_a_served_model(tiny_onnx, tmp_path):
    from vitserve.bench.load import make_images
    from vitserve.bench.model_ab import find_py_spy, profile_arm
    from vitserve.bench.peers.bodies import PeerRequest
    from vitserve.bench.peers.wrk import find_wrk, write_script

    spy = find_py_spy()
    if spy is None:
        pytest.skip("py-spy is not installed (pip install py-spy)")
    image = make_images("png", (32, 32), channels=3, count=1)[0]
    script = write_script(tmp_path, "ab", PeerRequest("/v1/classify", image, {"Content-Type": "image/png"}))
    try:
        profile = profile_arm(tiny_onnx, "A", 4, 2, script, find_wrk(), spy, tmp_path)
    except SystemExit as e:  # a container without ptrace rights: py-spy cannot attach to any process
        if "ermission" in str(e) or "ptrace" in str(e):
            pytest.skip(f"py-spy may not attach here: {e}")
        raise
    engine, frontend = profile["roles"]["engine"], profile["roles"]["frontend"]
    assert engine["total"] > 0 and frontend["total"] > 0
    # each process's own code, by role: the batcher in the engine, the route in the HTTP workers
    assert any("service/engine/batcher.py" in f for f in engine["functions"])
    assert not any("service/usecases/inference.py" in f for f in engine["functions"])
    assert "classify (service/usecases/inference.py)" in frontend["functions"]



def test_each_arms_query_is_named_in_the_report():
    rows = [row(1, "A", 32, 100, 10, 20), row(1, "B", 32, 90, 11, 30)]
    text = render(Path("m.onnx"), Path("m.onnx"), rows, 1, 10, queries=("map=rollout", "map=relevance"))
    assert "A: `m.onnx` asked `?map=rollout`; B: `m.onnx` asked `?map=relevance`." in text
    assert "A: `a.onnx`; B: `b.onnx`." in render(Path("a.onnx"), Path("b.onnx"), rows, 1, 10)
