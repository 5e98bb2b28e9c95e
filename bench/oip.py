"""`vitserve bench --mode oip`: what the Open Inference Protocol's request encodings cost, side by side on one
`vitserve serve` process, for the same images.

- `json`: the normalised pixel tensor `pixel_values` (FP32, [1, C, H, W]) as a flat JSON list; `logits` and
  `rollout` come back as JSON lists.
- `binary`: the same tensor with the binary tensor extension: the JSON header, then the raw little-endian float32
  bytes (`Inference-Header-Content-Length` says where the JSON ends); both outputs asked for binary.
- `image`: the encoded PNG itself, a binary BYTES input named `image` of shape [1], which the server decodes and
  preprocesses as /v1/classify does; both outputs binary.
- `classify` (the reference): `POST /v1/classify` with the PNG as the body, as the throughput mode sends it.

The pixel tensors are the server's own preprocessing of the PNGs (bench/raw.py), and the bodies are framed by
service/schemas/binary_tensors.py, the module the server reads them with. One request per encoding goes first: its
answer's size is reported, its logits are compared with json's, and an encoding the server refuses is reported as
such instead of measured. Then, since this machine's speed drifts, the encodings run side by side: for each
client count, `rounds` rounds each running every encoding once (a closed loop, bench/load.py), the order reversed
every other round; the tables give the medians over rounds, and each encoding's throughput over json's in the same
round.
"""
from __future__ import annotations

import json
import statistics
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES
from vitserve.bench.config import LOOPBACK, BenchConfig, with_server_defaults
from vitserve.bench.load import encode_request, make_images, settle
from vitserve.bench.reliability import ServerUnderTest, alternated, contention, number, preamble, table
from vitserve.bench.run import run_level
from vitserve.bench.servers import free_port, server_settings
from vitserve.service.schemas.binary_tensors import (
    HEADER_LENGTH,
    NUMPY_DTYPES,
    join_body,
    pack_bytes,
    split_body,
    take_sections,
    tensor_bytes,
)
from vitserve.service.schemas.v1 import IMAGE_INPUT_NAME

ENCODINGS = ("json", "binary", "image", "classify")
_PROTOCOL = ("json", "binary", "image")  # the encodings answered with logits (classify answers with scores)


@dataclass
class OipConfig:
    model: str = "models/vit-fmnist/model.onnx"  # an ONNX artifact, or a name in bench/presets.py
    out: Path = Path("build/bench/oip.md")  # under build/: never over a committed report unless asked
    encodings: list[str] = field(default_factory=lambda: list(ENCODINGS))
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])  # closed-loop clients
    rounds: int = 3  # every encoding once per round, per client count
    duration_s: float = 3.0
    warmup_s: float = 1.0
    min_completed_per_client: int = 3  # a window stretches (up to max_duration_factor x) until this many per client
    max_duration_factor: float = 3.0
    time_limit_s: float = 1800.0  # the whole run; levels that would start after it are skipped
    request_timeout_s: float = 120.0
    server_args: list[str] = field(default_factory=list)  # extra `vitserve serve` flags
    num_images: int = 8
    seed: int = 0
    cache_dir: Path = Path("build/bench-models")
    log_dir: Path = Path("build/bench-logs")


# `--quick`: a smoke run; flags given still win over these
OIP_QUICK: dict[str, Any] = {"concurrency": [1, 8], "rounds": 2, "duration_s": 1.0, "warmup_s": 0.5}

# ---------------------------------------------------------------------------------------------------- requests


def infer_target(model_name: str) -> str:
    return f"/v2/models/{model_name}/infer"


