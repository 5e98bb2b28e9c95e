#!/usr/bin/env python3
"""Capture real NVIDIA Triton Inference Server HTTP (Open Inference Protocol) exchanges.

Standalone script: it is NOT imported by the test-suite and does NOT run in
vitserve's venv. It needs the ``nvidia-pytriton`` wheel (which ships the real
``tritonserver`` binary) and ``tritonclient[http]`` in a separate venv made
from the *system* Python 3.11 (the Python-backend stub links
``libpython3.11.so.1.0``). See README.md next to this file for the commands.

Output: ``responses.json`` next to this file (override with ``--out``).
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import struct
import sys
import time
import traceback
from pathlib import Path

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

HERE = Path(__file__).resolve().parent
HOST = "127.0.0.1"

# Deterministic logits with awkward decimals, so that the formatting of
# classification strings is visible.
BASE_LOGITS = np.array(
    [0.1234567, -1.5, 2.25, 0.5, 3.14159265, -0.000123, 1e-7, 7.0, 2.7182818, -3.3333333],
    dtype=np.float32,
)
ROLLOUT = (np.arange(6, dtype=np.float32) / 7.0).reshape(2, 3)


def _outputs(batch_size: int, offsets: np.ndarray) -> dict:
    logits = np.tile(BASE_LOGITS, (batch_size, 1)) + offsets.reshape(-1, 1).astype(np.float32)
    rollout = np.tile(ROLLOUT, (batch_size, 1, 1))
    return {"logits": logits.astype(np.float32), "rollout": rollout.astype(np.float32)}


@batch
def infer_fmnist(pixel_values: np.ndarray) -> dict:
    # pixel_values: (B, 1, H, W)
    b = pixel_values.shape[0]
    if pixel_values.shape[-2:] == (3, 3):
        # trigger for the 'model raised' error capture
        raise ValueError("deliberate failure for 3x3 input")
    offsets = np.array([float(np.round(pixel_values[i].mean(), 3)) for i in range(b)])
    return _outputs(b, offsets)


@batch
def infer_images(image: np.ndarray) -> dict:
    # image: (B, 1) of bytes objects
    b = image.shape[0]
    offsets = np.array([len(image[i][0]) % 7 for i in range(b)], dtype=np.float32)
    return _outputs(b, offsets)


# --------------------------------------------------------------------------- helpers

def _elide(obj, limit: int = 16):
    """Shorten long 'data' arrays in a request body summary."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if k == "data" and isinstance(v, list) and v and isinstance(v[0], list):
                flat = np.asarray(v).reshape(-1).tolist()
                out[k] = {"_elided_nested_shape": list(np.asarray(v).shape), "_first": flat[:8]}
            elif k == "data" and isinstance(v, list) and len(v) > limit:
                out[k] = {"_elided_len": len(v), "_first": v[:8]}
            else:
                out[k] = _elide(v, limit)
        return out
    if isinstance(obj, list):
        return [_elide(v, limit) for v in obj]
    return obj


def _parse_json(raw: bytes):
    try:
        return json.loads(raw.decode("utf-8"))
    except Exception:  # noqa: BLE001
        return None


