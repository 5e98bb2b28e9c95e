"""`vitserve predict`: locally through the service's own code, and through a real uvicorn server."""
from __future__ import annotations

import io
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vitserve.service.client import (MIN_OVERLAY_SIDE, Prediction, display_size, format_table, overlay_path,
                                     overlay_paths)
from service_fixtures import patterned_png, uvicorn_server
from vitserve.cli import main

LABELS = {"cat", "dog", "bird"}  # tests/conftest.py TINY_LABELS
ROW = re.compile(r"^(?P<image>\S*)\s+(?P<rank>\d+)\s+(?P<label>\S+)\s+(?P<score>[01]\.\d{4})$")


@pytest.fixture
def images(tmp_path):
    """A 48x40 patterned PNG and a 640x480 JPEG (resized and cropped by `fit`)."""
    png = tmp_path / "pattern.png"
    png.write_bytes(patterned_png((48, 40)))
    jpeg = tmp_path / "photo.jpg"
    rng = np.random.default_rng(2)
    Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)).save(jpeg, "JPEG")
    return [png, jpeg]


def parse_table(text: str) -> dict[str, list[tuple[int, str, float]]]:
    """The printed table back into {image: [(rank, label, score), ...]}."""
    lines = text.splitlines()
    assert lines[0].split() == ["image", "rank", "label", "score"]
    assert set(lines[1]) == {"-"}
    table, current = {}, None
    for line in lines[2:]:
        if line.startswith(("wrote ", "replaced ", "--out-dir ")):
            continue
        m = ROW.match(line)
        assert m, f"unexpected row {line!r}"
        current = m["image"] or current
        table.setdefault(current, []).append((int(m["rank"]), m["label"], float(m["score"])))
    return table


def check_predictions(table, images, k):
    assert list(table) == [str(p) for p in images]
    for rows in table.values():
        assert [r[0] for r in rows] == list(range(1, k + 1))
        assert {r[1] for r in rows} <= LABELS and len({r[1] for r in rows}) == k
        scores = [r[2] for r in rows]
        assert scores == sorted(scores, reverse=True) and 0 < sum(scores) <= 1.0001


def check_overlays(images, out_dir):
    for image in images:
        with Image.open(overlay_path(image, out_dir)) as overlay, Image.open(image) as source:
            assert overlay.format == "PNG" and overlay.mode == "RGB"
            # the overlay covers the whole input, at its size; a small one (the 48x40 PNG) a whole multiple of it,
            # at least MIN_OVERLAY_SIDE long
            factor = max(1, math.ceil(MIN_OVERLAY_SIDE / max(source.size)))
            assert overlay.size == (source.width * factor, source.height * factor)


@pytest.mark.parametrize("resize", ["fit", "native"])
def test_predict_locally_prints_top_k_and_writes_overlays_into_out_dir(tiny_onnx, images, tmp_path, capsys, resize):
    out_dir = tmp_path / "maps"
    assert main(["predict", *map(str, images), "--model", str(tiny_onnx), "--top-k", "2", "--resize", resize,
                 "--out-dir", str(out_dir)]) == 0
    out = capsys.readouterr().out
    check_predictions(parse_table(out), images, k=2)
    check_overlays(images, out_dir)
    assert f"wrote {out_dir / 'photo.rollout.png'}" in out and "--out-dir DIR" not in out
    assert main(["predict", str(images[1]), "--model", str(tiny_onnx), "--resize", resize,
                 "--out-dir", str(out_dir)]) == 0
    assert f"replaced {out_dir / 'photo.rollout.png'}" in capsys.readouterr().out  # never silently


def test_predict_without_out_dir_writes_no_file_and_says_how_to_save_the_maps(tiny_onnx, images, capsys,
                                                                              monkeypatch):
    """An image's folder (examples/ of a checkout) is not ours to write in: without --out-dir the table is all."""
    monkeypatch.chdir(images[0].parent)  # where a relative path would land, too
    before = sorted(images[0].parent.rglob("*"))
    assert main(["predict", *map(str, images), "--model", str(tiny_onnx), "--map", "relevance", "--target", "dog"]) == 0
    out = capsys.readouterr().out
    check_predictions(parse_table(out), images, k=3)
    assert sorted(images[0].parent.rglob("*")) == before
    assert out.splitlines()[-1] == "--out-dir DIR saves each image's relevance map over it as a PNG"
    assert main(["predict", str(images[0]), "--model", str(tiny_onnx), "--no-overlay"]) == 0
    assert "--out-dir" not in capsys.readouterr().out  # the table only, as asked
    assert sorted(images[0].parent.rglob("*")) == before


def test_predict_top_k_is_capped_at_the_class_count_and_out_dir_is_used(tiny_onnx, images, tmp_path, capsys):
    out_dir = tmp_path / "overlays"
    assert main(["predict", str(images[0]), "--model", str(tiny_onnx), "--top-k", "10",
                 "--out-dir", str(out_dir)]) == 0
    check_predictions(parse_table(capsys.readouterr().out), images[:1], k=3)
    assert sorted(p.name for p in out_dir.iterdir()) == ["pattern.rollout.png"]
    assert not images[0].with_name("pattern.rollout.png").exists()


