"""`RoutingTable`: which version a request for a model goes to, from the versions' states. The registry keeps
one over what it holds; a frontend in another process keeps one over the index its engine sends, so both
route by the same rules:

- a named version: that version if it is ready (404 if unknown, 503 with its state and reason if not ready);
- no version: the newest ready one that is not the model's shadow (service/engine/shadow.py);
- no model: the only model, when the server has one (a request to a server of several must name one).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vitserve.artifact import ModelInfo
from vitserve.service.engine import READY, UNAVAILABLE, ModelHandle, newest_first, same_geometry
from vitserve.service.ground.errors import (
    InvalidModelName,
    InvalidParameter,
    ModelNotFound,
    ModelUnavailable,
    VersionRetired,
)
from vitserve.service.ground.model_names import check_model_name, check_version


@dataclass(frozen=True)
class VersionView:
    state: str
    reason: str = ""
    info: ModelInfo | None = None  # while loaded
    batching: dict = field(default_factory=dict)  # its own batching limits (from its config.json)
    shadow: bool = False  # its model's shadow version: routed to only when a client names it
    version_policy: dict = field(default_factory=dict)  # its model's, as its config.json says ({}: none)
    serving: dict = field(default_factory=dict)  # how it is served and why (ServedModel.serving; {}: not loaded)


@dataclass
class RoutingTable:
    versions: dict[tuple[str, str], VersionView] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)  # model -> why it cannot load at all

    def route(self, name: str | None, version: str | None = None) -> ModelHandle:
        """The handle to run on; a name or version that cannot exist is a 404 like one that does not."""
        try:
            return self._route(name, version)
        except InvalidModelName as e:
            raise ModelNotFound(str(e)) from None

    def _route(self, name: str | None, version: str | None) -> ModelHandle:
        name = self.only_model() if name is None else check_model_name(name)
        versions = self._versions_of(name)
        if version is None:
            ready = [v for v in newest_first(versions) if versions[v].state == READY and not versions[v].shadow]
            if not ready:
                states = ", ".join(f"{v} {versions[v].state.lower()}" for v in newest_first(versions))
                raise ModelUnavailable(f"model {name!r} has no ready version ({states})")
            view = versions[ready[0]]
            assert view.info is not None, "a ready version is loaded"
            return ModelHandle(name, ready[0], view.info, batching=view.batching, version_policy=view.version_policy,
                               serving=view.serving)
        named = versions.get(version)
        if named is None:
            check_version(version)
            raise ModelNotFound(f"model {name!r} has no version {version!r}; it has "
                                f"{', '.join(newest_first(versions))}")
        if named.state != READY:
            raise ModelUnavailable(f"model {name!r} version {version} is {named.state.lower()}"
                                   + (f": {named.reason}" if named.reason else ""))
        assert named.info is not None, "a ready version is loaded"
        return ModelHandle(name, version, named.info, pinned=True, batching=named.batching,
                           version_policy=named.version_policy, serving=named.serving)

    def reroute(self, handle: ModelHandle) -> ModelHandle:
        """Where a request goes whose version was retired before it ran: unpinned, the newest ready version, if
        the image prepared for the old one fits it; VersionRetired otherwise (it never ran: the client may retry)."""
        if handle.pinned:
            raise VersionRetired(f"model {handle.name!r} version {handle.version} was unloaded before this request "
                                 f"ran")
        now = self.route(handle.name)
        if not same_geometry(now.info, handle.info):
            raise VersionRetired(f"model {handle.name!r} changed version ({handle.version} -> {now.version}) with a "
                                 f"different input geometry while this request was prepared: send it again")
        return now

    def _versions_of(self, name: str) -> dict[str, VersionView]:
        versions = {v: view for (n, v), view in self.versions.items() if n == name}
        if not versions:
            raise ModelNotFound(f"no model named {name!r} is loaded" +
                                (f" ({self.problems[name]})" if name in self.problems else "") + self._loaded_names())
        return versions

    def _loaded_names(self, shown: int = 10) -> str:
        """What a client who misspelt a name can pick from: the models with a ready version (the first `shown`)."""
        names = sorted({n for (n, _), view in self.versions.items() if view.state == READY})
        if not names:
            return "; no model is"
        more = f" and {len(names) - shown} more" if len(names) > shown else ""
        return "; loaded: " + ", ".join(names[:shown]) + more

    def only_model(self) -> str:
        names = sorted({n for (n, _), view in self.versions.items() if view.state != UNAVAILABLE})
        if len(names) == 1:
            return names[0]
        if not names:
            raise ModelUnavailable("no model is loaded")
        raise InvalidParameter(f"this server serves {len(names)} models ({', '.join(names[:20])}): name one "
                               f"(the `model` parameter)")

    def info(self, name: str, version: str) -> ModelInfo:
        view = self.versions.get((name, version))
        if view is None or view.info is None:
            raise ModelNotFound(f"model {name!r} version {version} is not loaded")
        return view.info

    def ready_versions(self, name: str | None = None) -> list[tuple[str, str]]:
        """The (model, version) pairs routed to now, of model `name` (None: every model), newest version first."""
        ready = [key for key, view in self.versions.items() if view.state == READY and name in (None, key[0])]
        models = sorted({model for model, _ in ready})
        return [(model, v) for model in models for v in newest_first([v for m, v in ready if m == model])]

    def live(self) -> set[tuple[str, str]]:
        return {key for key, view in self.versions.items() if view.state != UNAVAILABLE}
