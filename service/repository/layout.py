"""A model repository on disk, laid out as Triton's: `ROOT/<model name>/<version number>/model.onnx`.

The folder names the model and the version (as in Triton); everything else the server needs (labels, resolution,
patch size, normalisation) still comes from each file's own metadata. An optional `ROOT/<model>/config.json`
says what the file cannot: the version policy (Triton's `version_policy` in its JSON form), batching limits, and
which maps to offer. `--model FILE` is a repository of one (`single_file_source`).

Nothing here reads outside the root: names are checked (service/ground/model_names.py) before they touch a path, and
every path is resolved and must stay under the resolved root (a symbolic link pointing out is refused, with a
reason the index shows). Scanning reads directory entries, `stat`s and each model's config.json (64 KiB at most); a
model file's header is read at load time.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vitserve.service.ground.errors import ModelNotFound, RepositoryError
from vitserve.service.ground.model_names import VERSION_NAME, check_model_name, is_model_name
from vitserve.service.ground.model_names import check_version as check_version  # service/engine/routing.py's
from vitserve.service.ground.settings import PrecisionHint, Runtime

MODEL_FILENAME = "model.onnx"
CONFIG_FILENAME = "config.json"
MAX_CONFIG_BYTES = 64 * 1024
MAX_MODELS = 1000  # folders read per scan: a repository is a handful of models, not a file system to walk
MAX_VERSIONS = 1000


class LatestPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    num_versions: int = Field(1, ge=1, le=MAX_VERSIONS)


class SpecificPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    versions: list[int] = Field(min_length=1, max_length=MAX_VERSIONS)


class VersionPolicy(BaseModel):
    """Triton's version policy: exactly one of `latest` (the N highest, default 1), `all`, `specific`."""

    model_config = ConfigDict(extra="forbid")
    latest: LatestPolicy | None = None
    all: dict | None = None
    specific: SpecificPolicy | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> VersionPolicy:
        kinds = [k for k in ("latest", "all", "specific") if getattr(self, k) is not None]
        if len(kinds) > 1:
            raise ValueError(f"a version policy is one of latest, all or specific, not {' and '.join(kinds)}")
        if not kinds:
            self.latest = LatestPolicy()
        return self

    def choose(self, versions: list[str]) -> list[str]:
        """The versions this policy serves out of those available, highest first."""
        ordered = sorted(versions, key=int, reverse=True)
        if self.all is not None:
            return ordered
        if self.specific is not None:
            wanted = {str(v) for v in self.specific.versions}
            return [v for v in ordered if v in wanted]
        assert self.latest is not None, "_one_kind sets latest when no kind is given"
        return ordered[:self.latest.num_versions]


class ShadowConfig(BaseModel):
    """A version that gets a copy of a share of the model's requests after they are answered, to be compared with
    the version that answered them (service/engine/shadow.py, docs/shadow.md). It is loaded beside the versions
    the policy serves and routed to only when a client names it."""

    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=1, le=10**18 - 1, description="the shadow version's folder")
    fraction: float = Field(1.0, gt=0, le=1, description="the share of answered requests copied to it")
    # A copy waits here for the shadow's batcher; a full queue drops the copy (counted), never the request.
    max_queue_size: int = Field(64, ge=1, le=10_000)
    # Below the served versions by default: on a busy machine the copies get the cycles the answers leave.
    cpu_priority: Literal["normal", "low", "idle"] = Field("idle", description="the shadow's compute threads")
    timeout_s: float = Field(30.0, gt=0, le=600, description="how long one copy may wait and run")


