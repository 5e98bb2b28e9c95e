"""The page at / and the API docs at /docs, in a real browser: Debian's Chromium driven by Playwright,
against `vitserve serve` in its own process with the tiny test model. Every request for another host is refused
and recorded, and a test fails if its page asked for one. Screenshots go to build/screenshots/.

The files themselves (headers, caching, the allow-list, package data, the samples' provenance) are checked in
process, without a browser.
"""
from __future__ import annotations

import ast
import base64
import fnmatch
import hashlib
import io
import json
import re
import shutil
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import numpy as np
import pytest
from PIL import Image

from vitserve.bench import screenshots
from vitserve.service.usecases.postprocess import ramp_colors
from vitserve.service.usecases.preprocess import fit_box, native_size
from vitserve.service.http.routes.web import DOCS_ASSETS, WEB_DIR, WEB_FILES
from service_fixtures import REPO, patterned_png, serving, settings_for, uvicorn_server

SCREENSHOTS = REPO / "build" / "screenshots"
DEFAULT_MODEL = REPO / "models" / "vit-fmnist" / "model.onnx"
CHROMIUM = screenshots.find_chromium()
MAX_UPLOAD_BYTES = 200_000  # the browser tests' server: small, so a 413 is cheap to provoke
PATTERN_SIZE = (48, 40)  # (W, H): not square, so fit crops and native keeps all
TINY = dict(image=(32, 32), patch=8, max_tokens=1024)  # the tiny model (tests/conftest.py), the default cap


def _browser_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "needs playwright (pip install playwright: the dev extra has it)"
    if CHROMIUM is None:
        return "needs Debian's chromium (apt-get install chromium; .ci/run installs it)"
    return None


needs_browser = pytest.mark.skipif(_browser_missing() is not None, reason=_browser_missing() or "")


# ---- the files, in process
@pytest.mark.anyio
async def test_page_files_headers_and_allow_list(tiny_onnx, tiny_model):
    async with serving(settings_for(tiny_onnx), tiny_model) as client:
        page = await client.get("/")
        script = await client.get("/web/app.js")
        again = await client.get("/web/app.js", headers={"if-none-match": script.headers["etag"]})
        card = (await client.get("/v1/model")).json()
        missing = [await client.get(p) for p in ("/web/nothing.js", "/web/../routes/web.py", "/web/%2e%2e/app.py",
                                                 "/docs/assets/index.html", "/web/")]
        docs, redoc = await client.get("/docs"), await client.get("/redoc")
        assets = [await client.get(f"/docs/assets/{name}") for name in DOCS_ASSETS]
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert script.headers["content-type"] == "text/javascript; charset=utf-8" and script.headers["cache-control"] == "no-cache"
    assert (again.status_code, again.content, again.headers["etag"]) == (304, b"", script.headers["etag"])
    assert card["maps"] == ["rollout", "relevance"]
    for answer in missing:
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found", answer.request.url
    assert docs.status_code == 200 and "default-src 'self'" in docs.headers["content-security-policy"]
    linked = re.findall(r'(?:src|href)="([^"]+)"', docs.text)
    assert linked and all(u.startswith("/") and not u.startswith("//") for u in linked), linked
    assert "http" not in docs.text  # no URL of another host, in code or links
    assert redoc.status_code == 404  # ReDoc draws its maker's logo from their server: not served
    assert [a.status_code for a in assets] == [200] * len(DOCS_ASSETS) and len(assets[0].content) > 100_000


def test_the_api_is_routed_before_the_page(tiny_onnx):
    """Routing tries an app's routes in order: the page's and the docs' come last, so an API request never looks
    at them (and they bring no middleware: create_app adds none for them)."""
    from vitserve.service.app import create_app
    from vitserve.service.http.routes import web

    routes = create_app(settings_for(tiny_onnx)).routes
    assert getattr(routes[-1], "original_router", None) is web.router
    assert all(getattr(r, "original_router", None) is not web.router for r in routes[:-1])


