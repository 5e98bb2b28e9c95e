"""`WorkerViews`: which repository generation each HTTP worker routes with, so that a load or unload is answered
only once every worker routes as it says (docs/repository.md, "Several HTTP workers").

Each worker learns of a change from its engine's status and then fetches the new index: a few milliseconds in
which a client, told by another worker that the load is done, could reach it and be answered "loading". So each
worker writes, after every index it applies, one small file named by its pid in a folder beside its first
engine's socket (the private folder `vitserve serve` makes): that engine's incarnation and the index's
generation. The worker that asked for the change reads the folder until every live worker has caught up.

Files and not engine messages: the engine cannot tell a worker that is silent from one that is gone, and a
reader of the folder can (the pid). Standard library only.
"""
from __future__ import annotations

import os
from pathlib import Path

from vitserve.service.ground.processes import pid_alive


class WorkerViews:
    def __init__(self, engine_address: str):
        # Only an ipc:// engine has a folder of its own (the one `vitserve serve` makes): elsewhere, no waiting.
        self.folder = Path(engine_address.removeprefix("ipc://") + ".views") \
            if engine_address.startswith("ipc://") else None
        if self.folder is not None:
            self.folder.mkdir(exist_ok=True)

    def publish(self, incarnation: str, generation: int) -> None:
        """This worker routes with `generation` of the engine `incarnation` from now on."""
        if self.folder is None:
            return
        written = self.folder / f".{os.getpid()}.new"
        written.write_text(f"{incarnation} {generation}")
        os.replace(written, self.folder / str(os.getpid()))  # a reader sees the old view or the new, never half

    def behind(self, incarnation: str, generation: int) -> list[int]:
        """The pids of the live workers that route with an older view than `generation` of `incarnation`."""
        if self.folder is None:
            return []
        lagging = []
        for path in self.folder.iterdir():
            if not path.name.isdigit():
                continue
            if not pid_alive(int(path.name)):
                path.unlink(missing_ok=True)  # a worker that died without withdrawing
                continue
            try:
                their_incarnation, theirs = path.read_text().split()
            except FileNotFoundError:  # it withdrew meanwhile
                continue
            if their_incarnation != incarnation or int(theirs) < generation:
                lagging.append(int(path.name))
        return lagging

    def withdraw(self) -> None:
        """This worker stops serving: nobody waits for it."""
        if self.folder is not None:
            (self.folder / str(os.getpid())).unlink(missing_ok=True)