class ModelConfig(BaseModel):
    """`ROOT/<model>/config.json`: what a model's file cannot say. Unset fields take the server's settings."""

    model_config = ConfigDict(extra="forbid")
    version_policy: VersionPolicy = Field(default_factory=VersionPolicy)
    max_batch_size: int | None = Field(None, ge=1, le=1024)
    max_queue_delay_ms: float | None = Field(None, ge=0, le=10_000)
    max_queue_size: int | None = Field(None, ge=1, le=1_000_000)
    maps: list[Literal["rollout", "relevance"]] | None = Field(None, description="maps offered (default: all the "
                                                                                "file computes)")
    # Models share the cores: a heavy one with a thread per core takes them all while its batch runs, and a light
    # one beside it waits (docs/results/bench-repository.md). Fewer threads for the heavy one bound that.
    intra_op_threads: int | None = Field(None, ge=1, le=256, description="ONNX Runtime threads of one call of "
                                                                         "this model (default: the server's)")
    # Fewer threads still leave the heavy model a share of every core it runs on. A lower priority gives the cores
    # to the other models whenever they have work, and to this one whenever they have none: a batch or background
    # model beside a latency-sensitive one (docs/repository.md has the measurements).
    runtime: Runtime | None = Field(None, description="this model's runtime (default: the server's)")
    precision_hint: PrecisionHint | None = Field(None, description="this model's compute precision (default: the "
                                                                   "server's)")
    cpu_priority: Literal["normal", "low", "idle"] = Field("normal", description="this model's compute threads: "
                                                           "normal (as the server), low (nice +10), idle (only "
                                                           "the cycles nothing else wants)")
    shadow: ShadowConfig | None = None


@dataclass(frozen=True)
class VersionFile:
    """One version's model file as the scan found it; `size` and `mtime_ns` tell a changed or growing file."""

    version: str
    path: Path
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class ConfigFile:
    """A model's config.json as the scan read it: `size` and `mtime_ns` tell one still being written, `sha256` (of
    the bytes read) a change of what it says."""

    size: int
    mtime_ns: int
    sha256: str


def same_config(a: ConfigFile | None, b: ConfigFile | None) -> bool:
    """Whether two readings of a config.json say the same (None: there was none): a file touched or rewritten with
    the same bytes is the same config, one that appears or goes is not."""
    return (a.sha256 if a else None) == (b.sha256 if b else None)


@dataclass
class ModelEntry:
    """One model folder: its config, its usable versions, and why the others are not usable."""

    name: str
    config: ModelConfig = field(default_factory=ModelConfig)
    versions: dict[str, VersionFile] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)  # version ("" for the model) -> reason
    fixed: bool = False  # a single file: its version comes from its metadata, no policy applies
    config_file: ConfigFile | None = None  # its config.json as read (None: there is none, or it could not be read)

    def wanted(self) -> list[str]:
        """The versions to load, highest first: those the policy picks, and the shadow version if there is one."""
        if self.fixed:
            return list(self.versions)
        return self._picked(list(self.versions))

    def serves(self) -> list[str]:
        """The versions routed to when a client names none: what the policy picks, never the shadow."""
        return [v for v in self.wanted() if v != self.shadow_version]

    @property
    def shadow_version(self) -> str | None:
        return str(self.config.shadow.version) if self.config.shadow and not self.fixed else None

    def unusable_wanted(self) -> dict[str, str]:
        """The version folders the policy picks out of all of them that hold no usable file, and why: a version
        copied under another name than model.onnx would otherwise be passed over in silence."""
        if self.fixed:
            return {}
        folders = list(self.versions) + [v for v in self.problems if v]
        return {v: self.problems[v] for v in self._picked(folders) if v in self.problems}

    def _picked(self, folders: list[str]) -> list[str]:
        """The policy's choice out of `folders` other than the shadow's, then the shadow's, newest first."""
        shadow = self.shadow_version
        picked = self.config.version_policy.choose([v for v in folders if v != shadow])
        return sorted(picked + ([shadow] if shadow in folders else []), key=int, reverse=True)


