"""Whether a process is still there, by pid: the one check behind every per-process file the workers leave (metrics,
shared memory segments, repository views) that a reader must tell from a dead worker's."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: does the process exist?
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, not ours to judge
        pass
    return True
