"""Pixel tensors between processes through shared memory: each HTTP frontend owns one `TensorArena`, writes
the arrays it submits into it, and the engine reads them there in place (`ArenaReader`); only their address
travels in the message. A region is freed when the engine's answer for it arrives.

A segment's pages count against /dev/shm (64 MB by default in Docker: docker-compose.yml sets `shm_size`);
`TensorArena.create` never asks for more than a share of what is free there.
"""
from __future__ import annotations

import asyncio
import bisect
import contextlib
import os
import secrets
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

from vitserve.service.ground.processes import pid_alive

ALIGNMENT = 64  # bytes: a cache line, and more than any dtype needs
NAME_PREFIX = "vitserve"


class ArenaFull(Exception):
    """No free region is large enough now."""


class TensorArena:
    """A shared-memory segment with first-fit allocation of aligned regions (one event loop uses it)."""

    def __init__(self, segment: shared_memory.SharedMemory):
        self.segment = segment
        self.size = segment.size
        self._free: list[tuple[int, int]] = [(0, self.size)]  # (offset, length), sorted by offset, coalesced
        self._released = asyncio.Event()

    @classmethod
    def create(cls, size: int, shm_dir: str = "/dev/shm", share: float = 0.25) -> TensorArena:
        """A new segment of `size` bytes, or of `share` of what is free in `shm_dir` if that is less."""
        try:
            stats = os.statvfs(shm_dir)
            size = min(size, int(stats.f_bavail * stats.f_frsize * share))
        except OSError:
            pass
        name = f"{NAME_PREFIX}-{os.getpid()}-{secrets.token_hex(4)}"
        return cls(shared_memory.SharedMemory(name=name, create=True, size=max(size, ALIGNMENT)))

    @property
    def name(self) -> str:
        return self.segment.name

    def put(self, array: np.ndarray) -> int:
        """Copy `array` into a free region; its offset. ArenaFull if no region fits."""
        length = -(-max(array.nbytes, 1) // ALIGNMENT) * ALIGNMENT
        for i, (offset, free) in enumerate(self._free):
            if free >= length:
                self._free[i:i + 1] = [(offset + length, free - length)] if free > length else []
                np.ndarray(array.shape, array.dtype, buffer=self.segment.buf, offset=offset)[...] = array
                return offset
        raise ArenaFull(f"{array.nbytes} bytes do not fit in the {self.size}-byte arena now")

    async def put_when_free(self, array: np.ndarray, timeout_s: float) -> int:
        """`put`, waiting up to `timeout_s` for regions to be released (asyncio.TimeoutError after)."""
        try:
            return self.put(array)  # room at once, nearly always: no timeout to arm
        except ArenaFull:
            if array.nbytes > self.size:
                raise
        async with asyncio.timeout(timeout_s):
            while True:  # nothing was released since the failed put: no await between them
                self._released.clear()
                await self._released.wait()
                with contextlib.suppress(ArenaFull):
                    return self.put(array)

    def release(self, offset: int, nbytes: int) -> None:
        length = -(-max(nbytes, 1) // ALIGNMENT) * ALIGNMENT
        i = bisect.bisect(self._free, (offset, 0))
        start, end = offset, offset + length
        if i < len(self._free) and self._free[i][0] == end:  # merge with the next free region
            end += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == start:  # and with the previous one
            start = self._free[i - 1][0]
            self._free[i - 1] = (start, end - start)
        else:
            self._free.insert(i, (start, end - start))
        self._released.set()

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self._free)

    def close(self) -> None:
        """Unmap and remove the segment (the engine maps it by name; its own mapping stays valid)."""
        self.segment.close()
        try:
            self.segment.unlink()
        except FileNotFoundError:
            pass


def owner_pid(name: str) -> int | None:
    """The pid of the process that made the segment `name` (`vitserve-<pid>-<token>`), if it is one of ours."""
    parts = name.lstrip("/").split("-")
    return int(parts[1]) if len(parts) == 3 and parts[0] == NAME_PREFIX and parts[1].isdigit() else None


def remove_orphaned_segments(shm_dir: str = "/dev/shm") -> list[str]:
    """Unlink our segments whose maker is gone (an HTTP worker killed before it could): their pages would stay
    in /dev/shm until the server stops. Returns the names removed."""
    removed = []
    for path in Path(shm_dir).glob(f"{NAME_PREFIX}-*-*"):
        pid = owner_pid(path.name)
        if pid is not None and not pid_alive(pid):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


class ArenaReader:
    """The engine's side: frontends' segments mapped by name, arrays read in place."""

    def __init__(self) -> None:
        self._segments: dict[str, shared_memory.SharedMemory] = {}

    def array(self, name: str, offset: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        segment = self._segments.get(name)
        if segment is None:
            for known in list(self._segments):  # a new worker: a good moment to unmap those that are gone
                pid = owner_pid(known)
                if pid is not None and not pid_alive(pid):
                    self.forget(known)
            # Python 3.11 registers a segment it only attaches to with the resource tracker too. The tracker is
            # the one `vitserve serve` started and its frontends share (spawned processes inherit it), so this
            # adds nothing: it unlinks a segment only if the frontend that made it never could.
            segment = self._segments[name] = shared_memory.SharedMemory(name=name)
        return np.ndarray(shape, np.dtype(dtype), buffer=segment.buf, offset=offset)

    def forget(self, name: str) -> None:
        segment = self._segments.pop(name, None)
        if segment is not None:
            try:
                segment.close()
            except BufferError:  # an array still views it: unmapped when the last view goes
                pass

    def close(self) -> None:
        for name in list(self._segments):
            self.forget(name)