class ModelRepository:
    """Reads `root`: the model folders' names (`names`) and one folder (`entry`)."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise RepositoryError(f"the model repository {root} is not a directory")

    def names(self) -> list[str]:
        """The model folders' names, sorted; entries that are not valid names, not folders, or folders outside
        the repository (a link pointing out) are skipped."""
        found: list[str] = []
        with os.scandir(self.root) as entries:
            for entry in entries:
                if len(found) >= MAX_MODELS:
                    break
                if is_model_name(entry.name) and entry.is_dir() and self._inside(Path(entry.path)) is not None:
                    found.append(entry.name)
        return sorted(found)

    def entry(self, name: str) -> ModelEntry:
        """The model folder `name`, read now; ModelNotFound if there is none."""
        folder = self._inside(self.root / check_model_name(name))
        if folder is None or not folder.is_dir():
            raise ModelNotFound(f"no model named {name!r} in the repository")
        model = ModelEntry(name)
        try:
            config = self._inside(folder / CONFIG_FILENAME)
            if config is None:  # a link out of the repository: nothing outside it is read
                raise RepositoryError(f"{CONFIG_FILENAME} points outside the repository")
            read = read_config_file(config)
            if read is not None:  # a broken one keeps its reading: a poll waits until it has stopped changing
                data, model.config_file = read
                model.config = parse_config(data)
        except RepositoryError as e:
            model.problems[""] = str(e)
            return model
        with os.scandir(folder) as entries:
            versions = [e.name for e in entries if VERSION_NAME.fullmatch(e.name)][:MAX_VERSIONS]
        for version in versions:
            found = self._version_file(folder, version)
            if isinstance(found, VersionFile):
                model.versions[version] = found
            else:
                model.problems[version] = found
        return model

    def version_file(self, name: str, version: str) -> VersionFile | None:
        """One version's model file as it is now, without reading the model's config or its other versions; None
        when there is none (or the name or version could not name one)."""
        folder = self._inside(self.root / check_model_name(name))
        if folder is None or not VERSION_NAME.fullmatch(version):
            return None
        found = self._version_file(folder, version)
        return found if isinstance(found, VersionFile) else None

    def _version_file(self, folder: Path, version: str) -> VersionFile | str:
        """The version's model file, or why there is none."""
        directory = self._inside(folder / version)
        if directory is None:
            return f"version {version} points outside the repository"
        if not directory.is_dir():
            return f"version {version} is not a folder"
        path = self._inside(directory / MODEL_FILENAME)
        if path is None:
            return f"version {version}: {MODEL_FILENAME} points outside the repository"
        if not path.exists():
            present = sorted(os.listdir(directory))[:5]
            return (f"version {version} has no {MODEL_FILENAME}" +
                    (f" (it holds {', '.join(present)})" if present else " (the folder is empty)"))
        if not path.is_file():
            return f"version {version}: {MODEL_FILENAME} is not a file"
        stat = path.stat()
        return VersionFile(version, path, stat.st_size, stat.st_mtime_ns)

    def _inside(self, path: Path) -> Path | None:
        """`path` resolved (links followed), or None when that lands outside the repository."""
        resolved = path.resolve()
        return resolved if resolved.is_relative_to(self.root) else None


def read_config_file(path: Path) -> tuple[bytes, ConfigFile] | None:
    """A config.json's bytes (up to one past the limit) and the file as they were read; None when there is none."""
    if not path.exists():
        return None
    if not path.is_file():  # a FIFO would block the reader (the engine's loop) until someone wrote to it
        raise RepositoryError(f"{CONFIG_FILENAME} is not a regular file")
    try:
        with path.open("rb") as f:
            stat = os.fstat(f.fileno())
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise RepositoryError(f"{CONFIG_FILENAME}: {_one_line(e)}") from None
    return data, ConfigFile(stat.st_size, stat.st_mtime_ns, hashlib.sha256(data).hexdigest())


def parse_config(data: bytes) -> ModelConfig:
    """A config.json's bytes as the model's config; RepositoryError says what is wrong with them."""
    if len(data) > MAX_CONFIG_BYTES:
        raise RepositoryError(f"{CONFIG_FILENAME} is over {MAX_CONFIG_BYTES} bytes")
    try:
        return ModelConfig.model_validate(json.loads(data))
    except ValidationError as e:  # its own text quotes the values; a problem's place and kind are enough
        problems = "; ".join(f"{'.'.join(map(str, p['loc'])) or 'config'}: {p['msg']}"
                             for p in e.errors(include_url=False, include_input=False)[:3])
        raise RepositoryError(f"{CONFIG_FILENAME}: {_one_line(problems)}") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RepositoryError(f"{CONFIG_FILENAME}: {_one_line(e)}") from None
    except RecursionError:
        raise RepositoryError(f"{CONFIG_FILENAME}: its JSON nests too deep") from None


def single_file_source(path: Path, name: str, version: str) -> ModelEntry:
    """`--model FILE`: a repository of one model with one version, named as the file's metadata says."""
    path = Path(path)
    stat = path.stat()
    return ModelEntry(name, versions={version: VersionFile(version, path, stat.st_size, stat.st_mtime_ns)},
                      fixed=True)


def _one_line(error: Exception | str) -> str:
    return " ".join(str(error).split())[:500]
