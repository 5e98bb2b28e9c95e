"""`ModelRegistry`: the model versions an engine serves, keyed by (name, version), and the operations that change
them: load, unload, poll. The engine (in the HTTP process or an engine process) holds one.

Triton's model management, in its order:
- a load brings every version the policy names up completely (session, batcher, warm-up) before routing to
  it; then the versions the policy no longer names are retired. A load that fails leaves what was serving
  serving, and the index says why (state and reason per version).
- retiring a version stops routing to it, lets the requests admitted to it finish (up to the drain timeout),
  runs what is queued, then drops its session and its metrics' series.
- poll mode reads the repository every `repository_poll_secs`: a version is loaded once its file has stayed the
  same size and age for a whole interval (not while it is still being copied), a failure is reported and tried
  again only once the file changes, and a model folder that disappears is unloaded. A model's config.json is
  watched the same way: once a change of what it says (or its appearing or going) has stayed for an interval, the
  model's versions are loaded again with it, each old one serving until its new one is warmed up, as Triton
  reloads a model whose configuration changed. An explicit load applies a changed config.json the same way.
One load or unload per model at a time (a lock per model), and one load at a time overall (two big models coming
up at once must not double the peak memory).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from vitserve.service.engine import LOADING, READY, UNAVAILABLE, UNLOADING, IndexEntry, ModelHandle
from vitserve.service.engine.inference_model import InferenceModel, read_model_file_info
from vitserve.service.engine.routing import RoutingTable, VersionView
from vitserve.service.engine.runtime import load_model
from vitserve.service.engine.served_model import Loader, ServedModel
from vitserve.service.engine.shadow import Shadow
from vitserve.service.ground.errors import (
    ModelLoadError,
    ModelNotFound,
    ServiceError,
    ShadowNotConfigured,
    VersionRetired,
)
from vitserve.service.ground.memory import collect_cycles, give_freed_memory_back
from vitserve.service.ground.metrics import ServiceMetrics
from vitserve.service.ground.model_names import check_model_name
from vitserve.service.ground.settings import Settings
from vitserve.service.repository.layout import (
    ConfigFile,
    ModelEntry,
    VersionFile,
    same_config,
    single_file_source,
)

log = logging.getLogger("vitserve.repository")


class ModelSource(Protocol):
    """Where models come from: a repository folder (service/repository/layout.py) or a single file."""

    def names(self) -> list[str]: ...

    def entry(self, name: str) -> ModelEntry: ...


class SingleModel:
    """`--model FILE` (or a model object a test hands over): a repository of one model and one version, named as
    the file's metadata says."""

    def __init__(self, path: Path, model: InferenceModel | None = None):
        self.path, self.model = Path(path), model
        self._info = model.info if model is not None else None

    @property
    def name(self) -> str:
        return self._read().name

    @property
    def version(self) -> str:
        return self._read().version

    def _read(self):
        """The file's metadata, read when first needed (ModelLoadError on a bad file)."""
        if self._info is None:
            self._info = read_model_file_info(self.path)
        return self._info

    def names(self) -> list[str]:
        return [self.name]

    def entry(self, name: str) -> ModelEntry:
        if name != self.name:
            raise ModelNotFound(f"no model named {name!r}; this server serves {self.name!r}")
        if self.model is not None:
            return ModelEntry(name, versions={self.version: VersionFile(self.version, self.path, 0, 0)}, fixed=True)
        return single_file_source(self.path, self.name, self.version)


@dataclass(eq=False)
class VersionRecord:
    name: str
    version: str
    state: str
    reason: str = ""
    served: ServedModel | None = None
    file: VersionFile | None = None
    shadow: bool = False  # the model's shadow version (its config.json's `shadow`)
    config: ConfigFile | None = None  # its model's config.json as it was loaded with (None: there was none)


@dataclass
class _PollMemory:
    seen: dict[tuple[str, str], VersionFile] = field(default_factory=dict)  # each version's file at the last poll
    configs: dict[str, ConfigFile | None] = field(default_factory=dict)  # each model's config.json at the last poll
    failed: dict[str, tuple] = field(default_factory=dict)  # model -> the files and config.json whose load failed

    def settled(self, entry: ModelEntry, files: dict[str, VersionFile]) -> bool:
        """Whether `files` and the model's config.json are as the last poll saw them (not being written); what
        this poll sees is remembered for the next."""
        name = entry.name
        stable = all(self.seen.get((name, v)) == f for v, f in files.items()) and \
            name in self.configs and self.configs[name] == entry.config_file
        self.seen.update({(name, v): f for v, f in entry.versions.items()})
        self.configs[name] = entry.config_file
        return stable