def test_images_that_share_a_name_get_overlays_of_their_own(tiny_onnx, tmp_path, capsys):
    """`a.png a.jpg --out-dir D` wrote both to `D/a.relevance.png`, the first lost; now each keeps its own."""
    rng = np.random.default_rng(5)
    (tmp_path / "x").mkdir()
    images = [tmp_path / "a.png", tmp_path / "a.jpg", tmp_path / "x" / "a.png", tmp_path / "b.png"]
    for image in images:
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(image)
    out_dir = tmp_path / "out"
    assert main(["predict", *map(str, images), "--model", str(tiny_onnx), "--map", "relevance",
                 "--out-dir", str(out_dir)]) == 0
    written = [line.split(" ", 1) for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]
    assert [(verb, Path(path).name) for verb, path in written] == [
        ("wrote", "a.png.relevance.png"), ("wrote", "a.jpg.relevance.png"), ("wrote", "a.png.relevance-2.png"),
        ("wrote", "b.relevance.png")]
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(Path(path).name for _, path in written)


def test_overlay_paths_keep_images_of_one_name_apart(tmp_path):
    one, two, out = tmp_path / "one", tmp_path / "two", tmp_path / "out"
    paths = overlay_paths([one / "a.png", two / "a.png", one / "a.jpg", one / "a.png", one / "b.png"], out)
    assert paths == {one / "a.png": out / "a.png.rollout.png", two / "a.png": out / "a.png.rollout-2.png",
                     one / "a.jpg": out / "a.jpg.rollout.png", one / "b.png": out / "b.rollout.png"}


def test_predict_reports_a_bad_image_on_its_row_and_goes_on(tiny_onnx, images, tmp_path, capsys):
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"not an image at all")
    missing = tmp_path / "missing.png"
    args = ["predict", str(garbage), str(images[0]), str(missing), "--model", str(tiny_onnx), "--no-overlay"]
    assert main(args) == 1
    lines = capsys.readouterr().out.splitlines()
    assert re.match(rf"^{re.escape(str(garbage))}\s+-\s+error\s+invalid_image: ", lines[2])
    assert re.match(rf"^{re.escape(str(images[0]))}\s+1\s+", lines[3])
    assert re.match(rf"^{re.escape(str(missing))}\s+-\s+error\s+not_found: no such file$", lines[-1])
    assert not any(tmp_path.glob("*.rollout.png"))


def test_predict_without_a_model_file_exits_with_a_message(tmp_path):
    with pytest.raises(SystemExit, match="model file not found"):
        main(["predict", str(tmp_path / "x.png"), "--model", str(tmp_path / "absent.onnx")])


