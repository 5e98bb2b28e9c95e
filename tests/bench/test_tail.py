"""The tail bench: its arms, its stage summary, and a short real run against a tiny model under wrk."""
import argparse
import json
import shutil

import pytest

from vitserve.bench.tail import main, parse_arm, summarise


def test_an_arm_is_a_name_and_vitserve_settings():
    assert parse_arm("base:") == ("base", {})
    assert parse_arm("d2:VITSERVE_MAX_QUEUE_DELAY_MS=2,VITSERVE_WORKERS=1") == (
        "d2", {"VITSERVE_MAX_QUEUE_DELAY_MS": "2", "VITSERVE_WORKERS": "1"})
    assert parse_arm("eq:VITSERVE_API_KEY=a=b") == ("eq", {"VITSERVE_API_KEY": "a=b"})
    # anything else in the server's environment, or a name that is not a file name, is refused
    for bad in ("base", ":VITSERVE_X=1", "a/b:", "x:PATH=/tmp", "x:VITSERVE_X", "x:LD_PRELOAD=/tmp/evil.so"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_arm(bad)


def test_the_slowest_hundredth_is_chosen_by_the_servers_total():
    budgets = [{"queue": 1.0, "inference": 5.0, "total": 7.0} for _ in range(198)]
    budgets += [{"queue": 40.0, "inference": 5.0, "total": 46.0}, {"queue": 2.0, "inference": 50.0, "total": 53.0}]
    summary = summarise(budgets)
    assert summary["answers"] == 200
    queue, inference = summary["stages"]["queue"], summary["stages"]["inference"]
    assert queue["p50"] == 1.0 and queue["p99"] == 2.0  # the 199th of 200
    assert queue["slowest_1pct_mean"] == 21.0 and inference["slowest_1pct_mean"] == 27.5
    assert list(summary["stages"]) == ["queue", "inference", "total"]  # the stages in the order they run
    assert summarise([]) == {"answers": 0, "stages": {}}


def test_two_arms_with_one_name_and_missing_files_are_refused(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["--arm", "a:", "--arm", "a:VITSERVE_WORKERS=1"])
    assert "each --arm needs a name of its own" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--image", str(tmp_path / "none.png")])
    assert f"--image: no file {tmp_path / 'none.png'}" in capsys.readouterr().err


def served(tiny_onnx, tmp_path, *options: str) -> tuple[dict, str]:
    """The bench run for one short round on the tiny model and a 32x32 PNG: its JSON report and its Markdown."""
    from vitserve.bench.load import make_images

    image = tmp_path / "image.png"
    image.write_bytes(make_images("png", (32, 32), channels=3, count=1)[0])
    out = tmp_path / "tail.md"
    main(["--model", str(tiny_onnx), "--image", str(image), "--duration-s", "1", "--warmup-s", "1", "--rounds", "1",
          *options, "--out", str(out)])
    return json.loads(out.with_suffix(".json").read_text()), out.read_text()


@pytest.mark.skipif(shutil.which("wrk") is None, reason="needs Debian's wrk")
@pytest.mark.slow
def test_a_served_model_reports_every_answers_stages(tiny_onnx, tmp_path):
    report, text = served(tiny_onnx, tmp_path, "--clients", "4", "--arm", "one:VITSERVE_WORKERS=1",
                          "--baseline-commit", "HEAD")
    row, baseline = report["rows"]
    assert row["arm"] == "one" and row["settings"] == {"VITSERVE_WORKERS": "1"} and row["non_2xx"] == 0
    # the commit's own tree served beside it (git archive), its answers as complete
    assert baseline["arm"] == report["baseline_commit"] and len(baseline["arm"]) == 12
    assert baseline["non_2xx"] == 0 and baseline["stages"]["inference"]["p50"] > 0
    assert report["arms"][1]["code"] == f"commit {baseline['arm']}"
    # every 200 answer's header was kept: as many budgets as wrk counted (give or take the ones in flight at its end)
    assert row["answers"] >= 0.9 * row["requests_per_s"] > 0
    for stage in ("decode", "queue", "inference", "total"):
        assert 0 < row["stages"][stage]["p50"] <= row["stages"][stage]["p99"]
    assert row["stages"]["total"]["p99"] >= row["stages"]["inference"]["p99"]
    assert row["mean_batch"] >= 1
    assert "| `queue` |" in text


@pytest.mark.skipif(shutil.which("wrk") is None, reason="needs Debian's wrk")
@pytest.mark.slow
def test_a_tensor_path_sends_the_servers_own_preprocessing_and_reports_its_parse(tiny_onnx, tmp_path):
    report, _ = served(tiny_onnx, tmp_path, "--path", "oip-binary", "--clients", "2")
    (row,) = report["rows"]
    assert report["path"] == "oip-binary" and report["target"].startswith("/v2/models/")
    assert row["non_2xx"] == 0 and row["answers"] > 0
    # a tensor arrives decoded: the /v2 parse instead of an image's decode
    assert "parse" in row["stages"] and "decode" not in row["stages"]