def _summarize_body(raw: bytes, header_len: int | None, content_encoding: str | None):
    """Return (summary, decoded_bytes)."""
    summary: dict = {"raw_length": len(raw)}
    data = raw
    if content_encoding and content_encoding.lower() in ("gzip", "deflate"):
        import zlib

        summary["content_encoding"] = content_encoding
        try:
            if content_encoding.lower() == "gzip":
                data = gzip.decompress(raw)
            else:
                data = zlib.decompress(raw)
            summary["decoded_length"] = len(data)
        except Exception as exc:  # noqa: BLE001
            summary["decode_error"] = repr(exc)
            return summary, raw
    if header_len is not None:
        head, rest = data[:header_len], data[header_len:]
        summary["kind"] = "binary"
        summary["json_header"] = _parse_json(head)
        summary["json_header_raw_text"] = head.decode("utf-8", "replace")
        summary["binary_length"] = len(rest)
        summary["binary_hex_first64"] = rest[:64].hex()
        return summary, data
    if not data:
        summary["kind"] = "empty"
        return summary, data
    parsed = _parse_json(data)
    if parsed is not None:
        summary["kind"] = "json"
        summary["json"] = parsed
        if len(data) <= 2048:
            # exact bytes on the wire (spacing, key order, float formatting)
            summary["raw_text"] = data.decode("utf-8")
    else:
        summary["kind"] = "text"
        summary["text"] = data.decode("utf-8", "replace")[:2000]
        summary["hex_first64"] = data[:64].hex()
    return summary, data


class Recorder:
    def __init__(self, port: int):
        self.port = port
        self.exchanges: list[dict] = []

    def exchange(
        self,
        name: str,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict | None = None,
        request_summary=None,
        note: str | None = None,
    ) -> dict:
        headers = dict(headers or {})
        conn = http.client.HTTPConnection(HOST, self.port, timeout=60)
        sent_headers = {"Host": f"{HOST}:{self.port}"}
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", sent_headers["Host"])
        if body is not None and "Content-Length" not in headers:
            headers["Content-Length"] = str(len(body))
        for k, v in headers.items():
            conn.putheader(k, v)
            sent_headers[k] = v
        conn.endheaders()
        if body:
            conn.send(body)
        resp = conn.getresponse()
        raw = resp.read()
        resp_headers = {k.lower(): v for k, v in resp.getheaders()}
        conn.close()

        ihcl = resp_headers.get("inference-header-content-length")
        summary, _ = _summarize_body(raw, int(ihcl) if ihcl is not None else None, resp_headers.get("content-encoding"))
        req = {"method": method, "path": path, "headers": sent_headers}
        if body is not None:
            req["body_length"] = len(body)
        if request_summary is not None:
            req["body_summary"] = request_summary
        rec = {
            "name": name,
            "request": req,
            "status": resp.status,
            "reason": resp.reason,
            "http_version": "HTTP/1.1" if resp.version == 11 else f"HTTP/{resp.version / 10}",
            "headers": resp_headers,
            "body": summary,
        }
        if note:
            rec["note"] = note
        self.exchanges.append(rec)
        shown = summary.get("json", summary.get("json_header", summary.get("text", "")))
        print(f"[{resp.status}] {name}: {method} {path} -> {json.dumps(shown)[:300]}", flush=True)
        return rec

    def json_post(self, name: str, path: str, payload, headers: dict | None = None, note: str | None = None):
        body = json.dumps(payload).encode()
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        return self.exchange(name, "POST", path, body, h, {"json": _elide(payload)}, note)

    def binary_post(
        self, name: str, path: str, header_obj, blobs: list[bytes], headers: dict | None = None,
        header_len_override: int | None = None, note: str | None = None,
    ):
        head = json.dumps(header_obj).encode()
        body = head + b"".join(blobs)
        h = {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(header_len_override if header_len_override is not None else len(head)),
        }
        h.update(headers or {})
        summary = {
            "json_header": _elide(header_obj),
            "json_header_length": len(head),
            "binary_lengths": [len(b) for b in blobs],
        }
        return self.exchange(name, "POST", path, body, h, summary, note)


def sample_pixels(batch_size: int = 2, h: int = 28, w: int = 28) -> np.ndarray:
    n = batch_size * h * w
    return ((np.arange(n, dtype=np.float32) % 256) / 255.0).reshape(batch_size, 1, h, w)


