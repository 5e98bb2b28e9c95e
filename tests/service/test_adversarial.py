"""Adversarial clients against one real `vitserve serve` process over TCP.

A corpus of bad requests made by code, for /v1/classify, /v1/classify/batch and the Open Inference infer route:
each is answered with its exact 4xx status and error code in the JSON error shape, within a bound that only a
hung server reaches, and a good request on a new connection right after is still served. Good-but-unusual
inputs (16-bit, alpha, palette, CMYK, animated, at the limits) must be served. Raw-socket clients hang up
mid-upload, stall, trickle, and keep their connection alive after an error.

Limits are set small (FLAGS) so that every one of them is cheap to reach. Tests wait on conditions, never on
the clock; time bounds are generous on the slow side and exact on the early side (a timer never fires early).
"""
from __future__ import annotations

import gzip
import io
import json
import struct
import threading
import time
import zlib
from contextlib import ExitStack
from dataclasses import dataclass, field

import httpx
import numpy as np
import pytest
from PIL import Image

from service_fixtures import (PATIENCE_S, RawConnection, error_code, image_bytes, png_declaring, scrape, trickling,
                              uvicorn_server, value, wait_until)

UPLOAD_LIMIT = 200_000
PIXEL_LIMIT = 4_000_000
BATCH_FILES = 4
JSON_LIMIT = 100_000
JSON_VALUES = 10_000
DEADLINE_S = 5.0
HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 2.0
HEADER_BYTES = 8192
MAX_HEADERS = 50
FLAGS = ("--max-upload-bytes", str(UPLOAD_LIMIT), "--max-image-pixels", str(PIXEL_LIMIT),
         "--max-batch-files", str(BATCH_FILES), "--max-json-body-bytes", str(JSON_LIMIT),
         "--request-timeout-ms", str(int(DEADLINE_S * 1000)), "--header-timeout-s", str(HEADER_TIMEOUT_S),
         "--body-timeout-s", str(BODY_TIMEOUT_S), "--max-header-bytes", str(HEADER_BYTES),
         "--max-headers", str(MAX_HEADERS), "--max-json-values", str(JSON_VALUES))
# Every answer comes within this, however loaded the machine: it catches hangs, it is not a speed target.
ANSWER_BOUND_S = 10.0
LATE_S = 5.0  # how late past its time a timer may fire on a busy machine before the test calls it hung
# The code a malformed HTTP request gets (service.ground.errors.MalformedRequest).
MALFORMED_HTTP_CODE = "invalid_request"




# --- the server ---

