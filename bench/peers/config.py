"""The peer comparison's settings, and the only place their defaults are written (the command line overrides them)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVERS = ("vitserve", "triton", "litserve")
# vitserve on Ray Serve (`vitserve serve --ray`) with one and two replicas: on request only (`--servers`)
RAY_SERVERS = {"vitserve-ray1": 1, "vitserve-ray2": 2}
# vitserve on a runtime and precision other than its default (`auto`): runtimes side by side, served
RUNTIME_SERVERS = {"vitserve-openvino": {"VITSERVE_RUNTIME": "openvino"},
                   "vitserve-onnxruntime": {"VITSERVE_RUNTIME": "onnxruntime"},
                   "vitserve-bf16": {"VITSERVE_RUNTIME": "openvino", "VITSERVE_PRECISION_HINT": "bf16"},
                   # the model in one engine process that every HTTP worker feeds, whatever `--engine auto` would
                   # choose (service/engine/topology.py): the two topologies side by side
                   "vitserve-process": {"VITSERVE_ENGINE": "process"},
                   # a session in each HTTP worker, one thread each (what `--engine auto` chose for a light model)
                   "vitserve-inline": {"VITSERVE_ENGINE": "inline", "VITSERVE_INTRA_OP_THREADS": "1",
                                       "VITSERVE_WORKERS": str(len(os.sched_getaffinity(0)))},
                   # the engine process for every batch, and a lone request on its worker's own session
                   # (service/engine/lone_path.py)
                   "vitserve-lone": {"VITSERVE_ENGINE": "process", "VITSERVE_LONE_REQUEST_PATH": "true"},
                   # two batches at once, each on one of the two cores' intra-op threads (Triton's instance count)
                   "vitserve-2runners": {"VITSERVE_BATCH_RUNNERS": "2"}}
# Triton with the model on OpenVINO at a precision (its Python backend compiles the file's fast graph, as vitserve's
# OpenVINO runtime does): the same runtime and precision as vitserve's, side by side
TRITON_OPENVINO = {"triton-bf16": "bf16", "triton-openvino": "fp32"}
# answers in bfloat16: checked against float32 within bfloat16's tolerance (bench/peers/answers.py)
BF16_SERVERS = {"vitserve-bf16", "triton-bf16"}
# the 20-line FastAPI app a user writes first (bench/peers/fastapi_app.py): one ONNX Runtime session, no batching,
# run from this checkout's environment (it needs nothing beside vitserve's own dependencies); on request only
FASTAPI = "fastapi"
# vitserve from `baseline_commit`, beside the working tree's in the same run: a change's before and after
BASELINE = "vitserve-base"
KNOWN_SERVERS = (*SERVERS, *RAY_SERVERS, *RUNTIME_SERVERS, *TRITON_OPENVINO, FASTAPI, BASELINE)
# the req/s ratios the report gives, where both servers ran: (numerator, denominator)
RATIOS = (("vitserve", "triton"), ("vitserve", "triton-bf16"), ("vitserve", FASTAPI), ("vitserve-inline", "triton"),
          ("vitserve-lone", "triton"), ("vitserve", BASELINE), ("vitserve", "vitserve-process"),
          ("vitserve-process", "triton"), ("vitserve-bf16", "triton-bf16"), ("vitserve-bf16", "vitserve-onnxruntime"),
          ("vitserve-openvino", "triton-openvino"))
# image: each server's own image endpoint; oip-json / oip-binary: the pixel tensor through the Open Inference
# Protocol, as JSON or with the binary tensor extension (the same bodies to vitserve's /v2 and Triton's)
PATHS = ("image", "oip-json", "oip-binary")
SERVED_PATHS = {"vitserve": PATHS, "triton": PATHS, "litserve": ("image",), FASTAPI: ("image",), BASELINE: PATHS,
                **{s: PATHS for s in (*RAY_SERVERS, *RUNTIME_SERVERS, *TRITON_OPENVINO)}}


def family(server: str) -> str:
    """The server whose requests and answers `server` has: vitserve's on Ray or another runtime are vitserve's,
    Triton's on OpenVINO Triton's."""
    if server in TRITON_OPENVINO:
        return "triton"
    return "vitserve" if server in RAY_SERVERS or server in RUNTIME_SERVERS or server == BASELINE else server


@dataclass
class PeersConfig:
    # ONNX artifacts, or names in bench/presets.py; the default model is HTTP-bound, ViT-S/16 compute-bound
    models: list[str] = field(default_factory=lambda: ["models/vit-fmnist/model.onnx", "vit-s16"])
    servers: list[str] = field(default_factory=lambda: list(SERVERS))
    out: Path = Path("build/bench/peers.md")  # under build/: never over the committed report unless asked
    rounds: int = 3  # every server once per round, the order reversed every other round
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32, 64])  # wrk connections
    # a model whose raw batch-1 latency is above compute_bound_ms is measured on the image path only, at these
    compute_bound_ms: float = 10.0
    compute_bound_concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    # ... for this long: at 32 connections one answer takes seconds, and the first comes a whole batch late
    compute_bound_duration_s: int = 15
    duration_s: int = 5  # measured wrk run per level (wrk takes whole seconds)
    warmup_s: int = 1  # a discarded wrk run at the same level before it
    wrk_timeout_s: int = 60  # a request unanswered this long is a wrk timeout error
    raw_batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 16])
    raw_duration_s: float = 3.0  # per raw batch size
    quiet_load: float = 1.0  # the 1-minute load average to wait for before measuring ...
    quiet_wait_s: float = 180.0  # ... at most this long (then it runs anyway, and says so)
    time_limit_s: float = 2400.0  # the whole run; levels that would start after it are skipped
    startup_timeout_s: float = 300.0
    seed: int = 0
    # serve vitserve from this commit (exported with `git archive` under work_dir), not from the working tree
    vitserve_commit: str | None = None
    baseline_commit: str | None = None  # what `vitserve-base` serves (required when it is among the servers)
    venv_python: str | None = None  # the interpreter the peers' venvs are made from; None: this Python's base
    work_dir: Path = Path("build/peers")  # the venvs, request bodies and wrk scripts
    cache_dir: Path = Path("build/bench-models")  # preset models, exported on first use
    log_dir: Path = Path("build/bench-logs")  # the servers' logs


# `--quick`: a smoke run of the default model; flags given still win over these
QUICK: dict[str, Any] = {"models": ["models/vit-fmnist/model.onnx"], "rounds": 1, "concurrency": [1, 8],
                         "duration_s": 2, "raw_duration_s": 0.5, "quiet_wait_s": 0.0}
