"""The interference bench: a short real run of both arrangements, quiet and beside its neighbour, on the tiny model."""
import json
import subprocess
import sys
import time

import pytest

from vitserve.bench.interference import NEIGHBOUR, main, photo_png


@pytest.mark.slow
def test_the_neighbour_prepares_photos_until_it_is_stopped(tiny_onnx, tmp_path):
    png = tmp_path / "photo.png"
    png.write_bytes(photo_png((224, 224)))
    process = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(tiny_onnx), str(png), "50"],
                               stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
        assert process.poll() is None, process.stderr.read()  # still decoding, not failed at its imports
    finally:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_each_arrangement_runs_quiet_and_beside_the_neighbour(tiny_onnx, tmp_path, capsys):
    out = tmp_path / "interference.md"
    main(["--model", str(tiny_onnx), "--seconds", "1", "--rounds", "2", "--batch-size", "2", "--out", str(out)])
    report = json.loads(out.with_suffix(".json").read_text())
    rows = report["rows"]
    assert {(r["neighbour"], r["arrangement"]) for r in rows} == {
        (n, a) for n in ("quiet", "decoding beside") for a in ("one caller", "a caller per core")}
    assert len(rows) == 8 and all(r["images_per_s"] > 0 and r["cpu_ms_per_image"] > 0 for r in rows)
    # the second round runs the arms in the other order
    assert [r["arrangement"] for r in rows[:2]] == ["one caller", "a caller per core"]
    assert [r["arrangement"] for r in rows[4:6]] == ["a caller per core", "one caller"]
    text = out.read_text()
    assert "| decoding beside | a caller per core |" in text and "A caller per core against one caller" in text


@pytest.mark.parametrize("argv, message", [(["--rounds", "0"], "at least 1, got 0"),
                                           (["--model", "none.onnx"], "--model: no file none.onnx")])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err
