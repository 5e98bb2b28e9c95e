"""GET /v1/models/{name}/inspect: the paper's Figure 7 numbers of a served version.

`vitserve export` computes them from the float32 model and stores them in the file's metadata
(vitserve.artifact.INSPECTION_KEY); the server has no torch, so it reads them back rather than computing them. A
version's numbers are read from its file once, without a session (vitserve.onnx_header), and kept while the file
is unchanged. Finding and reading the file are file-system work: they run in a thread, off the event loop.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from pathlib import Path

from vitserve.artifact import ArtifactError
from vitserve.onnx_header import read_stored_inspection
from vitserve.service.engine import ModelHandle
from vitserve.service.ground.errors import InspectionNotStored, ModelNotFound
from vitserve.service.ground.settings import Settings
from vitserve.service.repository.layout import ModelRepository

KEPT = 16  # versions whose numbers are kept (a ViT-B/16's are about 1 MB of JSON)


def version_file(settings: Settings, handle: ModelHandle) -> tuple[Path, int, int]:
    """The file the routed version was loaded from (the repository's, or --model's), its size and mtime_ns."""
    if settings.model_repository is None:
        stat = Path(settings.model_path).stat()
        return Path(settings.model_path), stat.st_size, stat.st_mtime_ns
    found = ModelRepository(settings.model_repository).version_file(handle.name, handle.version)
    if found is None:  # removed from disk since it was loaded
        raise ModelNotFound(f"model {handle.name!r} version {handle.version}: its file is no longer in the repository")
    return found.path, found.size, found.mtime_ns


class InspectionCache:
    """Each version's stored inspection, keyed by the version and its file's path, size and modification time (two
    versions may share one file through links, and each answer names its own)."""

    def __init__(self, kept: int = KEPT):
        self._kept = kept
        self._entries: OrderedDict[tuple, dict] = OrderedDict()

    async def get(self, settings: Settings, handle: ModelHandle) -> dict:
        path, size, mtime_ns = await asyncio.to_thread(version_file, settings, handle)
        key = (handle.name, handle.version, str(path), size, mtime_ns)
        if key not in self._entries:
            self._entries[key] = await asyncio.to_thread(_read, path, handle)
            while len(self._entries) > self._kept:
                self._entries.popitem(last=False)
        self._entries.move_to_end(key)
        return self._entries[key]


def _read(path: Path, handle: ModelHandle) -> dict:
    try:
        data = read_stored_inspection(path)
    except ArtifactError as e:
        raise InspectionNotStored(f"model {handle.name!r} version {handle.version}: {e}") from None
    if data is None:
        raise InspectionNotStored(f"model {handle.name!r} version {handle.version} was exported without its "
                                  "inspection: export it again with `vitserve export` (--inspection-images, "
                                  "default 256) to serve it")
    return {"model_name": handle.name, "model_version": handle.version, **data}