def json_request(pixels: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """`pixels` (1, C, H, W) as a JSON FP32 tensor, flat; both outputs asked for as JSON."""
    tensor = {"name": INPUT_NAME, "datatype": "FP32", "shape": list(pixels.shape), "data": pixels.ravel().tolist()}
    return join_body({"inputs": [tensor], "outputs": [{"name": n} for n in OUTPUT_NAMES]}, [])


def _binary_outputs() -> list[dict]:
    return [{"name": n, "parameters": {"binary_data": True}} for n in OUTPUT_NAMES]


def binary_request(pixels: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """`pixels` (1, C, H, W) as a binary FP32 tensor after the JSON header; both outputs asked for binary."""
    data = tensor_bytes(pixels, "FP32")
    tensor = {"name": INPUT_NAME, "datatype": "FP32", "shape": list(pixels.shape),
              "parameters": {"binary_data_size": len(data)}}
    return join_body({"inputs": [tensor], "outputs": _binary_outputs()}, [data])


def image_request(encoded: bytes) -> tuple[bytes, dict[str, str]]:
    """An encoded image as a one-element binary BYTES tensor named `image`; both outputs asked for binary."""
    data = pack_bytes([encoded])
    tensor = {"name": IMAGE_INPUT_NAME, "datatype": "BYTES", "shape": [1],
              "parameters": {"binary_data_size": len(data)}}
    return join_body({"inputs": [tensor], "outputs": _binary_outputs()}, [data])


def classify_request(png: bytes) -> tuple[bytes, dict[str, str]]:
    return png, {"Content-Type": "image/png"}


def request_bodies(encoding: str, pixels: np.ndarray, pngs: list[bytes]) -> list[tuple[bytes, dict[str, str]]]:
    """One (body, HTTP headers) per image: `pixels` (n, C, H, W) are the server's preprocessing of `pngs`."""
    if encoding == "json":
        return [json_request(p[None]) for p in pixels]
    if encoding == "binary":
        return [binary_request(p[None]) for p in pixels]
    build = {"image": image_request, "classify": classify_request}[encoding]
    return [build(png) for png in pngs]


def target(encoding: str, model_name: str) -> str:
    return "/v1/classify" if encoding == "classify" else infer_target(model_name)


# ---------------------------------------------------------------------------------------------------- answers


def decode_outputs(body: bytes, header_length: str | None) -> tuple[dict[str, np.ndarray], list[str]]:
    """An inference answer's outputs as arrays of their shapes, and the names of those that came binary."""
    header, binary = split_body(body, header_length)
    outputs = json.loads(header)["outputs"]
    sent_binary = [o for o in outputs if (o.get("parameters") or {}).get("binary_data_size") is not None]
    sections = take_sections(binary, [o["parameters"]["binary_data_size"] for o in sent_binary])
    raw = {o["name"]: s for o, s in zip(sent_binary, sections)}
    arrays = {}
    for o in outputs:
        if o["name"] in raw:
            values = np.frombuffer(raw[o["name"]], NUMPY_DTYPES[o["datatype"]])
        else:
            values = np.asarray(o["data"], np.float32)
        arrays[o["name"]] = values.reshape(o["shape"])
    return arrays, [o["name"] for o in sent_binary]


def probe(port: int, path: str, body: bytes, headers: dict[str, str], timeout_s: float) -> dict:
    """One request on its own connection: its status, the answer's size and, for an inference answer, its logits
    and which outputs came binary; an answer that is not 200 or does not parse is `refused`, with why."""
    request = urllib.request.Request(f"http://{LOOPBACK}:{port}{path}", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            answer, header_length = r.read(), r.headers.get(HEADER_LENGTH)
    except urllib.error.HTTPError as e:
        detail = e.read()
        return {"response_bytes": len(detail), "refused": f"{e.code}: {detail[:300].decode(errors='replace')}"}
    row = {"response_bytes": len(answer), "refused": None}
    try:
        if path == "/v1/classify":
            json.loads(answer)["predictions"]
            return row
        outputs, sent_binary = decode_outputs(answer, header_length)
        return {**row, "binary_outputs": sent_binary, "logits": outputs["logits"].ravel().tolist()}
    except (ValueError, KeyError, TypeError) as e:  # BinaryFormatError and JSONDecodeError are ValueErrors
        return {**row, "refused": f"200 with an answer that does not parse: {type(e).__name__}: {e}"}


# ---------------------------------------------------------------------------------------------------- the run


def run_oip(cfg: OipConfig, overrides: dict[str, str], command: str) -> dict:
    """One server; a probe per encoding, then every client count's rounds; returns the report."""
    from vitserve.bench.overload import model_summary
    from vitserve.bench.presets import resolve_model
    from vitserve.bench.raw import preprocessed
    from vitserve.bench.run import Budget, environment
    from vitserve.onnx_header import read_model_info

    budget = Budget(cfg.time_limit_s)
    env = environment()  # before anything runs: the load average at the start
    model_path = resolve_model(cfg.model, cfg.cache_dir)
    info = read_model_info(model_path)
    pngs = make_images("png", info.image_size, info.channels, cfg.num_images, cfg.seed)
    pixels = preprocessed(SimpleNamespace(info=info), pngs)  # (n, C, H, W); it reads only the model's info
    bodies = {e: request_bodies(e, pixels, pngs) for e in cfg.encodings}
    settings = _server_overrides(cfg, overrides)
    server = ServerUnderTest()
    port = free_port()
    print(f"oip: {', '.join(cfg.encodings)} against one server (log: {cfg.log_dir / 'oip-server.log'})", flush=True)
    with server.start(model_path, port, cfg, settings, "oip-server") as process:
        name = _served_model_name(port)
        encodings = {e: {"target": target(e, name), "request_bytes": statistics.fmean(len(b) for b, _ in bodies[e]),
                         **probe(port, target(e, name), *bodies[e][0], cfg.request_timeout_s)}
                     for e in cfg.encodings}
        _compare_logits(encodings)
        for e, facts in encodings.items():
            print(f"  {e:8s} request {facts['request_bytes']:10.0f} B  response {facts['response_bytes']:8d} B"
                  + (f"  REFUSED: {facts['refused'][:120]}" if facts["refused"] else ""), flush=True)
        measured = [e for e in cfg.encodings if not encodings[e]["refused"]]
        payloads = {e: [encode_request("POST", encodings[e]["target"], b, headers=h) for b, h in bodies[e]]
                    for e in measured}
        rows = run_rounds(process, payloads, cfg, budget)
    report = {"mode": "oip", "command": command, "model": model_summary(model_path),
              "environment": contention(env, [r["other_cores"] for r in rows if "skipped" not in r]),
              "settings": {**asdict(cfg), "server_overrides": overrides,
                           "load_generator": "asyncio keep-alive HTTP/1.1 client in the bench process"},
              "servers": [server.describe(settings, cfg.server_args)], "served_model_name": name,
              "encodings": encodings, "rounds": rows}
    report["summary"] = summarise(rows, measured, cfg.concurrency)
    return report


def _server_overrides(cfg: OipConfig, overrides: dict[str, str]) -> dict[str, str]:
    """The throughput mode's server settings (deadline and queue out of a closed loop's way) under the user's."""
    bench = with_server_defaults(BenchConfig(concurrency=cfg.concurrency, request_timeout_s=cfg.request_timeout_s))
    env = server_settings(bench, overrides, batching=True)
    return {k.removeprefix("VITSERVE_").lower(): v for k, v in env.items()}


def _served_model_name(port: int) -> str:
    with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/v1/model", timeout=10) as r:
        return json.loads(r.read())["name"]


def _compare_logits(encodings: dict[str, dict]) -> None:
    """Each protocol encoding's largest logit difference from json's, for the same first image (it should be 0:
    the same float32 tensor, or the server's own preprocessing of the same PNG)."""
    reference = encodings.get("json", {}).get("logits")
    for facts in encodings.values():
        if reference is not None and facts.get("logits") is not None:
            facts["max_abs_logit_diff_vs_json"] = float(np.max(np.abs(np.subtract(facts["logits"], reference))))


def run_rounds(process, payloads: dict[str, list[bytes]], cfg: OipConfig, budget) -> list[dict]:
    """For each client count, every encoding once per round, the order reversed every other round."""
    rows = []
    for clients in cfg.concurrency:
        for round_, encoding in alternated(list(payloads), cfg.rounds):
            row = {"concurrency": clients, "round": round_ + 1, "encoding": encoding}
            if not budget.allows(cfg.warmup_s + cfg.max_duration_factor * cfg.duration_s + 5):
                rows.append({**row, "skipped": "time limit"})
                continue
            rows.append({**row, **run_level(process, payloads[encoding], clients, cfg)})
            print(_level_line(rows[-1]), flush=True)
            settle(process.port, payloads[encoding][0], cfg.request_timeout_s)
    return rows


def _level_line(r: dict) -> str:
    return (f"  c={r['concurrency']:<3d} round {r['round']} {r['encoding']:8s} {r['requests_per_s']:8.1f} req/s  "
            f"p50 {r['p50_ms']:8.2f} ms  p99 {r['p99_ms']:8.2f} ms  errors {sum(r['errors'].values())}")


_MEDIANS = ("requests_per_s", "p50_ms", "p99_ms", "server_cores", "client_cores", "other_cores")


def summarise(rows: list[dict], encodings: list[str], concurrency: list[int]) -> list[dict]:
    """Per client count and encoding: medians over the rounds, errors summed, and the median over rounds of the
    encoding's req/s over json's in the same round (side by side, so a drift in machine speed cancels)."""
    out = []
    for clients in concurrency:
        rounds: dict[int, dict[str, dict]] = {}
        for r in rows:
            if r["concurrency"] == clients and "skipped" not in r:
                rounds.setdefault(r["round"], {})[r["encoding"]] = r
        for encoding in encodings:
            mine = [by[encoding] for by in rounds.values() if encoding in by]
            if not mine:
                continue
            ratios = [by[encoding]["requests_per_s"] / by["json"]["requests_per_s"] for by in rounds.values()
                      if encoding in by and by.get("json", {}).get("requests_per_s")]
            out.append({"encoding": encoding, "concurrency": clients, "rounds": len(mine),
                        **{k: statistics.median(r[k] for r in mine) for k in _MEDIANS},
                        "errors": sum(sum(r["errors"].values()) for r in mine),
                        "vs_json": statistics.median(ratios) if ratios else None})
    return out


# ---------------------------------------------------------------------------------------------------- report


def render_oip(report: dict) -> str:
    s = report["settings"]
    lines = [*preamble(report, "the Open Inference Protocol's encodings, side by side"), _method(s), "",
             "## Encodings", "", *_encoding_lines(report), "",
             f"## Medians over {s['rounds']} round(s)", "", *_summary_table(report), "",
             "*vs json*: the median over rounds of the encoding's req/s over json's in the same round; *bytes*: "
             "HTTP bodies (request: mean over the images; response: one answer); *cores*: CPU seconds per second "
             "used by the server's processes (HTTP workers and engine), this load generator, and everything else "
             "on the machine.", "",
             "## Every round", "", *_rounds_table(report["rounds"]), ""]
    return "\n".join(lines)


def _method(s: dict) -> str:
    return (f"Closed loop (bench/load.py): each client sends its next request when the last is answered; per level "
            f"{s['warmup_s']:g} s of warm-up, then {s['duration_s']:g} s measured (stretched, up to "
            f"{s['max_duration_factor']:g}x, until {s['min_completed_per_client']} answers per client). For each "
            f"client count ({', '.join(map(str, s['concurrency']))}), {s['rounds']} round(s), each running every "
            f"encoding once, the order reversed every other round. {s['num_images']} PNGs, cycled; the pixel "
            f"tensors are the server's own preprocessing of them. Load generator: {s['load_generator']}.")


_SENDS = {"json": "`pixel_values` FP32 [1, C, H, W] as a flat JSON list; outputs as JSON",
          "binary": "`pixel_values` FP32 [1, C, H, W], binary tensor extension (raw float32 after the JSON header); "
                    "binary outputs",
          "image": "the PNG as a binary BYTES input `image` [1], decoded by the server; binary outputs",
          "classify": "`POST /v1/classify`, the PNG as the body (reference)"}


def _encoding_lines(report: dict) -> list[str]:
    lines = []
    for name, e in report["encodings"].items():
        if e["refused"]:
            outcome = f"**refused by this server, not measured**: {e['refused'][:200]}"
        else:
            outcome = "answered 200"
            if e.get("binary_outputs") is not None:
                outcome += f"; binary outputs: {', '.join(e['binary_outputs']) or 'none'}"
            if "max_abs_logit_diff_vs_json" in e:
                outcome += f"; logits vs json's, max abs difference {e['max_abs_logit_diff_vs_json']:.3g}"
        lines.append(f"- **{name}** (`{e['target']}`): {_SENDS[name]}. Request body {e['request_bytes']:,.0f} "
                     f"bytes, response body {e['response_bytes']:,} bytes; {outcome}.")
    return lines


def _summary_table(report: dict) -> list[str]:
    sizes = report["encodings"]
    rows = [[r["encoding"], str(r["concurrency"]), number(r["requests_per_s"]), number(r["vs_json"], ".2f"),
             number(r["p50_ms"], ".2f"), number(r["p99_ms"], ".2f"), str(r["errors"]),
             f"{sizes[r['encoding']]['request_bytes']:,.0f}", f"{sizes[r['encoding']]['response_bytes']:,}",
             number(r["server_cores"], ".2f"), number(r["client_cores"], ".2f"), number(r["other_cores"], ".2f")]
            for r in report["summary"]]
    return table(["encoding", "clients", "req/s", "vs json", "p50 ms", "p99 ms", "errors", "request bytes",
                  "response bytes", "server cores", "client cores", "other cores"], rows)


def _rounds_table(rounds: list[dict]) -> list[str]:
    rows = []
    for r in rounds:
        head = [str(r["concurrency"]), str(r["round"]), r["encoding"]]
        if "skipped" in r:
            rows.append(head + [f"skipped ({r['skipped']})"] + ["-"] * 5)
            continue
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(r["errors"].items())) or "0"
        rows.append(head + [number(r["requests_per_s"]), number(r["p50_ms"], ".2f"), number(r["p99_ms"], ".2f"),
                            errors, number(r["window_s"]), number(r.get("mean_batch_size"), ".2f")])
    return table(["clients", "round", "encoding", "req/s", "p50 ms", "p99 ms", "errors", "window s", "mean batch"],
                 rows, text_columns=3)


def summary_lines(report: dict) -> list[str]:
    """What the command prints at the end: one line per encoding and client count."""
    return [f"{r['encoding']:8s} c={r['concurrency']:<3d} {r['requests_per_s']:8.1f} req/s "
            f"(x{number(r['vs_json'], '.2f')} json)  p50 {r['p50_ms']:8.2f} ms  p99 {r['p99_ms']:8.2f} ms  "
            f"errors {r['errors']}" for r in report["summary"]]