class ModelRegistry:
    def __init__(self, source: ModelSource, settings: Settings, metrics: ServiceMetrics,
                 loader: Loader = load_model, retire_grace_s: float = 0.0):
        self.source, self.settings, self.metrics = source, settings, metrics
        self._loader = loader
        # How long a retiring version still takes requests already routed to it: frontends in other processes
        # learn of a new version a status interval after it is ready.
        self.retire_grace_s = retire_grace_s
        self.records: dict[tuple[str, str], VersionRecord] = {}
        self.model_problems: dict[str, str] = {}  # model -> why it cannot load at all (its config.json)
        self.generation = 0  # bumped on every change of state: remote frontends refetch the index
        self.on_change: Callable[[], None] = lambda: None
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # model -> its lock, and the calls using it
        self._one_load = asyncio.Semaphore(1)
        self._poller: asyncio.Task | None = None
        self._poll_memory = _PollMemory()
        self._background: set[asyncio.Task] = set()
        self._table: RoutingTable | None = None
        self.shadows: dict[str, Shadow] = {}  # model -> its shadow version's comparisons, while it has one

    # --- routing ---
    def route(self, name: str | None, version: str | None = None) -> ModelHandle:
        return self.table.route(name, version)

    @property
    def table(self) -> RoutingTable:
        """The versions' states and metadata as routing sees them (rebuilt after every change)."""
        if self._table is None:
            self._table = RoutingTable({key: VersionView(r.state, r.reason, r.served.info if r.served else None,
                                                         r.served.batching if r.served else {}, r.shadow,
                                                         r.served.version_policy if r.served else {},
                                                         r.served.serving if r.served else {})
                                        for key, r in self.records.items()}, dict(self.model_problems))
        return self._table

    def serving(self, name: str, version: str) -> ServedModel:
        """The version a request was routed to, while it still takes requests (ready, or retiring and in its
        grace); VersionRetired otherwise."""
        record = self.records.get((name, version))
        if record is None or record.served is None or record.served.closing or record.state not in (READY,
                                                                                                   UNLOADING):
            raise VersionRetired(f"model {name!r} version {version} is no longer served")
        return record.served

    def predicted_wait_s(self, name: str | None = None) -> float:
        waits = [r.served.predicted_wait_s() for (n, _), r in self.records.items()
                 if r.state == READY and r.served is not None and (name is None or n == name)]
        return min(waits) if name is None and waits else max(waits, default=0.0)

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        """Every model in the source and every version known, as Triton's repository index lists them."""
        entries = [IndexEntry(n, v, r.state, r.reason) for (n, v), r in self.records.items()
                   if not ready_only or r.state == READY]
        if not ready_only:
            known = {n for n, _ in self.records}
            try:
                names = self.source.names()
            except (OSError, ServiceError) as e:
                log.error("cannot read the model repository: %s", e)
                names = []
            entries += [IndexEntry(n, "", UNAVAILABLE, self.model_problems[n]) if n in self.model_problems
                        else IndexEntry(n) for n in names if n not in known]
        return sorted(entries, key=lambda e: (e.name, -int(e.version) if e.version.isdigit() else 0, e.version))

    def live_versions(self) -> set[tuple[str, str]]:
        return self.table.live()

    def shadow_report(self, name: str) -> dict:
        """Model `name`'s shadow comparisons so far; ModelNotFound for a model not served, ShadowNotConfigured for
        one without a shadow version."""
        shadow = self.shadows.get(name)
        if shadow is None:
            self.table.route(name)  # a model that is not served at all says so first
            raise ShadowNotConfigured(f"model {name!r} has no shadow version (its config.json names none)")
        return shadow.report()

    # --- changes ---
    async def load(self, name: str, *, warm: bool = True, strict: bool = True) -> None:
        """Serve the versions `name`'s policy picks. `strict`: a picked version folder without a usable file fails
        the load and changes nothing, as Triton's does; otherwise (startup) it is logged and passed over."""
        async with self._lock(name):
            entry = self.source.entry(check_model_name(name))  # ModelNotFound when the folder is gone
            if "" in entry.problems:
                self.model_problems[name] = entry.problems[""]
                for (n, _), record in self.records.items():
                    if n == name and record.state == READY:  # it serves on with the config it was loaded with
                        record.reason = f"reload failed: {entry.problems['']}"
                self._changed()
                raise ModelLoadError(f"model {name!r}: {entry.problems['']}")
            if self.model_problems.pop(name, None) is not None:
                self._changed()
            unusable = entry.unusable_wanted()
            if unusable and strict:
                raise ModelLoadError(f"model {name!r}: " + "; ".join(unusable.values()) + "; nothing changed")
            if unusable:
                log.warning("model %s: %s; serving the versions that have one", name, "; ".join(unusable.values()))
            wanted = entry.wanted()
            if not entry.serves():
                why = "; ".join(entry.problems.values()) or "no version folders"
                if entry.shadow_version in wanted:
                    why = f"its only version is the shadow version {entry.shadow_version}"
                raise ModelLoadError(f"model {name!r} has no version to serve: {why}")
            outcomes = [await self._load_version(entry, v, warm) for v in wanted]
            failures = [f for f in outcomes if f]
            if failures:
                raise ModelLoadError(f"model {name!r}: " + "; ".join(failures) + " (what was serving still is)")
            await self._set_shadow(entry)
            for (n, v), record in list(self.records.items()):
                if n == name and v not in wanted and record.state in (READY, LOADING):
                    await self._retire(record, _why_not_wanted(entry, v))

    async def _set_shadow(self, entry: ModelEntry) -> None:
        """Compare with the shadow the config names now (a changed config starts the comparison afresh)."""
        current = self.shadows.get(entry.name)
        config = entry.config.shadow if entry.shadow_version else None
        if current is not None and current.config == config:
            return
        if current is not None:
            await self.shadows.pop(entry.name).close()
        if config is not None:
            batch_size = entry.config.max_batch_size or self.settings.max_batch_size
            self.shadows[entry.name] = Shadow(entry.name, config, self.serving, self.metrics, batch_size,
                                              busy=lambda: self._serving_busy(entry.name))

    def _serving_busy(self, name: str) -> bool:
        """Whether a version of `name` other than its shadow has work queued or running."""
        return any(r.served is not None and r.served.busy for (n, _), r in self.records.items()
                   if n == name and not r.shadow)

    async def _load_version(self, entry: ModelEntry, version: str, warm: bool = True) -> str | None:
        """Bring `version` up and route to it once warmed up; the reason it failed, or None. Without `warm`
        (startup), it is left LOADING with its session: `warm_up_loading` finishes the job."""
        key, file = (entry.name, version), entry.versions[version]
        shadow = version == entry.shadow_version
        current, config = self.records.get(key), entry.config_file
        if current is not None and current.state == READY and current.file == file and \
                same_config(current.config, config):
            if current.shadow != shadow or current.reason:  # made the shadow or no longer (routing changes, the
                current.shadow, current.reason = shadow, ""  # session stays), or a failed reload since undone
                self._changed()
            return None  # the same file and config: nothing to load
        if current is None or current.state != READY:
            self.records[key] = VersionRecord(entry.name, version, LOADING, file=file, shadow=shadow, config=config)
            self._changed()
        try:
            served = await self._bring_up(entry, version, file, warm)
        except Exception as e:  # ModelLoadError, ORT's own errors, MemoryError, a failed warm-up
            reason = _reason(e)
            log.error("model %s version %s failed to load: %s", entry.name, version, reason)
            self.metrics.load_failed(entry.name)
            if current is not None and current.state == READY:
                current.reason = f"reload failed: {reason}"  # the old file goes on serving
            else:
                self.records[key] = VersionRecord(entry.name, version, UNAVAILABLE, reason, file=file, shadow=shadow,
                                                  config=config)
            self._changed()
            return f"version {version}: {reason}"
        self.records[key] = VersionRecord(entry.name, version, READY if warm else LOADING, served=served, file=file,
                                          shadow=shadow, config=config)
        self._changed()
        if current is not None and current.served is not None:  # a changed file or config replaced in place
            self._in_background(self._close_replaced(current.served, served))
        return None

    async def _close_replaced(self, old: ServedModel, new: ServedModel) -> None:
        """The session a changed file replaced, closed; the version's ready gauge (one for both: the same name and
        version) then says the new one's state again, not the closed one's."""
        await self._close(old)
        new.metrics.set_ready(new.ready)

    async def _bring_up(self, entry: ModelEntry, version: str, file: VersionFile, warm: bool) -> ServedModel:
        given = self.source.model if isinstance(self.source, SingleModel) else None  # a test's model object
        settings = self._settings_for(entry, file.path)
        shadow = entry.config.shadow if version == entry.shadow_version else None
        served = ServedModel(entry.name, version, settings, self.metrics.for_model(entry.name, version),
                             model=given, loader=self._loader, maps=entry.config.maps,
                             cpu_priority=shadow.cpu_priority if shadow else entry.config.cpu_priority,
                             version_policy={} if entry.fixed else entry.config.version_policy.model_dump(
                                 exclude_none=True))
        async with self._one_load:
            try:
                await served.load()
                if warm:
                    await served.warm_up()
            except BaseException:
                await self._close(served)
                raise
        return served

    def _settings_for(self, entry: ModelEntry, path: Path) -> Settings:
        """The server's settings with this version's file and its model's own batching limits."""
        config = entry.config
        own = (("max_batch_size", config.max_batch_size), ("max_queue_delay_ms", config.max_queue_delay_ms),
               ("max_queue_size", config.max_queue_size), ("intra_op_threads", config.intra_op_threads),
               ("runtime", config.runtime), ("precision_hint", config.precision_hint))
        overrides: dict[str, Any] = {"model_path": path, **{k: v for k, v in own if v is not None}}
        if "max_batch_size" in overrides:  # warm up at the model's own sizes
            overrides["warmup_batch_sizes"] = sorted({1, overrides["max_batch_size"]})
            overrides["max_relevance_batch_size"] = min(self.settings.max_relevance_batch_size,
                                                        overrides["max_batch_size"])
        return self.settings.model_copy(update=overrides)

    async def unload(self, name: str, reason: str = "unloaded") -> None:
        async with self._lock(check_model_name(name)):
            records = [r for (n, _), r in self.records.items() if n == name]
            if not records and name not in self.source.names():
                raise ModelNotFound(f"no model named {name!r}")
            if name in self.shadows:
                await self.shadows.pop(name).close()
            for record in records:
                if record.state in (READY, LOADING):
                    await self._retire(record, reason)

    async def _retire(self, record: VersionRecord, reason: str) -> None:
        record.state, record.reason = UNLOADING, ""
        self._changed()  # no new request is routed to it from here on
        if self.retire_grace_s:
            await asyncio.sleep(self.retire_grace_s)
        if record.served is not None:
            await self._close(record.served)
        record.state, record.reason, record.served = UNAVAILABLE, reason, None
        self.metrics.retire(record.name, record.version)
        self._changed()
        log.info("model %s version %s unloaded (%s)", record.name, record.version, reason)

    async def _close(self, served: ServedModel) -> None:
        await served.close(self.settings.drain_timeout_s)  # drops its session
        collect_cycles()  # the session's last references may sit in cycles: free its memory now, not some day
        give_freed_memory_back()

    # --- start, poll, stop ---
    async def start(self, names: list[str] | None = None, *, required: bool = False) -> None:
        """Load the sessions of `names` (None: every model of the source); `warm_up_loading` then warms them up
        and routes to them, so health probes are answered (not ready) meanwhile. `required`: a failure stops
        startup (a single file)."""
        for name in self.source.names() if names is None else names:
            try:
                await self.load(name, warm=False, strict=required)
            except ServiceError as e:
                if required:
                    raise
                log.error("at startup: %s", e)
        if self.settings.model_control_mode == "poll":
            self._poll_memory.seen = {(n, v): r.file for (n, v), r in self.records.items() if r.file}
            self._poll_memory.configs = {n: r.config for (n, _), r in self.records.items()}
            self._poller = asyncio.create_task(self._poll(), name="repository-poll")

    async def warm_up_loading(self) -> bool:
        """Warm up every version loaded by `start` and route to it; whether all of them made it."""
        all_ready = True
        for record, served in [(r, r.served) for r in self.records.values()
                               if r.state == LOADING and r.served is not None]:
            try:
                async with self._one_load:
                    if _retired(record, served):
                        continue
                    await served.warm_up()
            except Exception as e:  # not served: the index says why; the readiness probe tells the orchestrator
                log.exception("warm-up of %s version %s failed", record.name, record.version)
                self.metrics.load_failed(record.name)
                all_ready = False
                if record.served is served:
                    record.state, record.reason, record.served = UNAVAILABLE, f"warm-up failed: {_reason(e)}", None
                    await self._close(served)
            else:
                if _retired(record, served):
                    continue  # it stays as the retirement left it
                record.state = READY
            self._changed()
        return all_ready

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.settings.repository_poll_secs)
            try:
                await self.poll_once()
            except Exception:  # a poll that broke must not end polling
                log.exception("polling the model repository failed")

    async def poll_once(self) -> None:
        """One look at the repository: load what is new or changed and stable, unload what is gone."""
        memory, entries = self._poll_memory, await asyncio.to_thread(self._scan)
        for name in {n for n, _ in self.records} - set(entries):
            if any(r.state in (READY, LOADING) for (n, _), r in self.records.items() if n == name):
                log.info("model %s left the repository: unloading it", name)
                await self.unload(name, reason="its model folder left the repository")
        for name, entry in entries.items():
            files = {v: entry.versions[v] for v in entry.wanted()}
            signature = (tuple(sorted(files.items())), entry.config_file)
            if not memory.settled(entry, files) or memory.failed.get(name) == signature or \
                    not self._differs(entry, files):
                continue
            try:
                await self.load(name)
                memory.failed.pop(name, None)
            except ServiceError as e:
                memory.failed[name] = signature  # reported in the index; tried again once a file changes
                log.error("poll: %s", e)

    def _scan(self) -> dict[str, ModelEntry]:
        """Every model folder now; one that vanished between the listing and its reading is left out."""
        entries = {}
        for name in self.source.names():
            try:
                entries[name] = self.source.entry(name)
            except ServiceError as e:
                log.warning("poll: %s", e)
        return entries

    def _differs(self, entry: ModelEntry, files: dict[str, VersionFile]) -> bool:
        """Whether a load would change what serves model `entry.name`: its config.json is broken (a load reports it)
        or was (a load clears that), or the ready versions are not exactly `files`, each loaded with the config.json
        there is now."""
        if "" in entry.problems or entry.name in self.model_problems:
            return True
        serving = {v: r for (n, v), r in self.records.items() if n == entry.name and r.state == READY}
        return bool(files) and (serving.keys() != files.keys() or any(
            r.file != files[v] or not same_config(r.config, entry.config_file) for v, r in serving.items()))

    async def close(self, timeout_s: float) -> None:
        if self._poller:
            self._poller.cancel()
        for shadow in self.shadows.values():
            await shadow.close()
        serving = [(r, r.served) for r in self.records.values() if r.served is not None]
        for record, _ in serving:
            record.state = UNLOADING
        await asyncio.gather(*(served.close(timeout_s) for _, served in serving), return_exceptions=True)

    # --- helpers ---
    @asynccontextmanager
    async def _lock(self, name: str):
        """One load or unload of model `name` at a time. The lock lives while a call holds or awaits it: a lock
        kept for every name ever asked for would grow with each made-up name a client sends."""
        lock, users = self._locks.get(name, (asyncio.Lock(), 0))
        self._locks[name] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[name]
            if users == 1:
                del self._locks[name]
            else:
                self._locks[name] = (lock, users - 1)

    def _changed(self) -> None:
        self.generation += 1
        self._table = None
        self.on_change()

    def _in_background(self, work) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _retired(record: VersionRecord, served: ServedModel) -> bool:
    """Whether `served`, loading as `record`'s version, was retired by an unload or a poll while it waited or warmed
    up (its session closed)."""
    return record.served is not served or record.state != LOADING


def _why_not_wanted(entry: ModelEntry, version: str) -> str:
    """Why a loaded version of `entry` is retired by a load: its file is gone, or the policy no longer picks it."""
    if version in entry.versions:
        return f"version {version} is no longer in the version policy"
    return entry.problems.get(version) or f"version {version} is no longer in the repository (its folder is gone)"


def _reason(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text[:1000]


def model_source(settings: Settings, model: InferenceModel | None = None) -> ModelSource:
    """The repository folder, or the single file (or a test's model object) as a repository of one."""
    if settings.model_repository is not None:
        from vitserve.service.repository.layout import ModelRepository
        return ModelRepository(settings.model_repository)
    return SingleModel(settings.model_path, model)
