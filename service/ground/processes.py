"""Processes: whether one is still there, by pid (the one check behind every per-process file the workers leave:
metrics, shared memory segments, repository views, that a reader must tell from a dead worker's), and the cores
this one may run on."""
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


def usable_cores() -> int:
    """The cores this process may run on: its affinity (`taskset`, a container's cpuset), not the machine's count
    (`os.cpu_count`), so a server pinned to one core of two sizes its workers and threads for one."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity call on this system (macOS)
        return os.cpu_count() or 1
