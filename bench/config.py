"""One bench run's settings, and the only place their defaults are written (the command line overrides them)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"


@dataclass
class BenchConfig:
    model: str = "models/vit-fmnist/model.onnx"  # an ONNX artifact, or a name in bench/presets.py
    # under build/: a run never writes over the committed report unless asked (`make bench` asks)
    out: Path = Path("build/bench/bench.md")
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32])  # raw session
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32, 64])  # served closed-loop clients
    inputs: list[str] = field(default_factory=lambda: ["png", "jpeg"])
    max_batch_size: int | None = None  # batching on (off is 1); None: the server's default
    max_queue_delay_ms: float | None = None  # None: the server's default
    duration_s: float = 5.0  # measured window per served level
    warmup_s: float = 1.5  # discarded before each window
    min_completed_per_client: int = 3  # a window stretches (up to max_duration_factor x) until this many per client
    max_duration_factor: float = 3.0
    raw_duration_s: float = 3.0  # per raw batch size
    pairs: int = 30  # paired one-client measurements per server (raw call, served request, in turn)
    pair_gap_s: float = 0.02
    bare: str = "auto"  # "on", "off", or "auto": only when the model is fast enough to be HTTP-bound
    bare_threshold_ms: float = 5.0  # auto: run bare when raw batch-1 p50 is below this
    time_limit_s: float = 1800.0  # the whole run; levels that would start after it are skipped
    request_timeout_s: float = 120.0
    num_images: int = 8
    seed: int = 0
    cache_dir: Path = Path("build/bench-models")  # preset models, exported on first use
    log_dir: Path = Path("build/bench-logs")  # the servers' logs


INPUT_KINDS = ("png", "jpeg")
# `--quick`: a smoke run; flags given still win over these
QUICK: dict[str, Any] = {"batch_sizes": [1, 8], "concurrency": [1, 8], "duration_s": 1.0, "warmup_s": 0.5,
                         "raw_duration_s": 0.5, "pairs": 5}


def with_server_defaults(cfg: BenchConfig) -> BenchConfig:
    """Fill the batching knobs left unset with the server's own defaults, so the report states what ran."""
    from vitserve.service.ground.settings import Settings

    server = Settings()
    unset = {name: getattr(server, name) for name in ("max_batch_size", "max_queue_delay_ms")
             if getattr(cfg, name) is None}
    return replace(cfg, **unset)

# `vitserve bench` flags that only one mode reads (bench/cli.py and bench/peers/cli.py refuse them elsewhere)
THROUGHPUT_ONLY = ("batch_sizes", "concurrency", "inputs", "max_batch_size", "max_queue_delay_ms", "pairs", "bare",
                   "duration_s", "warmup_s", "raw_duration_s", "time_limit_s")
OIP_ONLY = ("encodings",)


def add_config_flags(parser, defaults) -> None:
    """One `--flag` per field of a bench's config dataclass (`defaults`), typed and defaulted by its value."""
    for name, default in asdict(defaults).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
