"""The inference engine: every served model version's session and batcher, in the HTTP process (`LocalEngine`)
or in a process of its own that every HTTP frontend feeds (`EngineServer` serving, in engine/server.py;
`RemoteEngine` calling).

This module is the engine's interface, as the use cases (service/usecases/inference.py) see it: route a request to
a model version, submit images to it, read and change the repository. Its types are its own (no batcher or
session type crosses it), so an engine in another process offers exactly the same.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from vitserve.artifact import ModelInfo
from vitserve.service.engine.budgets import FULL_BUDGET, BudgetAsk

# A version's states, as Triton's repository index names them.
LOADING, READY, UNLOADING, UNAVAILABLE = "LOADING", "READY", "UNLOADING", "UNAVAILABLE"


@dataclass(frozen=True)
class ModelHandle:
    """Where a request goes: a model, the version routed to, and that version's metadata. `pinned`: the client
    named the version (it is never routed elsewhere)."""

    name: str
    version: str
    info: ModelInfo
    pinned: bool = False
    batching: dict = field(default_factory=dict, compare=False)  # its own batching limits (config.json), if any
    version_policy: dict = field(default_factory=dict, compare=False)  # its model's (Triton's JSON form); {}: none
    serving: dict = field(default_factory=dict, compare=False)  # how the version is served and why ({}: unknown)


@dataclass
class InferenceResult:
    """One image's outputs: (logits, rollout), or with a target also relevance; and where its time went."""

    output: Any
    queue_s: float
    inference_s: float
    batch_size: int
    version: str = ""  # the version that ran it
    batch_span: str = ""  # the traced ORT run that served it ("traceid-spanid", service/ground/tracing.py), or ""
    rung: int = 0  # the token budget it ran at: an index into its version's served ladder (0: the full budget)
    reason: str | None = None  # why below the full budget ("asked", "load"); None at the full budget


@dataclass(frozen=True)
class IndexEntry:
    """One line of the repository index: a model (version and state empty: in the repository, never loaded) or
    one of its versions, its state and why."""

    name: str
    version: str = ""
    state: str = ""
    reason: str = ""


def newest_first(versions) -> list[str]:
    """Versions, newest first: numbers by value (a single file's version may be any text: then by text)."""
    return sorted(versions, key=lambda v: (0, int(v), "") if v.isdigit() else (1, 0, v), reverse=True)


def same_geometry(a: ModelInfo, b: ModelInfo) -> bool:
    """Whether an image prepared for `a` is valid input for `b` (a request may be routed again to another
    version, after its image was prepared)."""
    return (a.channels, a.patch_size, tuple(a.image_size), list(a.mean), list(a.std)) == \
        (b.channels, b.patch_size, tuple(b.image_size), list(b.mean), list(b.std))


class Engine(Protocol):
    """What the serving side needs of an engine, wherever it runs."""

    @property
    def ready(self) -> bool:
        """Reachable, and the models it starts with loaded and warmed up."""

    on_ready: Callable[[bool], None]  # called when `ready` changes

    @property
    def provider(self) -> str: ...

    async def start(self) -> None: ...

    async def warmed_up(self) -> bool:
        """Wait for the warm-up that `start` began, where the models are in this process (an engine elsewhere warms
        up on its own: not waited for); whether the engine is ready."""

    def route(self, name: str | None, version: str | None = None) -> ModelHandle:
        """The version a request for `name` goes to: `version`, or the newest ready one. `name` None: the only
        model, if there is one. ModelNotFound, InvalidModelName, or ModelUnavailable (exists, not ready)."""

    def info(self, name: str, version: str) -> ModelInfo:
        """A loaded version's metadata."""

    async def submit(self, handle: ModelHandle, pixels: np.ndarray, timeout_s: float,
                     target: int | None = None, maps_free: bool = False, alone: bool = False,
                     budget: BudgetAsk = FULL_BUDGET) -> InferenceResult:
        """Run one image (C, H, W) in some batch of the handle's version; its result, or its own ServiceError.
        `budget`: the token budget asked for, and whether load may make it cheaper (service/engine/budgets.py).
        With a `target` (the class to explain, -1 the top-1) the relevance path, which batches apart. `maps`
        False: the answer needs no rollout, and a batch of such images only may run the model's maps-free graph
        (its rollout output then empty, shape (0,)). An unpinned request whose version was unloaded before it ran
        goes to the newest ready version. `alone`: nothing else is in flight in the caller's process; an engine in
        that process may then run it on the caller's thread (service/engine/batcher.py), one elsewhere ignores it."""

    def predicted_wait_s(self, name: str | None = None) -> float:
        """How long the work queued now for model `name` (its newest ready version; None: the least loaded of
        all) would take to run: admission's estimate."""

    def ready_versions(self, name: str | None = None) -> list[tuple[str, str]]:
        """The (model, version) pairs routed to now (of model `name`), newest version first: what routing knows,
        with no call to the engine."""

    async def index(self, ready_only: bool = False) -> list[IndexEntry]: ...

    def live_versions(self) -> set[tuple[str, str]]:
        """The (model, version) pairs loaded or being loaded or unloaded: whose metrics are exported."""

    async def load(self, name: str) -> None:
        """Load (or reload) model `name` as the repository and its version policy say, each new version warmed
        up before it is routed to, then unload the versions the policy no longer names. ModelLoadError if one
        fails: what was serving stays serving."""

    async def unload(self, name: str) -> None:
        """Stop routing to every version of `name`, let its admitted requests finish, then free it."""

    async def shadow_report(self, name: str) -> dict:
        """Model `name`'s shadow comparisons (service/engine/shadow.py); ModelNotFound when it has none."""

    async def close(self, timeout_s: float) -> None: ...
