"""`python -m vitserve.bench.screenshots`: the docs' pictures of the web page, taken from the page as it is.

Starts `vitserve serve` on the bundled model in a child process (as `make serve` does, on a free port), opens the
page in Debian's headless Chromium through Playwright, and takes each picture after the steps a user would take:

- web-page.png: the Ankle boot sample with its two maps side by side, rollout and relevance (the README's picture);
- web-calibrated.png: the Trouser sample: the card's calibrated confidence and the answer's OOD line (docs/ood.md);
- web-ood.png: scikit-image's astronaut photo, which the answer flags as unlike the training images (docs/ood.md).

Beside them, web-page.json records what each picture shows as text (the status line, the top classes, the map's
caption, the OOD line, the resize line, the model card) with each PNG's SHA-256. tests/service/test_web.py renders
the page again and compares: a page or a model that changed since the pictures were taken fails there, naming
this command. The timings drawn in the pictures change from run to run and are left out of the record.

Writes build/screenshots/ unless `--out` says where; `make screenshots` writes docs/.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vitserve.bench.config import LOOPBACK
from vitserve.bench.servers import ServerProcess, free_port, serve_argv
from vitserve.machine import cpu_model_name

if TYPE_CHECKING:  # playwright loads only when screenshots are taken
    from playwright.sync_api import ViewportSize

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "vit-fmnist" / "model.onnx"
RECORD = "web-page.json"
COMMAND = "make screenshots"
VIEWPORT: ViewportSize = {"width": 1280, "height": 960}
# The pictures show ONNX Runtime's float32 answers, the README's figures: `--runtime auto` would serve bfloat16 on a
# CPU that computes it, and the shown scores and the card's precision would then depend on the machine.
SERVE_FLAGS = ("--runtime", "onnxruntime", "--providers", "cpu", "--workers", "1", "--grpc-port", "0")


@dataclass(frozen=True)
class Shot:
    """One picture: its file, what it shows in words, and the user's steps on the page before it is taken."""

    file: str
    shows: str
    steps: Callable


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def open_page(page, base_url: str) -> None:
    """The page at `base_url`, once it shows its model card and its samples."""
    page.goto(base_url + "/")
    page.wait_for_function("() => document.getElementById('card-fields').children.length > 0 "
                           "&& document.querySelectorAll('#samples button').length > 0")


def answered(page, action: Callable[[], None]) -> None:
    """Do `action`, then wait until the page has drawn the answer it asked for (the page counts its answers in
    #result's data-answers)."""
    before = page.evaluate("Number(document.getElementById('result').dataset.answers || 0)")
    action()
    page.wait_for_function("n => Number(document.getElementById('result').dataset.answers || 0) > n", arg=before)


def click_sample(page, label: str) -> None:
    answered(page, lambda: page.get_by_role("button", name=re.compile(rf"^Sample: {re.escape(label)}")).click())


def upload_photo(page) -> None:
    from PIL import Image
    from skimage import data as skimage_data  # a photo every install of scikit-image carries

    buffer = io.BytesIO()
    Image.fromarray(skimage_data.astronaut()).save(buffer, "PNG")
    photo = {"name": "astronaut.png", "mimeType": "image/png", "buffer": buffer.getvalue()}
    answered(page, lambda: page.set_input_files("#file", files=[photo]))


def ankle_boot_with_both_maps(page) -> None:
    click_sample(page, "Ankle boot")
    answered(page, lambda: page.check("input[name=map][value=both]"))


SHOTS = (
    Shot("web-page.png", "the Ankle boot sample (Fashion-MNIST test image 0) with its rollout and relevance maps "
         "side by side", ankle_boot_with_both_maps),
    Shot("web-calibrated.png", "the Trouser sample: calibrated confidence and the OOD line",
         lambda page: click_sample(page, "Trouser")),
    Shot("web-ood.png", "scikit-image's astronaut photo, flagged as unlike the training images", upload_photo),
)


def one_line(text: str) -> str:
    return " ".join(text.split())


def shown(page) -> dict:
    """What the page shows as text, but for its timings."""
    terms = page.locator("#card-fields dt").all_inner_texts()
    values = page.locator("#card-fields dd").all_inner_texts()
    ood = page.locator("#ood")
    return {"status": one_line(page.inner_text("#status")),
            "top_classes_heading": one_line(page.inner_text("#predictions-heading")),
            "top_classes": [one_line(item) for item in page.locator("#predictions li").all_inner_texts()],
            "ood": one_line(ood.inner_text()) if ood.is_visible() else None,
            "map_caption": one_line(page.inner_text("#map-caption")),
            "resize": one_line(page.inner_text("#geometry")),
            "card": {one_line(t): one_line(v) for t, v in zip(terms, values)}}


def take(page, base_url: str, out: Path | None) -> list[dict]:
    """Each shot's steps on one page, in order (each starts from what the last left, as a user's would); with
    `out`, each picture is written there, its SHA-256 beside what it shows."""
    open_page(page, base_url)
    records = []
    for shot in SHOTS:
        shot.steps(page)
        record = {"file": shot.file, "shows": shot.shows, **shown(page)}
        if out is not None:
            picture = page.screenshot(path=out / shot.file, full_page=True)
            record["sha256"] = hashlib.sha256(picture).hexdigest()
        records.append(record)
    return records


def warm_up(base_url: str) -> None:
    """One call on the relevance path, which the server's own warm-up leaves cold: its first call takes about 0.35 s
    here, and the pictures would show that as the page's inference time."""
    import httpx

    sample = REPO / "examples" / "ankle-boot.png"
    httpx.post(f"{base_url}/v1/classify", params={"map": "relevance"}, content=sample.read_bytes(),
               headers={"content-type": "image/png"}, timeout=60).raise_for_status()


def chromium_version(chromium: str) -> str:
    return subprocess.run([chromium, "--version"], capture_output=True, text=True, check=True).stdout.strip()


def run(out: Path, model: Path) -> dict:
    """Serve `model`, take every shot into `out`, write the record beside them; returns the record."""
    from playwright.sync_api import sync_playwright

    chromium = find_chromium()
    if chromium is None:
        raise SystemExit("screenshots: needs Debian's chromium (apt-get install chromium)")
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="vitserve-screenshots-") as logs, \
            ServerProcess([*serve_argv(model, port), *SERVE_FLAGS], port, log_path=Path(logs) / "serve.log"), \
            sync_playwright() as driver:
        base_url = f"http://{LOOPBACK}:{port}"
        warm_up(base_url)
        browser = driver.chromium.launch(executable_path=chromium)
        shots = take(browser.new_context(viewport=VIEWPORT).new_page(), base_url, out)
        browser.close()
    record = {"command": COMMAND, "model": str(model.relative_to(REPO)) if model.is_relative_to(REPO) else str(model),
              "server": " ".join(["vitserve serve --model MODEL", *SERVE_FLAGS]), "viewport": VIEWPORT,
              "browser": chromium_version(chromium), "machine": f"{cpu_model_name()}, {os.cpu_count()} cores",
              "shots": shots}
    (out / RECORD).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vitserve.bench.screenshots", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "build" / "screenshots",
                        help="folder for the PNGs and web-page.json (`make screenshots`: docs)")
    parser.add_argument("--model", type=Path, default=MODEL, help="the model file to serve")
    args = parser.parse_args(argv)
    record = run(args.out, args.model)
    for shot in record["shots"]:
        print(f"{args.out / shot['file']}: {shot['status']}" + (f" {shot['ood']}" if shot["ood"] else ""))
    print(f"{args.out / RECORD}: what each picture shows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