@pytest.mark.slow
def test_predict_via_a_real_server_matches_local(tiny_onnx, images, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VITSERVE_RUNTIME", "onnxruntime")  # local predict reads the server's settings, as serve does
    assert main(["predict", *map(str, images), "--model", str(tiny_onnx), "--top-k", "3",
                 "--out-dir", str(tmp_path / "local")]) == 0
    local = parse_table(capsys.readouterr().out)
    with uvicorn_server(tiny_onnx) as (base_url, _):
        assert main(["predict", *map(str, images), "--url", base_url, "--top-k", "3",
                     "--out-dir", str(tmp_path / "remote")]) == 0
        remote = parse_table(capsys.readouterr().out)
        garbage = tmp_path / "garbage.jpg"
        garbage.write_bytes(b"\xff\xd8\xff truncated")
        assert main(["predict", str(garbage), "--url", base_url]) == 1
        assert re.search(r"error\s+invalid_image: ", capsys.readouterr().out)
    check_predictions(remote, images, k=3)
    assert [[r[:2] for r in rows] for rows in remote.values()] == [[r[:2] for r in rows] for rows in local.values()]
    for a, b in zip(remote.values(), local.values()):
        np.testing.assert_allclose([r[2] for r in a], [r[2] for r in b], atol=2e-4)
    check_overlays(images, tmp_path / "remote")
    for image in images:  # the same code draws both: the same picture, up to float noise in the rollout
        remote_px = np.asarray(Image.open(overlay_path(image, tmp_path / "remote")), np.int16)
        local_px = np.asarray(Image.open(overlay_path(image, tmp_path / "local")), np.int16)
        assert np.abs(remote_px - local_px).max() <= 2


@pytest.mark.slow
def test_predict_relevance_overlays_locally_and_via_a_server(tiny_onnx, images, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VITSERVE_RUNTIME", "onnxruntime")
    explain = ["--map", "relevance", "--target", "dog"]
    assert main(["predict", str(images[0]), "--model", str(tiny_onnx), *explain, "--out-dir", str(tmp_path / "l")]) == 0
    with uvicorn_server(tiny_onnx) as (base_url, _):
        assert main(["predict", str(images[0]), "--url", base_url, *explain, "--out-dir", str(tmp_path / "r")]) == 0
    assert sorted(p.name for p in (tmp_path / "l").iterdir()) == ["pattern.relevance.png"]
    local = np.asarray(Image.open(overlay_path(images[0], tmp_path / "l", "relevance")), np.int16)
    remote = np.asarray(Image.open(overlay_path(images[0], tmp_path / "r", "relevance")), np.int16)
    rollout = tmp_path / "rollout"
    assert main(["predict", str(images[0]), "--model", str(tiny_onnx), "--out-dir", str(rollout)]) == 0
    assert np.abs(local - remote).max() <= 2  # the same relevance map, drawn by the same code
    assert np.abs(local - np.asarray(Image.open(overlay_path(images[0], rollout)), np.int16)).max() > 2
    with pytest.raises(SystemExit, match="needs --map relevance"):
        main(["predict", str(images[0]), "--model", str(tiny_onnx), "--target", "dog"])
    with pytest.raises(SystemExit, match="neither a class index"):
        main(["predict", str(images[0]), "--model", str(tiny_onnx), "--map", "relevance", "--target", "horse"])


def test_predict_via_url_names_an_unreachable_server_in_one_line(images):
    """Nothing listening: one line on stderr naming the URL and what to check, exit status 1 as any command's error;
    not a table of rows that each say "connection refused"."""
    from service_fixtures import free_port

    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run([sys.executable, "-m", "vitserve.cli", "predict", str(images[0]), "--url", url,
                           "--timeout", "5"], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr == f"vitserve predict: cannot reach {url} (connection refused): is `vitserve serve` running " \
                          f"there, and is the URL right?\n"
    with pytest.raises(SystemExit, match=r"--url takes http:// or https://, as in http://127\.0\.0\.1:8000$"):
        main(["predict", str(images[0]), "--url", "127.0.0.1:8000"])


def test_a_connection_failure_is_named_by_the_operating_systems_error_under_httpxs():
    import socket

    import httpx

    from vitserve.service.client import connect_failure

    def failed(cause: BaseException) -> httpx.ConnectError:
        try:
            try:
                raise cause
            except OSError as e:
                raise OSError("All connection attempts failed") from e
        except OSError as e:
            error = httpx.ConnectError(str(e))
            error.__cause__ = e
            return error

    assert connect_failure(failed(ConnectionRefusedError(111, "Connect call failed"))) == "connection refused"
    assert connect_failure(failed(socket.gaierror(-2, "Name or service not known"))) == \
        "unknown host: Name or service not known"
    assert connect_failure(httpx.ConnectTimeout("timed out")) == "no answer to the connection"
    assert connect_failure(httpx.ConnectError("[Errno 101] Network is unreachable")) == "Network is unreachable"


def test_a_small_overlay_is_enlarged_in_whole_blocks_for_display():
    """A 28x28 overlay (a Fashion-MNIST image's) becomes 224x224, each pixel an 8x8 block; a large one is left."""
    small = np.random.default_rng(0).integers(0, 256, (28, 21, 3), dtype=np.uint8)  # (H, W, 3)
    buffer = io.BytesIO()
    Image.fromarray(small).save(buffer, format="PNG")
    with Image.open(io.BytesIO(display_size(buffer.getvalue()))) as shown:
        assert shown.size == (168, 224)
        np.testing.assert_array_equal(np.asarray(shown), small.repeat(8, axis=0).repeat(8, axis=1))
    large = io.BytesIO()
    Image.fromarray(np.zeros((224, 300, 3), np.uint8)).save(large, format="PNG")
    assert display_size(large.getvalue()) == large.getvalue()


def test_format_table_is_aligned():
    results = [Prediction(Path("a.png"), [("cat", 0.75), ("bird", 0.125)]),
               Prediction(Path("long/name.jpg"), error="invalid_image: broken")]
    assert format_table(results).splitlines() == [
        "image          rank  label  score",
        "---------------------------------",
        "a.png             1  cat    0.7500",
        "                  2  bird   0.1250",
        "long/name.jpg     -  error  invalid_image: broken",
    ]


def test_predict_locally_answers_as_the_server_does_with_its_ood_score_and_plan(tiny_onnx, images, monkeypatch):
    """The local path is the server's own use case in this process: the same JSON a server sends (its calibrated
    scores, its OOD field), on the plan the server would load (here ONNX Runtime, named in the environment)."""
    import asyncio

    from vitserve.service.client import in_process
    monkeypatch.setenv("VITSERVE_RUNTIME", "onnxruntime")

    async def ask():
        async with in_process(tiny_onnx) as client:
            answer = await client.post("/v1/classify", files={"file": ("p.png", images[0].read_bytes(), "image/png")})
            card = await client.get("/v1/model")
        return answer.json(), card.json()
    answer, card = asyncio.run(ask())
    assert {"predictions", "ood", "timing_ms", "model"} <= set(answer)
    assert card["serving"]["runtime"] == "onnxruntime" and card["serving"]["source"] == "settings"