class ServerOutput:
    """The server's stdout and stderr, drained by a thread (a full pipe would block its logging)."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._drain, args=(stream,), daemon=True)
        self._thread.start()

    def _drain(self, stream) -> None:
        for line in iter(stream.readline, b""):
            self.lines.append(line.decode(errors="replace"))

    def text(self) -> str:
        return "".join(self.lines)

    def finish(self) -> str:
        """Everything, once the process has exited."""
        self._thread.join(PATIENCE_S)
        return self.text()


@dataclass
class Server:
    url: str
    port: int
    model: str
    labels: list[str]
    output: ServerOutput


@pytest.fixture(scope="module")
def server(tiny_onnx):
    with uvicorn_server(tiny_onnx, *FLAGS) as (url, process):
        output = ServerOutput(process.stdout)
        card = httpx.get(f"{url}/v1/model", timeout=PATIENCE_S).json()
        yield Server(url, int(url.rsplit(":", 1)[1]), card["name"], card["labels"], output)
    text = output.finish()
    assert "Traceback" not in text, f"the server logged a traceback:\n{text}"


# --- inputs ---

def noise_image(fmt: str, size=(32, 32), mode="RGB", **save) -> bytes:
    """A non-constant image, so that any cut through it removes pixel data."""
    pixels = np.random.default_rng(7).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, fmt, **save)
    return buffer.getvalue()


GOOD_PNG = noise_image("PNG")
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp",
           "TIFF": "image/tiff", "BMP": "image/bmp"}


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def flipped(data: bytes, at: int) -> bytes:
    """`data` with the byte at `at` inverted."""
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


def png_of_size(total: int) -> bytes:
    """GOOD_PNG padded with a text chunk to exactly `total` bytes."""
    padding = total - len(GOOD_PNG) - 12  # a chunk's length, type and CRC
    return GOOD_PNG[:33] + png_chunk(b"tEXt", b"c\0" + b"x" * (padding - 2)) + GOOD_PNG[33:]


def gif_declaring(width: int, height: int) -> bytes:
    """A small GIF whose logical screen (the size Pillow reports) is width x height."""
    data = image_bytes("GIF", size=(32, 32))
    return data[:6] + struct.pack("<HH", width, height) + data[10:]


def jpeg_declaring(width: int, height: int) -> bytes:
    data = image_bytes("JPEG", size=(32, 32))
    sof = data.index(b"\xff\xc0") + 5  # marker, length, precision, then height and width
    return data[:sof] + struct.pack(">HH", height, width) + data[sof + 4:]


def bmp_declaring(width: int, height: int) -> bytes:
    data = image_bytes("BMP", size=(32, 32))
    return data[:18] + struct.pack("<ii", width, height) + data[26:]


def webp_declaring(width: int, height: int) -> bytes:
    """A lossless WebP whose VP8L header declares width x height (14 bits each, stored minus one)."""
    data = image_bytes("WEBP", size=(32, 32), lossless=True)
    kept = int.from_bytes(data[21:25], "little") & ~(2**28 - 1)  # alpha hint and version bits
    return data[:21] + ((width - 1) | (height - 1) << 14 | kept).to_bytes(4, "little") + data[25:]


def tiff_declaring(width: int, height: int) -> bytes:
    data = bytearray(image_bytes("TIFF", size=(32, 32)))
    ifd = struct.unpack("<I", data[4:8])[0]
    for entry in range(struct.unpack("<H", data[ifd:ifd + 2])[0]):
        at = ifd + 2 + 12 * entry
        tag, kind = struct.unpack("<HH", data[at:at + 4])
        if tag in (256, 257):  # ImageWidth, ImageLength: SHORT or LONG
            size = width if tag == 256 else height
            data[at + 8:at + 12] = struct.pack("<HH", size, 0) if kind == 3 else struct.pack("<I", size)
    return bytes(data)


BOUNDARY = "adversarial-boundary"


def multipart(*parts: tuple[str, str | None, str | None, bytes], boundary=BOUNDARY, closed=True) -> bytes:
    """A multipart body of (field name, file name or None for a text field, part content type, data) parts."""
    body = b""
    for name, filename, content_type, data in parts:
        body += f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"'.encode()
        body += f'; filename="{filename}"'.encode() if filename is not None else b""
        body += f"\r\nContent-Type: {content_type}".encode() if content_type else b""
        body += b"\r\n\r\n" + data + b"\r\n"
    return body + (f"--{boundary}--\r\n".encode() if closed else b"")


def png_part(data: bytes = GOOD_PNG, name="file", filename="a.png", content_type="image/png"):
    return name, filename, content_type, data


def tensor(**changes) -> dict:
    """A good `pixel_values` tensor for the tiny model (3 channels, one 8x8 patch), with `changes`."""
    return {"name": "pixel_values", "shape": [1, 3, 8, 8], "datatype": "FP32", "data": [0.0] * 192, **changes}


def infer_body(**changes) -> bytes:
    return json.dumps({"inputs": [tensor(**changes)]}).encode()


# --- requests and answers ---

MULTIPART = (("content-type", f"multipart/form-data; boundary={BOUNDARY}"),)
JSON = (("content-type", "application/json"),)
INFER = "/v2/models/{model}/infer"  # {model}: the served model's name


def typed(content_type: str) -> tuple:
    return (("content-type", content_type),)


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    chunked: bool = False  # sent with Transfer-Encoding: chunked, in 16 KiB pieces
    raw: bytes | None = None  # sent as it is over a socket instead (what httpx would not send)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    seconds: float
    path: str = ""  # of the request: /v2 errors have the Open Inference Protocol's shape

    def error(self) -> dict:
        """The error's code and message, once its body is checked to have its protocol's shape."""
        assert self.headers.get("content-type", "").startswith("application/json"), (self.headers, self.body)
        document = json.loads(self.body)
        code = error_code(self.path, document)
        return {"code": code, "message": document["error"] if code == document.get("code") else
                document["error"]["message"]}


def request_path(raw: bytes) -> str:
    """The path of a raw request's request line ('' when it has none)."""
    parts = raw.split(b"\r\n", 1)[0].split(b" ")
    return parts[1].split(b"?", 1)[0].decode("latin-1") if len(parts) > 1 else ""


def send(server: Server, request: Request) -> Reply:
    """One request on a new connection."""
    started = time.monotonic()
    if request.raw is not None:
        status, headers, body = raw_exchange(server.port, request.raw)
        return Reply(status, headers, body, time.monotonic() - started, request_path(request.raw))
    content = request.body
    if request.chunked:
        content = iter([request.body[i:i + 16384] for i in range(0, len(request.body), 16384)])
    with httpx.Client(timeout=ANSWER_BOUND_S + LATE_S) as client:
        response = client.request(request.method, server.url + request.path.format(model=server.model),
                                  headers=dict(request.headers), content=content)
    return Reply(response.status_code, dict(response.headers), response.content, time.monotonic() - started,
                 response.request.url.path)