def test_every_web_file_is_package_data():
    """The serving image installs a wheel: each file the page needs must match setup.py's package data."""
    setup_call = next(node for node in ast.walk(ast.parse((REPO / "setup.py").read_text()))
                      if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    package_data = next(k.value for k in setup_call.keywords if k.arg == "package_data")
    patterns = ast.literal_eval(package_data)["vitserve.service"]
    served = {"index.html", *WEB_FILES}
    assert {"index.html", "app.js", "app.css", "favicon.svg", "samples/samples.json"} <= served
    assert [f for f in served if not any(fnmatch.fnmatch(f"web/{f}", p) for p in patterns)] == []


def test_samples_are_fashion_mnist_test_images():
    """Each sample is the test image its name says, unchanged, with its true label."""
    from vitserve.model.data import FASHION_MNIST_LABELS, read_idx

    data = Path("/usr/share/datasets/fashion-mnist")
    if not (data / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip("needs Debian's dataset-fashion-mnist")
    images, labels = read_idx(data / "t10k-images-idx3-ubyte.gz"), read_idx(data / "t10k-labels-idx1-ubyte.gz")
    samples = json.loads((WEB_DIR / "samples" / "samples.json").read_text())["samples"]
    assert sorted(s["label"] for s in samples) == sorted(FASHION_MNIST_LABELS)  # one of each class
    for sample in samples:
        index = int(re.fullmatch(r"Fashion-MNIST test image (\d+)", sample["source"]).group(1))
        stored = np.asarray(Image.open(WEB_DIR / "samples" / sample["file"]))
        assert stored.dtype == np.uint8 and np.array_equal(stored, images[index]), sample
        assert FASHION_MNIST_LABELS[labels[index]] == sample["label"]


# ---- in the browser
@pytest.fixture(scope="module")
def server(tiny_onnx):
    if _browser_missing():
        pytest.skip(_browser_missing())
    # its file has no measured accuracies (exported without --eval): its cheaper budgets served on purpose
    with uvicorn_server(tiny_onnx, "--max-upload-bytes", str(MAX_UPLOAD_BYTES), "--budget-unmeasured-rungs",
                        "true") as (url, _):
        yield url


@pytest.fixture(scope="module")
def browser():
    if _browser_missing():
        pytest.skip(_browser_missing())
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        chromium = driver.chromium.launch(executable_path=CHROMIUM)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    """A fresh page whose requests for any host but the server's are refused and recorded; at the end, none
    may have been made, and the page must have raised no error and broken no Content-Security-Policy rule."""
    context = browser.new_context(viewport={"width": 1280, "height": 960})
    page, outside, problems = context.new_page(), [], []

    def local_only(route):
        if urlparse(route.request.url).hostname == "127.0.0.1":
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    page.route("**/*", local_only)
    page.on("pageerror", lambda error: problems.append(f"uncaught: {error}"))
    page.on("console", lambda m: problems.append(m.text) if "Content Security Policy" in m.text else None)
    yield page
    context.close()
    assert outside == [], f"the page asked for other hosts: {outside}"
    assert problems == []


# Every condition waited on is a function: Playwright evaluates an expression string anew at each poll with eval,
# which the page's Content-Security-Policy refuses (rightly) once the first try is over.


def opened(page, url: str):
    """The page at `url`, once it shows its model card and its samples (as the docs' pictures open it)."""
    screenshots.open_page(page, url)
    return page


def answered(page, action) -> dict:
    """Do `action`, then wait for the page to show the answer of the /v1/classify request it caused; returns
    that request's query and the answer's JSON."""
    before = page.evaluate("Number(document.getElementById('result').dataset.answers || 0)")
    with page.expect_response(lambda r: "/v1/classify" in r.url) as response:
        action()
    page.wait_for_function("n => Number(document.getElementById('result').dataset.answers || 0) > n", arg=before)
    query = {k: v[0] for k, v in parse_qs(urlparse(response.value.url).query).items()}
    return {"query": query, "status": response.value.status, "body": response.value.json()}


@needs_browser
@pytest.mark.slow
def test_page_asks_for_a_cheaper_budget_and_says_the_answer_used_one(page, server):
    opened(page, server)
    assert "16, 9, 4 tokens; cheaper under load" in page.inner_text("#card-fields")
    upload(page, "pattern.png", patterned_png(PATTERN_SIZE), "image/png")
    page.wait_for_function("() => document.getElementById('result').dataset.answers > 0")
    assert page.locator("#budget").is_hidden()  # the full budget: nothing to say
    result = answered(page, lambda: page.select_option("#max-tokens", "9"))
    assert result["query"]["max_tokens"] == "9" and result["body"]["budget"]["tokens"] == 9
    assert page.inner_text("#budget") == ("Answered at a reduced token budget because the request asked for it "
                                          "(max_tokens): 9 of 16 tokens (a 24x24 input).")


def upload(page, name: str, data: bytes, mime: str):
    page.set_input_files("#file", files=[{"name": name, "mimeType": mime, "buffer": data}])


def canvas(page) -> np.ndarray:
    """The image canvas's pixels, (H, W, 3)."""
    return canvas_pixels(page, "view")[..., :3]


def canvas_pixels(page, element_id: str) -> np.ndarray:
    """A canvas's pixels, (H, W, 4), read back through a lossless PNG."""
    url = page.evaluate("id => document.getElementById(id).toDataURL('image/png')", element_id)
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGBA")).astype(int)


def set_opacity(page, key: str, shown: str):
    """Move the opacity slider from the keyboard (Home: 0%, End: 100%) and wait for it to be drawn."""
    page.focus("#opacity")
    page.keyboard.press(key)
    page.wait_for_function("shown => document.getElementById('opacity-value').textContent === shown", arg=shown)


def assert_map_drawn(pixels: np.ndarray, grid: dict, box: tuple[int, int, int, int], scale: float):
    """At 100% opacity the centre of each patch of `box` (image pixels; the canvas draws them `scale` times larger)
    has the ramp colour of that patch's value."""
    values = np.array(grid["values"])
    assert values.shape == (grid["height"], grid["width"]) and values.max() == 1.0
    cell_w, cell_h = (box[2] - box[0]) * scale / grid["width"], (box[3] - box[1]) * scale / grid["height"]
    for (row, col), value in np.ndenumerate(values):
        x, y = int(box[0] * scale + (col + 0.5) * cell_w), int(box[1] * scale + (row + 0.5) * cell_h)
        expected = ramp_colors(np.array(value))
        assert np.abs(pixels[y, x] - expected).max() <= 4, (row, col, pixels[y, x], expected)


@needs_browser
@pytest.mark.slow
def test_page_classifies_an_upload_and_draws_the_map_over_it(page, server):
    opened(page, server)
    card = page.inner_text("#card-fields")
    for shown in ("tiny-vit", "32×32 px, 3 channel(s)", "8 px", "50.00%", "CPUExecutionProvider", "rollout, relevance"):
        assert shown in card
    assert page.locator("#samples button").count() == 10
    source = np.asarray(Image.open(io.BytesIO(patterned_png(PATTERN_SIZE)))).astype(int)
    result = answered(page, lambda: upload(page, "pattern.png", patterned_png(PATTERN_SIZE), "image/png"))
    assert result["query"] == {"model": "tiny-vit", "top_k": "3", "map": "rollout", "map_format": "grid",
                               "resize": "fit"}
    assert page.locator("#model-row").is_hidden()  # one model: no picker
    body = result["body"]
    labels = [item.inner_text() for item in page.locator("#predictions li").all()]
    assert len(labels) == 3 and [f"{p['label']} ({p['index']})" in text for p, text in
                                 zip(body["predictions"], labels)] == [True] * 3
    (size, box) = fit_box(*PATTERN_SIZE, TINY["image"])
    assert page.inner_text("#geometry") == (f"fit: your 48×40 image → centre crop {box[2] - box[0]}×{box[3] - box[1]} "
                                            f"at ({box[0]}, {box[1]}), the rest dimmed in the picture → "
                                            f"{size[0]}×{size[1]} model input (4×4 patches of 8 px).")
    assert page.locator("#timing dt").count() == 6 and "Inference" in page.inner_text("#timing")
    assert "Attention rollout" in page.inner_text("#map-caption")
    page.screenshot(path=SCREENSHOTS / "web-rollout.png", full_page=True)

    scale = 384 / max(PATTERN_SIZE)
    set_opacity(page, "End", "100%")
    pixels = canvas(page)
    assert pixels.shape == (320, 384, 3)
    assert_map_drawn(pixels, body["rollout"], box, scale)
    # outside the crop: the image, dimmed to 40%
    assert np.abs(pixels[100, 10] - np.round(source[int(100 / scale), int(10 / scale)] * 0.4)).max() <= 2
    set_opacity(page, "Home", "0%")
    pixels = canvas(page)
    for y, x in ((5, 10), (20, 30), (39, 43)):  # inside the crop: the image itself, each pixel enlarged
        assert np.array_equal(pixels[int((y + 0.5) * scale), int((x + 0.5) * scale)], source[y, x])


@needs_browser
@pytest.mark.slow
def test_both_maps_are_drawn_side_by_side_from_two_answers(page, server):
    opened(page, server)
    answered(page, lambda: upload(page, "pattern.png", patterned_png(PATTERN_SIZE), "image/png"))
    assert page.locator("#view-relevance").is_hidden()
    seen = []
    page.on("response", lambda r: seen.append(r) if "/v1/classify" in r.url else None)
    before = page.evaluate("Number(document.getElementById('result').dataset.answers)")
    page.check("input[name=map][value=both]")
    page.wait_for_function("n => Number(document.getElementById('result').dataset.answers) > n", arg=before)
    by_map = {parse_qs(urlparse(r.url).query)["map"][0]: r.json() for r in seen}
    assert sorted(by_map) == ["relevance", "rollout"] and page.is_enabled("#target")
    assert page.get_attribute("#view", "data-drawn") == "rollout"
    assert page.get_attribute("#view-relevance", "data-drawn") == "relevance"
    caption = page.inner_text("#map-caption")
    top = by_map["relevance"]["relevance"]["target"]["label"]
    assert caption.startswith("Left: Attention rollout") and "Right: Relevance" in caption and f"of {top} (" in caption
    set_opacity(page, "End", "100%")
    scale, box = 384 / max(PATTERN_SIZE), fit_box(*PATTERN_SIZE, TINY["image"])[1]
    assert_map_drawn(canvas(page), by_map["rollout"]["rollout"], box, scale)
    assert_map_drawn(canvas_pixels(page, "view-relevance")[..., :3], by_map["relevance"]["relevance"], box, scale)
    page.screenshot(path=SCREENSHOTS / "web-both-maps.png", full_page=True)
    answered(page, lambda: page.check("input[name=map][value=rollout]"))
    assert page.locator("#view-relevance").is_hidden()


@needs_browser
@pytest.mark.slow
def test_switching_map_target_and_resize_asks_again(page, server):
    opened(page, server)
    answered(page, lambda: upload(page, "pattern.png", patterned_png(PATTERN_SIZE), "image/png"))
    assert page.is_disabled("#target")
    relevance = answered(page, lambda: page.check("input[name=map][value=relevance]"))
    assert relevance["query"]["map"] == "relevance" and "target" not in relevance["query"]
    top = relevance["body"]["predictions"][0]
    assert relevance["body"]["relevance"]["target"]["index"] == top["index"]
    assert page.is_enabled("#target") and f"of {top['label']} (" in page.inner_text("#map-caption")

    dog = answered(page, lambda: page.select_option("#target", "1"))
    assert dog["query"]["target"] == "1" and dog["body"]["relevance"]["target"]["label"] == "dog"
    assert "of dog (" in page.inner_text("#map-caption")
    set_opacity(page, "End", "100%")
    scale = 384 / max(PATTERN_SIZE)
    assert_map_drawn(canvas(page), dog["body"]["relevance"], fit_box(*PATTERN_SIZE, TINY["image"])[1], scale)
    page.screenshot(path=SCREENSHOTS / "web-relevance.png", full_page=True)

    native = answered(page, lambda: page.check("input[name=resize][value=native]"))
    width, height = native_size(*PATTERN_SIZE, TINY["patch"], TINY["max_tokens"])
    grid = native["body"]["relevance"]
    assert native["query"]["resize"] == "native" and (grid["width"], grid["height"]) == (width // 8, height // 8)
    assert page.inner_text("#geometry") == (f"native: your 48×40 image → {width}×{height} model input "
                                            f"({width // 8}×{height // 8} patches of 8 px), aspect ratio kept, "
                                            "nothing cropped.")
    assert_map_drawn(canvas(page), grid, (0, 0, *PATTERN_SIZE), scale)  # the whole image, corners included

    plain = answered(page, lambda: page.check("input[name=map][value=none]"))
    assert plain["query"]["map"] == "none" and plain["body"]["rollout"] is None
    assert page.inner_text("#map-caption") == "No map requested." and page.is_disabled("#target")
    source = np.asarray(Image.open(io.BytesIO(patterned_png(PATTERN_SIZE)))).astype(int)
    assert np.array_equal(canvas(page)[4::8, 4::8], source)  # the image alone, each pixel 8x8
    # without a map the page works the native size out itself: as the server does
    wide = (70, 19)
    buffer = io.BytesIO()
    Image.new("RGB", wide, (90, 140, 200)).save(buffer, "PNG")
    answered(page, lambda: upload(page, "wide.png", buffer.getvalue(), "image/png"))
    width, height = native_size(*wide, TINY["patch"], TINY["max_tokens"])
    assert f"→ {width}×{height} model input ({width // 8}×{height // 8} patches" in page.inner_text("#geometry")


# A file handed to the page the way a drop or a paste hands it: in a DataTransfer on the event.
_HAND_OVER = """([kind, b64]) => {
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0)), data = new DataTransfer();
    data.items.add(new File([bytes], `${kind}.png`, {type: "image/png"}));
    const event = kind === "dropped" ? new DragEvent("drop", {dataTransfer: data, bubbles: true, cancelable: true})
        : new ClipboardEvent("paste", {clipboardData: data, bubbles: true, cancelable: true});
    (kind === "dropped" ? document.getElementById("drop-zone") : document.body).dispatchEvent(event);
}"""


@needs_browser
@pytest.mark.slow
def test_a_dropped_or_pasted_image_is_classified(page, server):
    opened(page, server)
    data = base64.b64encode(patterned_png((40, 40))).decode()
    for kind in ("dropped", "pasted"):
        result = answered(page, lambda: page.evaluate(_HAND_OVER, [kind, data]))
        assert result["status"] == 200 and page.inner_text("#status").startswith(f"{kind}.png: ")
        assert page.get_attribute("#view", "data-drawn") == "rollout"


@needs_browser
@pytest.mark.slow
def test_server_errors_are_shown_as_readable_messages(page, server):
    opened(page, server)
    text = answered(page, lambda: upload(page, "notes.txt", b"not a picture\n", "text/plain"))
    assert text["status"] == 415
    error = page.locator("#error")
    assert error.is_visible() and error.get_attribute("role") == "alert"
    assert error.inner_text() == ("This file is not an image type the server accepts (JPEG, PNG, WebP, BMP, GIF or "
                                  "TIFF) (HTTP 415, unsupported_media_type): file 'notes.txt' has content type "
                                  "'text/plain', not an image")
    assert page.locator("#predictions li").count() == 0
    assert page.get_attribute("#view", "data-drawn") == "nothing"
    page.screenshot(path=SCREENSHOTS / "web-415.png", full_page=True)

    noise = np.random.default_rng(0).integers(0, 256, (300, 300, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noise).save(buffer, "PNG")
    assert len(buffer.getvalue()) > MAX_UPLOAD_BYTES
    big = answered(page, lambda: upload(page, "noise.png", buffer.getvalue(), "image/png"))
    assert big["status"] == 413
    assert error.inner_text().startswith("The image is too large for this server (HTTP 413, payload_too_large): ")

    answered(page, lambda: upload(page, "pattern.png", patterned_png(PATTERN_SIZE), "image/png"))
    assert not error.is_visible() and page.locator("#predictions li").count() == 3  # the next image clears it


@needs_browser
@pytest.mark.slow
def test_docs_render_every_operation_with_other_hosts_blocked(page, server):
    import httpx

    spec = httpx.get(f"{server}/openapi.json").json()
    operations = sum(len(methods) for methods in spec["paths"].values())
    page.goto(f"{server}/docs")
    page.wait_for_function("n => document.querySelectorAll('.opblock').length === n", arg=operations)
    assert page.locator(".opblock-summary-path", has_text=re.compile(r"^/v1/classify$")).count() == 1
    assert page.locator("link[rel~='icon']").get_attribute("href") == "/web/favicon.svg"
    page.screenshot(path=SCREENSHOTS / "docs.png")


@pytest.fixture(scope="module")
def default_server():
    """`vitserve serve` of the bundled model, on ONNX Runtime float32 as `make screenshots` serves it."""
    if _browser_missing():
        pytest.skip(_browser_missing())
    if not DEFAULT_MODEL.is_file():
        pytest.skip("needs the bundled model (models/vit-fmnist/model.onnx)")
    with uvicorn_server(DEFAULT_MODEL) as (url, _):
        yield url


@needs_browser
@pytest.mark.slow
def test_the_default_model_from_a_sample_by_keyboard(page, default_server):
    """The bundled model on its own samples, driven from the keyboard."""
    opened(page, default_server)
    sample = page.get_by_role("button", name=re.compile(r"^Sample: Ankle boot"))
    sample.focus()
    boot = answered(page, lambda: page.keyboard.press("Enter"))
    assert boot["body"]["predictions"][0]["label"] == "Ankle boot"
    assert page.inner_text("#predictions li >> nth=0").startswith("Ankle boot (9)")
    answered(page, lambda: page.check("input[name=map][value=relevance]"))
    assert "of Ankle boot (" in page.inner_text("#map-caption")
    # the card says how the scores are calibrated (the file's temperature per answer), the answer its OOD score
    trouser = answered(page, lambda: page.get_by_role("button", name=re.compile(r"^Sample: Trouser")).click())
    assert trouser["body"]["predictions"][0]["label"] == "Trouser"
    assert "calibrated (a temperature per answer, by its uncertainty): calibration error 7.3% → 1.4%" in \
        page.inner_text("#card-fields")
    assert "Like the training images. Out-of-distribution score" in page.inner_text("#ood")
    # a photo is no garment: the answer says so beside its (cooled) confidence
    from skimage import data as skimage_data

    buffer = io.BytesIO()
    Image.fromarray(skimage_data.astronaut()).save(buffer, "PNG")
    photo = answered(page, lambda: upload(page, "astronaut.png", buffer.getvalue(), "image/png"))
    assert photo["body"]["ood"]["outside"] is True
    assert "Unlike the training images" in page.inner_text("#ood")


def same_text_to_the_last_digit(now: str, recorded: str) -> bool:
    """Equal text, whole numbers equal, and each decimal within one unit of its last shown digit of the recorded one:
    ONNX Runtime's kernels differ by instruction set, so a score at a rounding boundary may round the other way on
    another CPU."""
    decimals = re.compile(r"\d+\.(\d+)")
    if decimals.sub("#", now) != decimals.sub("#", recorded):
        return False
    return all(abs(float(a.group()) - float(b.group())) <= 10.0 ** -len(b.group(1)) * 1.001
               for a, b in zip(decimals.finditer(now), decimals.finditer(recorded)))


def differences(now, recorded, where: str = "") -> list[str]:
    """Where two records (JSON values) differ, but for numbers within their last shown digit."""
    if isinstance(now, dict) and isinstance(recorded, dict) and now.keys() == recorded.keys():
        return [d for key in now for d in differences(now[key], recorded[key], f"{where}.{key}")]
    if isinstance(now, list) and isinstance(recorded, list) and len(now) == len(recorded):
        return [d for i, pair in enumerate(zip(now, recorded)) for d in differences(*pair, f"{where}[{i}]")]
    if isinstance(now, str) and isinstance(recorded, str) and same_text_to_the_last_digit(now, recorded):
        return []
    return [] if now == recorded else [f"{where}: the page shows {now!r}, the record says {recorded!r}"]


def test_text_to_the_last_digit_tells_a_changed_figure_from_a_rounding():
    assert same_text_to_the_last_digit("Shirt, 88.6%. Score 764.7", "Shirt, 88.6%. Score 764.6")
    assert not same_text_to_the_last_digit("Shirt, 88.6%. Score 764.7", "Shirt, 88.6%. Score 764.5")
    assert not same_text_to_the_last_digit("Ankle boot, 99.2%.", "Ankle boot, 90.9%.")
    assert not same_text_to_the_last_digit("Shirt, 88.6%.", "Bag, 88.6%.")
    assert not same_text_to_the_last_digit("on 5000 held-out images", "on 5001 held-out images")
    assert differences({"a": ["0.1%", "b"]}, {"a": ["0.2%", "b"]}) == []
    assert differences({"a": ["8 px"]}, {"a": ["7 px"]}) == [".a[0]: the page shows '8 px', the record says '7 px'"]


@needs_browser
@pytest.mark.slow
def test_the_docs_pictures_of_the_page_show_it_as_it_is(page, default_server):
    """`make screenshots` took the docs' pictures of the page (the README's docs/web-page.png among them) and recorded
    in docs/web-page.json what each shows; the page, driven through the same steps now, shows the same, and each
    picture in docs/ is the one that run took. A page or a model changed since then fails here."""

    record = json.loads((REPO / "docs" / screenshots.RECORD).read_text())
    rerun = "run `make screenshots` (python -m vitserve.bench.screenshots --out docs) and commit docs/web-*.png and "
    rerun += "docs/web-page.json"
    assert [shot["file"] for shot in record["shots"]] == ["web-page.png", "web-calibrated.png", "web-ood.png"]
    assert "](docs/web-page.png)" in (REPO / "README.md").read_text()
    for shot in record["shots"]:
        picture = (REPO / "docs" / shot["file"]).read_bytes()
        assert hashlib.sha256(picture).hexdigest() == shot["sha256"], \
            f"docs/{shot['file']} is not the picture that docs/web-page.json describes: {rerun}"
    now = screenshots.take(page, default_server, out=None)
    recorded = [{k: v for k, v in shot.items() if k != "sha256"} for shot in record["shots"]]
    found = differences(now, recorded)
    assert found == [], f"the page no longer shows what its pictures in docs/ show: {rerun}\n" + "\n".join(found)


@pytest.fixture(scope="module")
def repository_server(tiny_onnx, tmp_path_factory):
    """Two models, one of them in two versions (policy all): the page's model picker."""
    if _browser_missing():
        pytest.skip(_browser_missing())
    root = tmp_path_factory.mktemp("web-repo")
    for name, version in (("shoes", 1), ("shoes", 2), ("shirts", 1)):
        (root / name / str(version)).mkdir(parents=True)
        shutil.copyfile(tiny_onnx, root / name / str(version) / "model.onnx")
    (root / "shoes" / "config.json").write_text(json.dumps({"version_policy": {"all": {}}, "maps": ["rollout"]}))
    with uvicorn_server(tiny_onnx, "--model-repository", str(root)) as (url, _):
        yield url


@needs_browser
@pytest.mark.slow
def test_the_model_picker_chooses_the_model_and_its_card_follows(page, repository_server):
    opened(page, repository_server)
    choices = page.locator("#model option").all_inner_texts()
    assert choices == ["shirts (newest: 1)", "shoes (newest: 2)", "shoes version 2", "shoes version 1"]
    assert page.locator("#model-row").is_visible()
    assert "shirts" in page.inner_text("#model-title")
    assert page.locator('input[name="map"][value="relevance"]').is_enabled()  # shirts offers both maps
    page.select_option("#model", label="shoes version 1")
    page.wait_for_function("() => document.getElementById('model-title').textContent.includes('shoes 1')")
    assert page.locator('input[name="map"][value="relevance"]').is_disabled()  # shoes' config: rollout only
    result = answered(page, lambda: upload(page, "pattern.png", patterned_png(PATTERN_SIZE), "image/png"))
    assert (result["query"]["model"], result["query"]["version"]) == ("shoes", "1")
    assert result["body"]["model"] == {"name": "shoes", "version": "1"}



@needs_browser
@pytest.mark.slow
def test_the_card_shows_what_the_model_learned(page, server):
    opened(page, server)
    page.wait_for_function("() => !document.getElementById('inspection').hidden")
    page.click("#inspection summary")
    inspection = httpx.get(server + "/v1/models/tiny-vit/inspect", params={"version": "7"}).json()
    tiles = page.locator("#inspection-filters canvas")
    assert tiles.count() == len(inspection["components"]) == 28
    assert tiles.first.get_attribute("title") == \
        f"component 1: {100 * inspection['explained_variance'][0]:.1f}% of the variance"
    about = page.inner_text("#inspection-about")
    assert "patch-embedding filters" in about and "17 images" in about and "2 layers of 2 heads" in about
    similarity = canvas_pixels(page, "inspection-similarity")
    cell = 240 // (4 * 5)  # a 4x4 grid of 4x4 tiles, a one-cell gap between tiles
    first_tile_self = similarity[cell // 2, cell // 2]  # position (0, 0) against itself: similarity 1
    assert first_tile_self[3] == 255 and np.abs(first_tile_self[:3] - ramp_colors(np.array(1.0))).max() <= 2
    dots = canvas_pixels(page, "inspection-distance")
    assert (dots[..., 3] > 0).sum() > 100  # the frame and a dot per head and layer
    page.screenshot(path=SCREENSHOTS / "web-inspection.png", full_page=True)
