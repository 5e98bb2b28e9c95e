"""How a model file is served on this machine, decided once: the runtime, the precision, the maps-free graph and
whether the model is light (one thread a session; its sessions in the HTTP workers). `serving_plan` is a function of
the file, the machine and the settings, never of the moment:

- a setting that names a choice (`--runtime openvino`, `--maps-free off`) decides it;
- else a **record** of measurements made once on a quiet machine (`vitserve tune`, or the first load on an idle
  machine with `tuning write-when-idle`), keyed by the file's SHA-256, the CPU's model, flags and cores, the runtime
  packages' versions and the settings the measurement depends on (`PlanKey`), read by every later load and by every
  replica whose key is the same;
- else **declared facts**: the CPU's units (bfloat16 arithmetic: OpenVINO bf16, 1.5-3.7x ONNX Runtime's float32 on
  the same chip), the providers present (a GPU: ONNX Runtime's CUDA session) and the model's size (its weights times
  its tokens, `multiply_adds`).

No load times anything: a race beside live traffic measured the traffic and picked fp32 or bf16 by noise, and the
same file then answered differently from one load to the next. As Triton's model analyzer writes a configuration and
ONNX Runtime's TunableOp a results file, the measurement is a step of its own, and its record is a file an operator
can read, copy into an image, or delete.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from vitserve.artifact import ModelInfo
from vitserve.machine import cpu_model_name
from vitserve.service.ground.processes import usable_cores

if TYPE_CHECKING:  # pydantic's settings stay out of the runtimes: the peers' venvs compile models without them
    from vitserve.service.ground.settings import Settings

log = logging.getLogger("vitserve.runtime")

RECORD_FORMAT = 1
# The CPU flags a choice depends on: the vector and matrix units the runtimes' kernels pick by.
DECIDING_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8",
                  "amx_tile", "asimd", "sve", "bf16", "i8mm")
# A model whose batch-1 call at its trained size costs fewer multiply-adds than this is light: a server of it is
# HTTP-bound, and each session runs on one thread so that the cores go to the HTTP workers. Measured with every core
# of a 2-core Xeon: the default model (4.4e7) 2.7 ms, ViT-S/16 (4.3e9) 72 ms; the old stopwatch's line was 10 ms.
LIGHT_MODEL_MULTIPLY_ADDS = 6e8
# A recorded candidate must beat ONNX Runtime on the file's own precision by this much to be chosen: near a tie the
# choice would flip between two measurements with the machine's noise, and with it the answers' last bits.
RECORDED_MARGIN = 0.9


@dataclass(frozen=True)
class ServingPlan:
    """What a model is served on, and from what that was decided (`source`: settings, recorded or declared)."""

    runtime: str  # a registered runtime's name (service/engine/runtime.py's RUNTIMES)
    precision_hint: str  # the settings' precision_hint that loads it so: auto (the file's own), fp32, bf16
    maps_free: bool  # the maps-free graph is loaded for the batches that need no map
    light: bool  # one intra-op thread a session (service/engine/topology.py puts them in the HTTP workers)
    source: str  # "settings", "recorded" or "declared": what decided the runtime and precision
    why: str  # one line a person reads in the log, the model card and /v2 config
    key: str = ""  # the record's name (PlanKey.digest): the same on every replica of this file and machine
    multiply_adds: float = 0.0  # of one image at the trained size: what `light` is decided from
    measured: dict = field(default_factory=dict)  # the record's measurements ({} where none was read)

    @property
    def settings_update(self) -> dict[str, str]:
        """The Settings fields that load the model on this plan."""
        return {"runtime": self.runtime, "precision_hint": self.precision_hint,
                "maps_free": "on" if self.maps_free else "off"}

    def describe(self) -> dict:
        """The plan as the model card and /v2 config show it."""
        return {"runtime": self.runtime, "precision_hint": self.precision_hint, "maps_free": self.maps_free,
                "light": self.light, "source": self.source, "why": self.why, "key": self.key}


@dataclass(frozen=True)
class PlanKey:
    """What a recorded measurement holds for: the file, the machine, the runtimes and the settings it ran under."""

    file_sha256: str
    cpu: str
    flags: tuple[str, ...]
    cores: int
    runtimes: tuple[str, ...]  # "onnxruntime 1.x", "openvino 2025.x"
    settings: tuple[tuple[str, str], ...]  # the settings the measurement depends on

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:24]

    def as_json(self) -> dict:
        """The key as its record holds it (tuples read back as lists)."""
        return json.loads(json.dumps(asdict(self)))


# Settings a measurement depends on: what it was allowed to choose among, and the batch it was timed at.
# The thread count is not among them: the HTTP workers' one thread each and the engine's every core are both loads
# of one record (the choice among runtimes holds at either; `light` is what sets the count).
KEYED_SETTINGS = ("runtime", "precision_hint", "providers", "max_batch_size")


def plan_key(path: Path, settings: Settings) -> PlanKey:
    return PlanKey(file_sha256(path), cpu_model_name(), cpu_flags(), usable_cores(), runtime_versions(),
                   tuple((name, str(getattr(settings, name))) for name in KEYED_SETTINGS))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, ...]:
    """The DECIDING_FLAGS this CPU has (from /proc/cpuinfo's first `flags` or `Features` line; () off Linux)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return tuple(sorted(set(DECIDING_FLAGS) & set(line.split(":", 1)[1].split())))
    except OSError:
        pass
    return ()


def runtime_versions() -> tuple[str, ...]:
    from importlib import metadata
    versions = []
    for package in ("onnxruntime", "onnxruntime-gpu", "openvino"):
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            continue
    return tuple(versions)


def multiply_adds(info: ModelInfo, graph: onnx.ModelProto) -> float:
    """One image's multiply-adds at the trained size, to within the attention's share: every weight is used once
    per token (a ViT's weights are its projections and MLPs), and each block's attention adds 2 tokens² x width."""
    weights = sum(int(_count(t.dims)) for t in graph.graph.initializer)
    tokens = (info.image_size[0] // info.patch_size) * (info.image_size[1] // info.patch_size) + 1
    width, depth = info.architecture.get("embed_dim", 0), info.architecture.get("depth", 0)
    return float(weights * tokens + depth * 2 * tokens * tokens * width)


def _count(dims) -> int:
    count = 1
    for d in dims:
        count *= int(d)
    return count


# ---------------------------------------------------------------------------------------------------- the record

def tuning_dir(settings: Settings) -> Path:
    """Where records live: the setting, else $XDG_CACHE_HOME/vitserve/tuning (~/.cache/vitserve/tuning)."""
    if settings.tuning_dir is not None:
        return settings.tuning_dir
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "vitserve" / "tuning"


def record_path(settings: Settings, key: PlanKey) -> Path:
    return tuning_dir(settings) / f"{key.digest}.json"


def read_record(settings: Settings, key: PlanKey) -> dict | None:
    """The record for `key`, or None (none there; one unreadable or of another key is logged and ignored)."""
    path = record_path(settings, key)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("tuning record %s ignored: %s", path, e)
        return None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT or record.get("key") != key.as_json() \
            or not isinstance(record.get("choice"), dict):
        log.warning("tuning record %s ignored: not a record of this file, machine and settings", path)
        return None
    return record


def write_record(settings: Settings, key: PlanKey, choice: dict, measured: dict, command: str) -> Path:
    """The record of a measurement, written whole (a rename: a replica reading it never sees half a file)."""
    path = record_path(settings, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"format": RECORD_FORMAT, "key": key.as_json(), "choice": choice, "measured": measured,
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": command,
              "host": platform.node()}
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    partial.replace(path)
    return path


# ---------------------------------------------------------------------------------------------------- the plan

def serving_plan(settings: Settings, info: ModelInfo, graph: onnx.ModelProto, on_gpu: bool,
                 bf16_runtime: str | None, record: dict | None, int8_runtime: str | None = None,
                 digest: str = "") -> ServingPlan:
    """The plan for a file whose `info` and fast `graph` are given. `on_gpu`: the first provider of the chain is a
    GPU's. `bf16_runtime`, `int8_runtime`: the registered runtime other than ONNX Runtime that computes bfloat16, or an
    int8 file's layers in integer arithmetic, on this CPU (None: none does). `record`: the tuning record of this file
    on this machine (`read_record`; None: there is none, or `tuning off`), `digest` its key's name."""
    macs = multiply_adds(info, graph)
    light = not on_gpu and macs < LIGHT_MODEL_MULTIPLY_ADDS
    runtime: str
    precision: str
    if settings.runtime != "auto":
        runtime, precision, source = settings.runtime, settings.precision_hint, "settings"
        why = f"--runtime {runtime}" + (f" --precision-hint {precision}" if precision != "auto" else "")
    elif record is not None:
        runtime, precision = record["choice"]["runtime"], record["choice"]["precision_hint"]
        source, why = "recorded", f"measured {record.get('measured_at', '')} by `{record.get('command', '')}`"
    else:
        runtime, precision, source, why = declared_runtime(settings, info, on_gpu, bf16_runtime, int8_runtime)
    maps_free = settings.maps_free == "on" or settings.maps_free == "auto" and (
        bool(record["choice"].get("maps_free", True)) if record is not None else True)
    if record is not None and "light" in record["choice"]:
        light = bool(record["choice"]["light"])
    return ServingPlan(runtime, precision, maps_free, light, source, why, digest, macs,
                       record.get("measured", {}) if record is not None else {})


def declared_runtime(settings: Settings, info: ModelInfo, on_gpu: bool, bf16_runtime: str | None,
                     int8_runtime: str | None = None) -> tuple[str, str, str, str]:
    """runtime, precision hint, source, why: from what the machine declares, for `--runtime auto` without a record.
    An int8 file goes to the runtime that runs its quantized layers as integer products where one does (OpenVINO on
    a CPU with VNNI: ViT-S/16's static int8 file 1.41x ONNX Runtime's int8 at batch 8 and 1.62x at 1 on a 2-core
    EPYC, docs/int8.md), its other layers in float32."""
    if on_gpu:
        return "onnxruntime", settings.precision_hint, "declared", "a GPU provider: ONNX Runtime's session on it"
    if info.precision == "int8" and int8_runtime is not None and settings.precision_hint in ("auto", "fp32"):
        return int8_runtime, "fp32", "declared", "an int8 file on a CPU with int8 dot-product units (VNNI or AMX)"
    wants_bf16 = settings.precision_hint in ("auto", "bf16") and info.precision == "fp32"
    if wants_bf16 and bf16_runtime is not None:
        return bf16_runtime, "bf16", "declared", "this CPU computes bfloat16 (AVX512-BF16 or AMX)"
    if settings.precision_hint == "bf16":
        return "onnxruntime", "auto", "declared", "bf16 asked, but no runtime here computes it: the file's float32"
    return "onnxruntime", "auto", "declared", f"the file's own precision ({info.precision}) on ONNX Runtime"