def bytes_tensor(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


# --------------------------------------------------------------------------- capture

def burst(port: int, path: str, n: int) -> None:
    import threading

    body = json.dumps({"inputs": [{"name": "pixel_values", "shape": [1, 1, 28, 28], "datatype": "FP32",
                                   "data": sample_pixels(1).flatten().tolist()}]}).encode()

    def one():
        conn = http.client.HTTPConnection(HOST, port, timeout=60)
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        conn.getresponse().read()
        conn.close()

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def capture_http(rec: Recorder) -> None:
    M = "/v2/models/vit-fmnist"
    INFER = M + "/infer"

    # --- server / health
    rec.exchange("server_metadata", "GET", "/v2")
    rec.exchange("health_live_get", "GET", "/v2/health/live")
    rec.exchange("health_ready_get", "GET", "/v2/health/ready")
    rec.exchange("health_live_head", "HEAD", "/v2/health/live")
    rec.exchange("health_ready_head", "HEAD", "/v2/health/ready")

    # --- model metadata / readiness / config
    rec.exchange("model_metadata", "GET", M)
    rec.exchange("model_version_metadata", "GET", M + "/versions/1")
    rec.exchange("model_ready", "GET", M + "/ready")
    rec.exchange("model_version_ready", "GET", M + "/versions/1/ready")
    rec.exchange("model_ready_head", "HEAD", M + "/ready")
    rec.exchange("model_config", "GET", M + "/config")
    rec.exchange("model_version_config", "GET", M + "/versions/1/config")
    rec.exchange("images_model_metadata", "GET", "/v2/models/vit-images")
    rec.exchange("images_model_config", "GET", "/v2/models/vit-images/config")

    px = sample_pixels(2)
    px_list = px.flatten().tolist()
    json_inputs = [{"name": "pixel_values", "shape": [2, 1, 28, 28], "datatype": "FP32", "data": px_list}]

    # --- inference, JSON in / JSON out
    rec.json_post("infer_json_batch2", INFER, {"inputs": json_inputs})
    rec.json_post("infer_json_with_id", INFER, {"id": "req-42", "inputs": json_inputs})
    rec.json_post("infer_json_with_empty_id", INFER, {"id": "", "inputs": json_inputs})
    rec.json_post(
        "infer_json_nested_data", INFER,
        {"inputs": [{"name": "pixel_values", "shape": [2, 1, 28, 28], "datatype": "FP32", "data": px.tolist()}]},
        note="data given as nested lists instead of flat",
    )
    rec.json_post(
        "infer_json_outputs_listed", INFER,
        {"inputs": json_inputs, "outputs": [{"name": "logits"}]},
        note="only logits requested",
    )
    rec.json_post("infer_json_versioned_route", M + "/versions/1/infer", {"inputs": json_inputs})
    rec.json_post(
        "infer_json_request_parameters", INFER,
        {"id": "p1", "parameters": {"foo": "bar", "n": 3}, "inputs": json_inputs},
        note="arbitrary request parameters: are they echoed?",
    )

    # --- binary in / binary out
    blob = px.tobytes()
    bin_in = [{
        "name": "pixel_values", "shape": [2, 1, 28, 28], "datatype": "FP32",
        "parameters": {"binary_data_size": len(blob)},
    }]
    rec.binary_post(
        "infer_binary_in_binary_out", INFER,
        {"inputs": bin_in, "outputs": [
            {"name": "logits", "parameters": {"binary_data": True}},
            {"name": "rollout", "parameters": {"binary_data": True}},
        ]},
        [blob],
    )
    rec.binary_post("infer_binary_in_json_out", INFER, {"inputs": bin_in}, [blob])
    rec.binary_post(
        "infer_binary_in_mixed_out", INFER,
        {"inputs": bin_in, "outputs": [
            {"name": "logits", "parameters": {"binary_data": False}},
            {"name": "rollout", "parameters": {"binary_data": True}},
        ]},
        [blob],
    )
    rec.json_post(
        "infer_binary_data_output_param", INFER,
        {"inputs": json_inputs, "parameters": {"binary_data_output": True}},
        note="request-level binary_data_output true, no outputs listed",
    )
    rec.binary_post(
        "infer_binary_in_binary_data_output_param", INFER,
        {"id": "bin-1", "inputs": bin_in, "parameters": {"binary_data_output": True}}, [blob],
    )
    rec.binary_post(
        "infer_binary_in_no_content_type", INFER, {"inputs": bin_in}, [blob],
        headers={"Content-Type": ""}, note="empty Content-Type header",
    )

    # --- classification extension
    rec.json_post(
        "infer_classification_json", INFER,
        {"inputs": json_inputs, "outputs": [{"name": "logits", "parameters": {"classification": 3}}]},
    )
    rec.json_post(
        "infer_classification_json_with_rollout", INFER,
        {"inputs": json_inputs, "outputs": [
            {"name": "logits", "parameters": {"classification": 3}}, {"name": "rollout"},
        ]},
    )
    rec.binary_post(
        "infer_classification_binary", INFER,
        {"inputs": bin_in, "outputs": [{"name": "logits", "parameters": {"classification": 3, "binary_data": True}}]},
        [blob],
    )
    rec.json_post(
        "infer_classification_on_rollout", INFER,
        {"inputs": json_inputs, "outputs": [{"name": "rollout", "parameters": {"classification": 2}}]},
        note="classification on a 2-D output",
    )
    rec.json_post(
        "infer_classification_k_gt_classes", INFER,
        {"inputs": json_inputs, "outputs": [{"name": "logits", "parameters": {"classification": 20}}]},
    )
    rec.json_post(
        "infer_classification_zero", INFER,
        {"inputs": json_inputs, "outputs": [{"name": "logits", "parameters": {"classification": 0}}]},
    )

    # --- compression
    body = json.dumps({"inputs": json_inputs}).encode()
    gz = gzip.compress(body)
    rec.exchange(
        "infer_gzip_request", "POST", INFER, gz,
        {"Content-Type": "application/json", "Content-Encoding": "gzip"},
        {"json": _elide({"inputs": json_inputs}), "gzip_of_json_length": len(body)},
    )
    rec.exchange(
        "infer_accept_encoding_gzip", "POST", INFER, body,
        {"Content-Type": "application/json", "Accept-Encoding": "gzip"},
        {"json": _elide({"inputs": json_inputs})},
        note="does Triton compress the response?",
    )
    rec.exchange(
        "infer_unsupported_content_encoding", "POST", INFER, body,
        {"Content-Type": "application/json", "Content-Encoding": "br"},
        {"json": _elide({"inputs": json_inputs})},
    )

    # --- BYTES model
    imgs = [b"\x89PNG\r\n\x1a\nfake-image-one", b"\xff\xd8\xffjpeg-two!"]
    bt = bytes_tensor(imgs)
    rec.binary_post(
        "images_infer_binary_bytes", "/v2/models/vit-images/infer",
        {"inputs": [{"name": "image", "shape": [2, 1], "datatype": "BYTES",
                     "parameters": {"binary_data_size": len(bt)}}],
         "outputs": [{"name": "logits", "parameters": {"binary_data": True}},
                     {"name": "rollout", "parameters": {"binary_data": False}}]},
        [bt],
    )
    rec.json_post(
        "images_infer_json_bytes", "/v2/models/vit-images/infer",
        {"inputs": [{"name": "image", "shape": [1, 1], "datatype": "BYTES", "data": ["hello-as-utf8-string"]}]},
    )

    # --- a burst of 8 concurrent batch-1 requests so the dynamic batcher merges some of them
    #     (visible in batch_stats of the stats below); these are not recorded as exchanges.
    burst(rec.port, INFER, 8)

    # --- stats after inferences
    rec.exchange("model_stats", "GET", M + "/stats")
    rec.exchange("all_models_stats", "GET", "/v2/models/stats")
    rec.exchange("model_version_stats", "GET", M + "/versions/1/stats")

    # --- errors
    rec.exchange("err_unknown_model_metadata", "GET", "/v2/models/nope")
    rec.exchange("err_unknown_model_ready", "GET", "/v2/models/nope/ready")
    rec.exchange("err_unknown_model_config", "GET", "/v2/models/nope/config")
    rec.exchange("err_unknown_model_stats", "GET", "/v2/models/nope/stats")
    rec.json_post("err_unknown_model_infer", "/v2/models/nope/infer", {"inputs": json_inputs})
    rec.exchange("err_unknown_version_metadata", "GET", M + "/versions/2")
    rec.exchange("err_unknown_version_ready", "GET", M + "/versions/2/ready")
    rec.exchange("err_unknown_version_stats", "GET", M + "/versions/2/stats")
    rec.json_post("err_unknown_version_infer", M + "/versions/2/infer", {"inputs": json_inputs})
    rec.exchange("err_non_numeric_version", "GET", M + "/versions/abc")
    rec.exchange(
        "err_malformed_json", "POST", INFER, b'{"inputs": [', {"Content-Type": "application/json"},
        {"text": '{"inputs": ['},
    )
    rec.exchange(
        "err_empty_body", "POST", INFER, b"", {"Content-Type": "application/json"}, {"text": ""},
    )
    rec.exchange(
        "err_json_not_object", "POST", INFER, b"[1,2,3]", {"Content-Type": "application/json"}, {"text": "[1,2,3]"},
    )
    rec.json_post("err_wrong_input_name", INFER,
                  {"inputs": [dict(json_inputs[0], name="pixels")]})
    rec.json_post("err_wrong_datatype_fp64", INFER,
                  {"inputs": [dict(json_inputs[0], datatype="FP64")]})
    rec.json_post("err_wrong_datatype_int32", INFER,
                  {"inputs": [dict(json_inputs[0], datatype="INT32", data=[int(x) for x in px_list])]})
    rec.json_post("err_wrong_datatype_with_id", INFER,
                  {"id": "req-7", "inputs": [dict(json_inputs[0], datatype="FP64")]},
                  note="how the request id shows up in error messages")
    rec.json_post("err_unknown_datatype", INFER,
                  {"inputs": [dict(json_inputs[0], datatype="FLOAT")]})
    rec.json_post("err_wrong_shape_rank", INFER,
                  {"inputs": [{"name": "pixel_values", "shape": [2, 28, 28], "datatype": "FP32", "data": px_list}]})
    rec.json_post("err_wrong_shape_channels", INFER,
                  {"inputs": [{"name": "pixel_values", "shape": [1, 2, 28, 28], "datatype": "FP32", "data": px_list}]})
    rec.json_post("err_shape_data_count_mismatch", INFER,
                  {"inputs": [{"name": "pixel_values", "shape": [2, 1, 28, 28], "datatype": "FP32",
                               "data": px_list[:100]}]})
    rec.json_post("err_batch_too_large", INFER,
                  {"inputs": [{"name": "pixel_values", "shape": [17, 1, 2, 2], "datatype": "FP32",
                               "data": [0.5] * (17 * 4)}]})
    rec.json_post("err_missing_inputs_field", INFER, {"id": "x"})
    rec.json_post("err_empty_inputs", INFER, {"inputs": []})
    rec.json_post("err_missing_shape", INFER,
                  {"inputs": [{"name": "pixel_values", "datatype": "FP32", "data": px_list}]})
    rec.json_post("err_missing_datatype", INFER,
                  {"inputs": [{"name": "pixel_values", "shape": [2, 1, 28, 28], "data": px_list}]})
    rec.json_post("err_missing_data", INFER,
                  {"inputs": [{"name": "pixel_values", "shape": [2, 1, 28, 28], "datatype": "FP32"}]})
    rec.json_post("err_string_in_fp32_data", INFER,
                  {"inputs": [{"name": "pixel_values", "shape": [1, 1, 1, 2], "datatype": "FP32",
                               "data": ["a", "b"]}]})
    rec.json_post("err_unknown_output", INFER, {"inputs": json_inputs, "outputs": [{"name": "nope"}]})
    rec.json_post("err_classification_not_int", INFER,
                  {"inputs": json_inputs, "outputs": [{"name": "logits", "parameters": {"classification": "3"}}]})
    rec.json_post("err_id_not_string", INFER, {"id": 42, "inputs": json_inputs})
    rec.json_post("err_duplicate_input", INFER, {"inputs": json_inputs + json_inputs})
    rec.binary_post("err_header_length_larger_than_body", INFER, {"inputs": bin_in}, [blob],
                    header_len_override=len(blob) * 4)
    rec.binary_post("err_binary_size_larger_than_body", INFER,
                    {"inputs": [dict(bin_in[0], parameters={"binary_data_size": len(blob) + 100})]}, [blob])
    rec.binary_post("err_binary_size_smaller_than_body", INFER,
                    {"inputs": [dict(bin_in[0], parameters={"binary_data_size": len(blob) - 100})]}, [blob])
    rec.binary_post("err_header_length_not_a_number", INFER, {"inputs": bin_in}, [blob],
                    headers={"Inference-Header-Content-Length": "abc"})
    rec.exchange(
        "err_bad_gzip_body", "POST", INFER, b"not gzip at all",
        {"Content-Type": "application/json", "Content-Encoding": "gzip"}, {"text": "not gzip at all"},
    )
    rec.json_post("err_model_raises", INFER,
                  {"id": "boom-1", "inputs": [{"name": "pixel_values", "shape": [1, 1, 3, 3], "datatype": "FP32",
                                               "data": [0.0] * 9}]},
                  note="the infer function raises ValueError inside the Python backend")
    rec.exchange("err_get_on_infer", "GET", INFER)
    rec.exchange("err_post_health_live", "POST", "/v2/health/live", b"", {})
    rec.exchange("err_post_model_metadata", "POST", M, b"", {})
    rec.exchange("err_unknown_route", "GET", "/v2/nope")
    rec.exchange("err_v1_route", "GET", "/v1/models")
    rec.exchange("err_trailing_slash_health", "GET", "/v2/health/live/")
    rec.exchange("err_delete_health", "DELETE", "/v2/health/ready")

    # --- stats again, after the failures
    rec.exchange("model_stats_after_errors", "GET", M + "/stats")


def capture_tritonclient(port: int) -> dict:
    """Step 2: what tritonclient[http] does against the real server."""
    out: dict = {}
    try:
        import tritonclient.http as httpclient
        from tritonclient.utils import InferenceServerException

        from importlib.metadata import version as _dist_version

        out["tritonclient_version"] = _dist_version("tritonclient")
        c = httpclient.InferenceServerClient(url=f"{HOST}:{port}")

        def call(name, fn):
            try:
                out[name] = {"ok": True, "result": fn()}
            except InferenceServerException as exc:
                out[name] = {"ok": False, "exception": "InferenceServerException",
                             "status": exc.status(), "message": exc.message()}
            except Exception as exc:  # noqa: BLE001
                out[name] = {"ok": False, "exception": type(exc).__name__, "message": str(exc),
                             "traceback": traceback.format_exc()[-1500:]}

        call("is_server_live", c.is_server_live)
        call("is_server_ready", c.is_server_ready)
        call("get_server_metadata", c.get_server_metadata)
        call("get_model_metadata", lambda: c.get_model_metadata("vit-fmnist"))
        call("get_model_config", lambda: c.get_model_config("vit-fmnist"))
        call("get_inference_statistics", lambda: c.get_inference_statistics("vit-fmnist"))
        call("get_inference_statistics_all", lambda: c.get_inference_statistics())
        call("get_model_metadata_unknown", lambda: c.get_model_metadata("nope"))

        px = sample_pixels(2)

        def do_infer(binary: bool, class_count: int, request_id: str = ""):
            inp = httpclient.InferInput("pixel_values", list(px.shape), "FP32")
            inp.set_data_from_numpy(px, binary_data=binary)
            outs = [httpclient.InferRequestedOutput("logits", binary_data=binary, class_count=class_count)]
            res = c.infer("vit-fmnist", [inp], outputs=outs, request_id=request_id)
            arr = res.as_numpy("logits")
            return {
                "get_response": res.get_response(),
                "as_numpy_logits_dtype": str(arr.dtype) if arr is not None else None,
                "as_numpy_logits_shape": list(arr.shape) if arr is not None else None,
                "as_numpy_logits": arr.tolist() if arr is not None and arr.dtype != object
                else [[x.decode() if isinstance(x, bytes) else x for x in row] for row in arr.tolist()],
            }

        call("infer_class_count3_json", lambda: do_infer(False, 3, "tc-1"))
        call("infer_class_count3_binary", lambda: do_infer(True, 3))
        call("infer_plain_binary", lambda: do_infer(True, 0))
        c.close()
    except Exception as exc:  # noqa: BLE001
        out["fatal"] = repr(exc)
        out["traceback"] = traceback.format_exc()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE / "responses.json")
    ap.add_argument("--http-port", type=int, default=18000)
    ap.add_argument("--grpc-port", type=int, default=18001)
    ap.add_argument("--metrics-port", type=int, default=18002)
    args = ap.parse_args()

    config = TritonConfig(
        http_address=HOST,
        http_port=args.http_port,
        grpc_address=HOST,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        log_verbose=0,
    )
    model_cfg = ModelConfig(
        batching=True,
        max_batch_size=16,
        batcher=DynamicBatcher(max_queue_delay_microseconds=5000),
    )
    outputs = [
        Tensor(name="logits", dtype=np.float32, shape=(10,)),
        Tensor(name="rollout", dtype=np.float32, shape=(-1, -1)),
    ]
    # pytriton by default restricts the statistics / model-repository / logging / trace
    # endpoints behind a 'triton-access-token' header (stock tritonserver does not);
    # switch that off so the capture reflects a plain `tritonserver` launch.
    security = TritonSecurityConfig(restricted_endpoints=[])
    with Triton(config=config, security_config=security) as triton:
        triton.bind(
            model_name="vit-fmnist",
            model_version=1,
            infer_func=infer_fmnist,
            inputs=[Tensor(name="pixel_values", dtype=np.float32, shape=(1, -1, -1))],
            outputs=outputs,
            config=model_cfg,
            strict=True,
        )
        triton.bind(
            model_name="vit-images",
            model_version=1,
            infer_func=infer_images,
            inputs=[Tensor(name="image", dtype=np.bytes_, shape=(1,))],
            outputs=outputs,
            config=model_cfg,
            strict=True,
        )
        triton.run()
        time.sleep(0.5)

        rec = Recorder(args.http_port)
        capture_http(rec)
        tc = capture_tritonclient(args.http_port)

    server_meta = next(e for e in rec.exchanges if e["name"] == "server_metadata")["body"].get("json") or {}
    from importlib.metadata import version as _dist_version

    doc = {
        "description": "Real NVIDIA Triton Inference Server HTTP/REST (KServe v2 / Open Inference Protocol) "
                       "exchanges, captured by capture.py in this folder. See README.md.",
        "triton_version": server_meta.get("version"),
        "server_metadata": server_meta,
        "pytriton_version": _dist_version("nvidia-pytriton"),
        "python": sys.version.split()[0],
        "captured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "exchanges": rec.exchanges,
        "tritonclient": tc,
    }
    args.out.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    print(f"wrote {args.out} ({len(rec.exchanges)} exchanges)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