def raw_exchange(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    with RawConnection(port) as connection:
        connection.send(data)
        return connection.response()


def head(method: str, path: str, *headers: str, body: bytes = b"", close=True) -> bytes:
    """A request's bytes, as written (nothing checked or added but Host, and Connection: close)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: vitserve", *headers, *(["Connection: close"] if close else [])]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def classify_head(length: int, content_type="image/png", path="/v1/classify", close=False) -> bytes:
    return head("POST", path, f"Content-Type: {content_type}", f"Content-Length: {length}", close=close)


def good_classify(server: Server) -> list[dict]:
    """A good request on a new connection: 200 with every class's prediction."""
    response = httpx.post(f"{server.url}/v1/classify", content=GOOD_PNG, headers={"content-type": "image/png"},
                          timeout=ANSWER_BOUND_S + LATE_S)
    assert response.status_code == 200, response.text
    return check_predictions(server, response.json())


def check_predictions(server: Server, answer: dict) -> list[dict]:
    predictions = answer["predictions"]
    assert sorted(p["label"] for p in predictions) == sorted(server.labels)  # top_k 5, capped at 3 classes
    assert sum(p["score"] for p in predictions) == pytest.approx(1.0, abs=1e-4)
    return predictions


# --- the corpus ---

@dataclass(frozen=True)
class Bad:
    request: Request
    status: int
    code: str
    marks: tuple = field(default=())


def classify_raw(data: bytes, content_type="image/png", query="", **changes) -> Request:
    return Request("POST", "/v1/classify" + query, typed(content_type), data, **changes)


def not_images() -> dict[str, Bad]:
    random_bytes = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    cases = {
        "empty-body": Bad(classify_raw(b""), 400, "invalid_image"),
        "random-bytes": Bad(classify_raw(random_bytes), 400, "invalid_image"),
        "text-as-png": Bad(classify_raw(b"this is not an image\n" * 20), 400, "invalid_image"),
        "svg-as-png": Bad(classify_raw(b'<svg xmlns="http://www.w3.org/2000/svg" width="32" height="32"/>'),
                          400, "invalid_image"),
        "pdf-as-jpeg": Bad(classify_raw(b"%PDF-1.4\n" + random_bytes, "image/jpeg"), 400, "invalid_image"),
        "zip-as-webp": Bad(classify_raw(b"PK\x03\x04" + random_bytes, "image/webp"), 400, "invalid_image"),
    }
    for fmt in ("ICO", "TGA", "PCX", "PPM"):  # Pillow reads them; the service does not take them
        cases[f"{fmt.lower()}-image"] = Bad(classify_raw(image_bytes(fmt, size=(32, 32))), 415,
                                            "unsupported_media_type")
    return cases


def truncated_images() -> dict[str, Bad]:
    """Each format cut at its first 8 bytes, a quarter, a half and nine tenths."""
    cases = {}
    for fmt, content_type in FORMATS.items():
        data = noise_image(fmt)
        for name, cut in (("8-bytes", 8), ("25pc", len(data) // 4), ("50pc", len(data) // 2),
                          ("90pc", len(data) * 9 // 10)):
            cases[f"{fmt.lower()}-cut-{name}"] = Bad(classify_raw(data[:cut], content_type), 400, "invalid_image")
    return cases


def corrupt_images() -> dict[str, Bad]:
    idat, bmp = GOOD_PNG.index(b"IDAT"), image_bytes("BMP", size=(32, 32))
    return {
        "png-bad-signature": Bad(classify_raw(flipped(GOOD_PNG, 0)), 400, "invalid_image"),
        "png-bad-ihdr-crc": Bad(classify_raw(flipped(GOOD_PNG, 29)), 400, "invalid_image"),
        "png-corrupt-idat-stream": Bad(classify_raw(flipped(GOOD_PNG, idat + 6)), 400, "invalid_image"),
        "png-declaring-0x0": Bad(classify_raw(png_declaring(0, 0)), 400, "invalid_image"),
        "jpeg-declaring-0x0": Bad(classify_raw(jpeg_declaring(0, 0), "image/jpeg"), 400, "invalid_image"),
        "bmp-7-bits-per-pixel": Bad(classify_raw(bmp[:28] + struct.pack("<H", 7) + bmp[30:], "image/bmp"), 400,
                                    "invalid_image"),
    }


def decompression_bombs() -> dict[str, Bad]:
    """Small files whose headers declare more pixels than the limit: refused from the header."""
    bombs = {"png-100000x100000": (png_declaring(100_000, 100_000), "image/png"),
             "png-one-row-over-the-limit": (png_declaring(2001, 2000), "image/png"),
             "gif-65535x65535": (gif_declaring(65535, 65535), "image/gif"),
             "jpeg-65500x65500": (jpeg_declaring(65500, 65500), "image/jpeg"),
             "bmp-100000x100000": (bmp_declaring(100_000, 100_000), "image/bmp"),
             "webp-16384x16384": (webp_declaring(16384, 16384), "image/webp"),
             "tiff-60000x60000": (tiff_declaring(60000, 60000), "image/tiff")}
    return {name: Bad(classify_raw(data, content_type), 413, "image_too_large")
            for name, (data, content_type) in bombs.items()}


def oversized_bodies() -> dict[str, Bad]:
    over = png_of_size(UPLOAD_LIMIT + 1)
    big_json = b'{"inputs": [' + b"0.0," * (JSON_LIMIT // 4) + b"0.0]}"
    # Past the multipart allowance (every file at the limit, plus 64 KiB of boundaries and part headers).
    batch_over = multipart(*[png_part(png_of_size(UPLOAD_LIMIT), filename=f"{i}.png") for i in range(4)],
                           png_part(b"\0" * 100_000, name="padding"))
    return {
        "image-one-byte-over-content-length": Bad(classify_raw(over), 413, "payload_too_large"),
        "image-over-limit-chunked": Bad(classify_raw(over, chunked=True), 413, "payload_too_large"),
        "multipart-part-over-limit": Bad(Request("POST", "/v1/classify", MULTIPART, multipart(png_part(over))),
                                         413, "payload_too_large"),
        "multipart-over-limit-chunked": Bad(Request("POST", "/v1/classify", MULTIPART,
                                                    multipart(png_part(b"\0" * 300_000)), chunked=True),
                                            413, "payload_too_large"),
        "batch-over-limit-content-length": Bad(Request("POST", "/v1/classify/batch", MULTIPART, batch_over),
                                               413, "payload_too_large"),
        "batch-over-limit-chunked": Bad(Request("POST", "/v1/classify/batch", MULTIPART, batch_over, chunked=True),
                                        413, "payload_too_large"),
        "infer-over-limit-content-length": Bad(Request("POST", INFER, JSON, big_json), 413, "payload_too_large"),
        "infer-over-limit-chunked": Bad(Request("POST", INFER, JSON, big_json, chunked=True), 413,
                                        "payload_too_large"),
    }


def content_types() -> dict[str, Bad]:
    cases = {f"classify-{name}": Bad(Request("POST", "/v1/classify", headers, GOOD_PNG), 415,
                                     "unsupported_media_type")
             for name, headers in (("application-json", JSON), ("text-plain", typed("text/plain")),
                                   ("none", ()), ("image-x-unknown", typed("image/x-unknown")),
                                   ("octet-stream", typed("application/octet-stream")))}
    cases["batch-application-json"] = Bad(Request("POST", "/v1/classify/batch", JSON, GOOD_PNG), 415,
                                          "unsupported_media_type")
    cases["multipart-text-part"] = Bad(Request("POST", "/v1/classify", MULTIPART, multipart(
        png_part(b"hello", filename="a.txt", content_type="text/plain"))), 415, "unsupported_media_type")
    return cases


def multipart_bodies() -> dict[str, Bad]:
    def on(path: str, body: bytes, headers=MULTIPART) -> Request:
        return Request("POST", path, headers, body)

    good = png_part()
    return {
        "multipart-no-file-field": Bad(on("/v1/classify", multipart(png_part(name="image"))), 422,
                                       "invalid_parameter"),
        "multipart-text-field-named-file": Bad(on("/v1/classify", multipart(("file", None, None, b"hello"))),
                                               422, "invalid_parameter"),
        "multipart-empty-body": Bad(on("/v1/classify", b""), 422, "invalid_parameter"),
        "multipart-wrong-boundary": Bad(on("/v1/classify", multipart(good, boundary="other")), 422,
                                        "invalid_parameter"),
        "multipart-no-boundary-parameter": Bad(on("/v1/classify", multipart(good),
                                                  typed("multipart/form-data")), 422, "invalid_parameter"),
        "multipart-no-closing-boundary": Bad(on("/v1/classify", multipart(good, closed=False)), 422,
                                             "invalid_parameter"),
        "multipart-garbage": Bad(on("/v1/classify", b"garbage" * 50), 422, "invalid_parameter"),
        "multipart-two-files-to-classify": Bad(on("/v1/classify", multipart(good, good)), 413, "payload_too_large"),
        "batch-too-many-files": Bad(on("/v1/classify/batch", multipart(*[good] * (BATCH_FILES + 1))), 413,
                                    "payload_too_large"),
        "batch-too-many-fields": Bad(on("/v1/classify/batch", multipart(
            *[(f"x{i}", None, None, b"1") for i in range(BATCH_FILES + 2)], good)), 422, "invalid_parameter"),
        "batch-no-file-field": Bad(on("/v1/classify/batch", multipart(("note", None, None, b"hi"))), 422,
                                   "invalid_parameter"),
    }


def query_parameters() -> dict[str, Bad]:
    cases = {}
    for query in ("top_k=0", "top_k=-1", "top_k=abc", "top_k=", "top_k=1.5", "top_k=1001",
                  "top_k=99999999999999999999999", "rollout=bogus", "rollout=PNG", "resize=bogus",
                  "top_k=2&top_k=abc", "top_k=%ff%fe"):
        cases[f"classify-{query}"] = Bad(classify_raw(GOOD_PNG, query="?" + query), 422, "invalid_parameter")
    cases["classify-top_k=abc&top_k=2"] = Bad(classify_raw(GOOD_PNG, query="?top_k=abc&top_k=2"), 422,
                                              "invalid_parameter")
    for query in ("top_k=0", "rollout=bogus", "resize=bogus"):
        cases[f"batch-{query}"] = Bad(Request("POST", f"/v1/classify/batch?{query}", MULTIPART,
                                              multipart(png_part())), 422, "invalid_parameter")
    return cases


def infer_bodies() -> dict[str, Bad]:
    def infer(body: bytes) -> Request:
        return Request("POST", INFER, JSON, body)

    ragged = [[[[0.0] * 8] * 8, [[0.0] * 8] * 7, [[0.0] * 8] * 8]]  # the second channel has 7 rows
    bodies = {
        "malformed-json": b'{"inputs": [',
        "empty-body": b"",
        "json-array": b"[]",
        "json-null": b"null",
        "no-inputs": b"{}",
        "empty-inputs": b'{"inputs": []}',
        "invalid-utf8": b'{"id": "\xff\xfe", "inputs": []}',
        "datatype-fp64": infer_body(datatype="FP64"),
        "datatype-bytes": infer_body(datatype="BYTES", data=["a"] * 192),
        "wrong-input-name": infer_body(name="image"),
        "nan": infer_body(data=[float("nan")] * 192),
        "infinity": infer_body(data=[float("inf")] * 192),
        "strings": infer_body(data=["a"] * 192),
        "numeric-strings": infer_body(data=["1.0"] * 192),
        "booleans": infer_body(data=[True] * 192),
        "nulls": infer_body(data=[None] * 192),
        "nested-ragged": infer_body(data=ragged),
        "nested-deeper-than-shape": infer_body(data=[[[[[0.0]]]]]),
        "outside-float32": infer_body(data=[1e300] * 192),
        "near-float32-max": infer_body(data=[3e38] * 192),
        "too-few-values": infer_body(data=[0.0] * 191),
        "shape-negative": infer_body(shape=[1, 3, -8, 8]),
        "shape-rank-3": infer_body(shape=[3, 8, 8]),
        "shape-wrong-channels": infer_body(shape=[3, 1, 8, 8]),
        "shape-not-patch-multiple": infer_body(shape=[1, 3, 7, 8], data=[0.0] * 168),
        "shape-string": infer_body(shape="1,3,8,8"),
        "batch-over-max-files": infer_body(shape=[BATCH_FILES + 1, 3, 8, 8], data=[0.0] * 192 * (BATCH_FILES + 1)),
        "unknown-output": json.dumps({"inputs": [tensor()], "outputs": [{"name": "features"}]}).encode(),
    }
    cases = {f"infer-{name}": Bad(infer(body), 400, "invalid_parameter") for name, body in bodies.items()}
    cases["infer-too-many-values"] = Bad(infer(infer_body(data=[0] * (JSON_VALUES + 1))), 413, "payload_too_large")
    # arrays count as values do (each costs the parse as much), before the parse
    cases["infer-nested-10000-deep"] = Bad(infer(b"[" * 10_000 + b"]" * 10_000), 413, "payload_too_large")
    cases["infer-wrong-model"] = Bad(Request("POST", "/v2/models/no-such-model/infer", JSON, infer_body()), 404,
                                     "model_not_found")
    cases["infer-model-name-unicode"] = Bad(Request("POST", "/v2/models/%C3%A9/infer", JSON, infer_body()), 404,
                                            "model_not_found")
    return cases


def binary_infer(header: dict, data: bytes, length: str | None = None, *headers: tuple[str, str]) -> Request:
    """An inference request with binary tensors: the JSON header, then `data`; `length` overrides the header length."""
    text = json.dumps(header).encode()
    return Request("POST", INFER, (("inference-header-content-length", length or str(len(text))), *headers),
                   text + data)


def as_json(document: dict) -> Request:
    return Request("POST", INFER, JSON, json.dumps(document).encode())


def image_tensor(shape: list[int], size: int) -> dict:
    return {"name": "image", "datatype": "BYTES", "shape": shape, "parameters": {"binary_data_size": size}}


def protocol_extensions() -> dict[str, Bad]:
    """The Open Inference Protocol's binary tensors, images, compression and classification, misused."""
    pixels = np.zeros((1, 3, 8, 8), np.float32)
    binary = tensor(parameters={"binary_data_size": pixels.nbytes})
    del binary["data"]
    with_nan = pixels.copy()
    with_nan.flat[5] = np.nan
    png = struct.pack("<I", len(GOOD_PNG)) + GOOD_PNG
    wide, tall = (struct.pack("<I", len(p)) + p for p in (image_bytes("PNG", (16, 8)), image_bytes("PNG", (8, 16))))
    bomb = gzip.compress(b" " * (4 * JSON_LIMIT))
    invalid, too_large = (400, "invalid_parameter"), (413, "payload_too_large")
    cases = {
        "header-length-past-body": (binary_infer({"inputs": [binary]}, pixels.tobytes(), "100000"), invalid),
        "header-length-not-a-number": (binary_infer({"inputs": [binary]}, pixels.tobytes(), "12abc"), invalid),
        "binary-shorter-than-declared": (binary_infer({"inputs": [binary]}, pixels.tobytes()[:700]), invalid),
        "binary-longer-than-declared": (binary_infer({"inputs": [binary]}, pixels.tobytes() + b"\0" * 32), invalid),
        "binary-size-negative": (binary_infer({"inputs": [{**binary, "parameters": {"binary_data_size": -1}}]}, b""),
                                 invalid),
        "binary-and-json-data": (binary_infer({"inputs": [{**binary, "data": [0.0] * 192}]}, pixels.tobytes()),
                                 invalid),
        "binary-nan": (binary_infer({"inputs": [binary]}, with_nan.tobytes()), invalid),
        "bytes-length-past-the-data": (binary_infer({"inputs": [image_tensor([1], 8)]}, b"\xff\xff\x00\x00abcd"),
                                       invalid),
        "bytes-fewer-than-the-shape": (binary_infer({"inputs": [image_tensor([2], len(png))]}, png), invalid),
        "bytes-element-over-upload-limit": (binary_infer({"inputs": [image_tensor([1], 8)]},
                                                         struct.pack("<I", UPLOAD_LIMIT + 1) + b"abcd"), too_large),
        "images-over-max-files": (binary_infer({"inputs": [image_tensor([BATCH_FILES + 1], len(png) * 5)]}, png * 5),
                                  too_large),
        "image-not-an-image": (binary_infer({"inputs": [image_tensor([2], len(png) + 9)]},
                                            png + struct.pack("<I", 5) + b"hello"), (400, "invalid_image")),
        "images-native-of-different-sizes": (binary_infer({"inputs": [image_tensor([2], len(wide) * 2)],
                                                           "parameters": {"resize": "native"}}, wide + tall), invalid),
        "image-as-base64-garbage": (as_json({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                                                       "data": ["%%%"]}]}), invalid),
        "classification-string": (as_json({"inputs": [tensor()], "outputs": [
            {"name": "logits", "parameters": {"classification": "3"}}]}), invalid),
        "gzip-bomb": (Request("POST", INFER, (("content-encoding", "gzip"),), bomb), too_large),
        "gzip-garbage": (Request("POST", INFER, (("content-encoding", "gzip"),), infer_body()), invalid),
        "content-encoding-br": (Request("POST", INFER, (("content-encoding", "br"),), infer_body()),
                                (415, "unsupported_media_type")),
    }
    ico = image_bytes("ICO", size=(32, 32))
    cases["image-ico"] = (binary_infer({"inputs": [image_tensor([1], len(ico) + 4)]},
                                       struct.pack("<I", len(ico)) + ico), (415, "unsupported_media_type"))
    return {f"oip-{name}": Bad(request, status, code) for name, (request, (status, code)) in cases.items()}


def routes() -> dict[str, Bad]:
    return {
        "get-classify": Bad(Request("GET", "/v1/classify"), 405, "method_not_allowed"),
        "get-batch": Bad(Request("GET", "/v1/classify/batch"), 405, "method_not_allowed"),
        "get-infer": Bad(Request("GET", INFER), 405, "method_not_allowed"),
        "put-classify": Bad(Request("PUT", "/v1/classify", typed("image/png"), GOOD_PNG), 405, "method_not_allowed"),
        "delete-model-card": Bad(Request("DELETE", "/v1/model"), 405, "method_not_allowed"),
        "unknown-path": Bad(Request("GET", "/v1/nothing-here"), 404, "not_found"),
        "post-unknown-path": Bad(Request("POST", "/v3/classify", typed("image/png"), GOOD_PNG), 404, "not_found"),
        "unknown-model-metadata": Bad(Request("GET", "/v2/models/no-such-model"), 404, "model_not_found"),
    }


def http_heads() -> dict[str, Bad]:
    """What only a raw socket sends: heads over the limits, and malformed HTTP."""
    def raw(data: bytes) -> Request:
        return Request("RAW", "", raw=data)

    def chunked_png(*trailer: str) -> Request:  # GOOD_PNG in one chunk, then trailer fields (RFC 9112, 7.1.2)
        return raw(head("POST", "/v1/classify", "Content-Type: image/png", "Transfer-Encoding: chunked",
                        body=b"%x\r\n%s\r\n0\r\n%s\r\n" % (len(GOOD_PNG), GOOD_PNG,
                                                            "".join(f"{t}\r\n" for t in trailer).encode())))

    many = [f"X-Field-{i}: {i}" for i in range(MAX_HEADERS)]  # with Host and Connection: past the limit
    return {
        "header-value-over-limit": Bad(raw(head("GET", "/v1/model", "X-Big: " + "a" * (2 * HEADER_BYTES))), 431,
                                       "headers_too_large"),
        "too-many-headers": Bad(raw(head("GET", "/v1/model", *many)), 431, "headers_too_large"),
        "host-over-limit": Bad(raw(head("GET", "/v1/model").replace(b"vitserve", b"h" * (2 * HEADER_BYTES))), 431,
                               "headers_too_large"),
        "url-over-limit": Bad(raw(head("GET", "/v1/model?pad=" + "a" * (2 * HEADER_BYTES))), 414, "uri_too_long"),
        "trailer-over-header-limit": Bad(chunked_png("X-Big: " + "a" * (2 * HEADER_BYTES)), 431, "headers_too_large"),
        "too-many-trailer-fields": Bad(chunked_png(*many), 431, "headers_too_large"),
        "garbage-request-line": Bad(raw(b"GARBAGE\r\n\r\n"), 400, MALFORMED_HTTP_CODE),
        "content-length-not-a-number": Bad(raw(head("POST", "/v1/classify", "Content-Type: image/png",
                                                    "Content-Length: abc")), 400, MALFORMED_HTTP_CODE),
        "content-length-and-chunked": Bad(raw(head("POST", "/v1/classify", "Content-Type: image/png",
                                                   "Content-Length: 5", "Transfer-Encoding: chunked",
                                                   body=b"5\r\nabcde\r\n0\r\n\r\n")), 400, MALFORMED_HTTP_CODE),
        "bad-chunk-size": Bad(raw(head("POST", "/v1/classify", "Content-Type: image/png",
                                       "Transfer-Encoding: chunked", body=b"zz\r\nabcde\r\n0\r\n\r\n")), 400,
                              MALFORMED_HTTP_CODE),
    }


CORPUS = {**not_images(), **truncated_images(), **corrupt_images(), **decompression_bombs(), **oversized_bodies(),
          **content_types(), **multipart_bodies(), **query_parameters(), **infer_bodies(), **protocol_extensions(),
          **routes(), **http_heads()}


def test_the_corpus_is_large_and_every_case_distinct():
    assert len(CORPUS) >= 60
    requests = [(bad.request.method, bad.request.path, bad.request.headers, bad.request.body, bad.request.chunked,
                 bad.request.raw) for bad in CORPUS.values()]
    assert len(set(requests)) == len(requests)


@pytest.mark.parametrize("bad", [pytest.param(bad, id=name, marks=bad.marks) for name, bad in CORPUS.items()])
def test_a_bad_request_gets_its_error_and_the_server_serves_on(server, bad: Bad):
    reply = send(server, bad.request)
    assert reply.status == bad.status, reply.body[:300]
    assert reply.error()["code"] == bad.code
    assert reply.seconds < ANSWER_BOUND_S
    good_classify(server)


# --- good inputs that look odd: served ---

def _exactly_the_pixel_limit() -> bytes:
    return image_bytes("PNG", size=(2000, PIXEL_LIMIT // 2000))  # one colour: small in bytes


def _animated(fmt: str) -> bytes:
    frames = [Image.new("RGB", (32, 32), (80 * i, 20, 200)) for i in range(3)]
    buffer = io.BytesIO()
    frames[0].save(buffer, fmt, save_all=True, append_images=frames[1:])
    return buffer.getvalue()


UNUSUAL_GOOD = {
    "png-16-bit-grey": (image_bytes("PNG", size=(32, 32), mode="I;16", color=40000), "image/png", ""),
    "png-rgba": (noise_image("PNG", mode="RGBA"), "image/png", ""),
    "png-grey-alpha": (noise_image("PNG", mode="LA"), "image/png", ""),
    "png-palette": (noise_image("PNG", mode="P"), "image/png", ""),
    "png-1-bit": (noise_image("PNG", mode="1"), "image/png", ""),
    "png-1x1": (image_bytes("PNG", size=(1, 1)), "image/png", ""),
    "png-1x4000-native": (image_bytes("PNG", size=(1, 4000)), "image/png", "?resize=native"),
    "png-exactly-the-byte-limit": (png_of_size(UPLOAD_LIMIT), "image/png", ""),
    "png-exactly-the-pixel-limit": (_exactly_the_pixel_limit(), "image/png", "?rollout=overlay"),
    "jpeg-grey": (noise_image("JPEG", mode="L"), "image/jpeg", ""),
    "jpeg-cmyk": (noise_image("JPEG", mode="CMYK"), "image/jpeg", "?rollout=png"),
    "jpeg-progressive": (noise_image("JPEG", progressive=True), "image/jpeg", ""),
    "tiff-16-bit": (image_bytes("TIFF", size=(32, 32), mode="I;16", color=65535), "image/tiff", ""),
    "tiff-multipage": (_animated("TIFF"), "image/tiff", ""),
    "gif-animated": (_animated("GIF"), "image/gif", ""),
    "webp-rgba": (noise_image("WEBP", mode="RGBA"), "image/webp", "?rollout=none"),
    "bmp-top-down": (bmp_declaring(32, -32), "image/bmp", ""),
}


@pytest.mark.parametrize("data, content_type, query", UNUSUAL_GOOD.values(), ids=UNUSUAL_GOOD.keys())
def test_an_unusual_but_valid_image_is_served(server, data, content_type, query):
    reply = send(server, classify_raw(data, content_type, query))
    assert reply.status == 200, reply.body[:300]
    check_predictions(server, json.loads(reply.body))


@pytest.mark.parametrize("part", [png_part(content_type="application/octet-stream"), png_part(content_type=None),
                                  png_part(filename="")], ids=["octet-stream-part", "untyped-part", "no-filename"])
def test_an_unusual_but_valid_multipart_upload_is_served(server, part):
    reply = send(server, Request("POST", "/v1/classify", MULTIPART, multipart(part)))
    assert reply.status == 200, reply.body[:300]
    check_predictions(server, json.loads(reply.body))


def test_a_batch_answers_each_bad_file_alone_and_serves_the_rest(server):
    files = [png_part(filename="good.png"), png_part(noise_image("PNG")[:100], filename="cut.png"),
             png_part(b"hello", filename="a.txt", content_type="text/plain"),
             png_part(png_of_size(UPLOAD_LIMIT + 1), filename="big.png")]
    reply = send(server, Request("POST", "/v1/classify/batch", MULTIPART, multipart(*files)))
    assert reply.status == 200, reply.body[:300]
    results = json.loads(reply.body)["results"]
    check_predictions(server, results[0])
    assert [r["error"]["code"] for r in results[1:]] == ["invalid_image", "unsupported_media_type",
                                                         "payload_too_large"]


# --- clients that hang up, stall, trickle or keep their connection ---

def status_count(server: Server, endpoint: str, status: int) -> float:
    return value(scrape(server.url), "vitserve_request_duration_seconds_count", endpoint=endpoint, status=str(status))


HALF_UPLOADS = {
    "raw-image": ("/v1/classify", "image/png", GOOD_PNG),
    "multipart-batch": ("/v1/classify/batch", f"multipart/form-data; boundary={BOUNDARY}",
                        multipart(png_part(), png_part(noise_image("PNG", size=(64, 64))))),
    "infer-json": ("/v2/models/{name}/infer", "application/json", infer_body()),  # the route's template
}


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
@pytest.mark.parametrize("endpoint, content_type, body", HALF_UPLOADS.values(), ids=HALF_UPLOADS.keys())
def test_a_client_hanging_up_mid_upload_is_counted_499_and_never_an_error(server, endpoint, content_type, body,
                                                                           reset):
    before = status_count(server, endpoint, 499)
    with RawConnection(server.port) as client:
        client.send(head("POST", endpoint.format(name=server.model), f"Content-Type: {content_type}",
                         f"Content-Length: {len(body)}", close=False) + body[:len(body) // 2])
        wait_until(lambda: value(scrape(server.url), "vitserve_requests_in_flight") >= 2,
                   "the half-sent request admitted (with the scrape asking)")
        client.hang_up(reset)
    wait_until(lambda: status_count(server, endpoint, 499) == before + 1, "the hang-up counted as 499")
    good_classify(server)
    assert_no_server_error(server)


def assert_no_server_error(server: Server) -> None:
    errors = {key: count for key, count in scrape(server.url).items()
              if key[0] == "vitserve_request_duration_seconds_count" and dict(key[1])["status"].startswith("5")}
    assert not errors, errors
    assert "Traceback" not in server.output.text(), server.output.text()


def assert_refused_and_closed(client: RawConnection, status: int, code: str) -> None:
    answer_status, headers, body = client.response()
    assert answer_status == status, body
    assert headers["connection"] == "close"
    assert Reply(answer_status, headers, body, 0).error()["code"] == code
    assert client.closed()


@pytest.mark.parametrize("sent", [b"", b"POST /v1/classify HTTP/1.1\r\n"], ids=["nothing", "request-line"])
@pytest.mark.slow
def test_a_silent_client_gets_408_and_is_disconnected_after_the_header_timeout(server, sent):
    started = time.monotonic()
    with RawConnection(server.port, timeout_s=HEADER_TIMEOUT_S + LATE_S) as client:
        client.send(sent)
        assert_refused_and_closed(client, 408, "request_timeout")
    assert HEADER_TIMEOUT_S * 0.9 <= time.monotonic() - started < HEADER_TIMEOUT_S + LATE_S
    good_classify(server)


@pytest.mark.slow
def test_a_stalled_upload_gets_408_and_is_disconnected_after_the_body_timeout(server):
    """Headers and part of the body, then silence (the body timeout is shorter than the request's deadline)."""
    with RawConnection(server.port, timeout_s=BODY_TIMEOUT_S + LATE_S) as client:
        client.send(classify_head(len(GOOD_PNG)) + GOOD_PNG[:100])
        stalled = time.monotonic()
        assert_refused_and_closed(client, 408, "request_timeout")
    assert BODY_TIMEOUT_S * 0.9 <= time.monotonic() - stalled < BODY_TIMEOUT_S + LATE_S
    good_classify(server)


@pytest.mark.slow
def test_an_upload_trickled_past_the_deadline_gets_408(server):
    """A byte every 0.4 s never leaves a gap as long as the body timeout, but the whole request has a deadline."""
    body = png_of_size(UPLOAD_LIMIT)
    with RawConnection(server.port, timeout_s=DEADLINE_S + LATE_S) as client:
        client.send(classify_head(len(body)))
        started, sent = time.monotonic(), 0
        while not client.answered(0.4) and sent < len(body) and client.send(body[sent:sent + 1]):
            sent += 1
        assert_refused_and_closed(client, 408, "request_timeout")
    assert DEADLINE_S * 0.9 <= time.monotonic() - started < DEADLINE_S + LATE_S
    good_classify(server)


KEEP_ALIVE_ERRORS = {
    "400-undecodable": (classify_head(11) + b"not a png!!", 400),
    "404-unknown-path": (head("GET", "/v1/nothing-here", close=False), 404),
    "405-get-classify": (head("GET", "/v1/classify", close=False), 405),
    "413-declared-length-body-sent": (classify_head(UPLOAD_LIMIT + 1) + b"\0" * (UPLOAD_LIMIT + 1), 413),
    "415-body-unread": (classify_head(len(GOOD_PNG), "text/plain") + GOOD_PNG, 415),
    "422-query": (classify_head(len(GOOD_PNG), path="/v1/classify?top_k=0") + GOOD_PNG, 422),
    "400-infer-json": (head("POST", "/v2/models/{model}/infer", "Content-Length: 5", close=False) + b"{bad}", 400),
}


@pytest.mark.parametrize("bad, status", KEEP_ALIVE_ERRORS.values(), ids=KEEP_ALIVE_ERRORS.keys())
def test_a_connection_kept_alive_after_an_error_serves_the_next_request(server, bad, status):
    """Either the error says Connection: close and the server closes, or the same connection serves on."""
    with RawConnection(server.port) as client:
        client.send(bad.replace(b"{model}", server.model.encode()))
        answer_status, headers, body = client.response()
        assert answer_status == status, body
        assert Reply(answer_status, headers, body, 0, request_path(bad)).error()
        if headers.get("connection") == "close":
            assert client.closed()
            return
        for _ in range(2):
            client.send(classify_head(len(GOOD_PNG)) + GOOD_PNG)
            answer_status, _, body = client.response()
            assert answer_status == 200, body
            check_predictions(server, json.loads(body))


TRICKLERS = 50


def test_fifty_trickling_uploads_leave_normal_requests_served(server):
    """50 uploads each send a byte every 0.2 s (within the body gap), admitted and held open; normal requests on
    new connections are still answered. Once the tricklers hang up, every admission they held is given back."""
    body_length = UPLOAD_LIMIT // 2
    with ExitStack() as stack:
        tricklers = [stack.enter_context(RawConnection(server.port)) for _ in range(TRICKLERS)]
        for client in tricklers:
            client.send(classify_head(body_length) + GOOD_PNG[:8])
        with trickling(tricklers, b"\0"):
            wait_until(lambda: value(scrape(server.url), "vitserve_requests_in_flight") >= TRICKLERS + 1,
                       f"{TRICKLERS} trickling uploads admitted")
            for _ in range(5):
                started = time.monotonic()
                good_classify(server)
                assert time.monotonic() - started < ANSWER_BOUND_S
        for client in tricklers:  # still uploading, or (a slow machine) past the request's deadline
            if client.answered():
                assert_refused_and_closed(client, 408, "request_timeout")
    wait_until(lambda: value(scrape(server.url), "vitserve_requests_in_flight") == 1, "every admission given back")
    good_classify(server)


def test_no_request_was_answered_5xx_and_nothing_logged_a_traceback(server):
    """Last in the module: over everything above (the fixture checks the log again once the server stopped)."""
    assert_no_server_error(server)
