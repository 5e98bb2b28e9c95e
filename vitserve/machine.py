"""Facts about the machine a measurement ran on, read from /proc: the training report and the benchmark both
state them, so they are read one way, here. Standard library only; off Linux each answers "unknown" or 0.
"""
from __future__ import annotations

import os
from pathlib import Path


def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first processor's `model name` from /proc/cpuinfo, e.g. 'AMD EPYC'."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def has_int8_dot_product(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU multiplies int8 vectors natively (VNNI: AVX512-VNNI or AVX-VNNI; AMX on newer Xeons), where
    an int8 model runs about twice as fast as float32 (docs/int8.md)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return False


def load_average() -> str:
    """The 1, 5 and 15 minute load averages as '1.20 / 1.59 / 1.78'."""
    return " / ".join(f"{v:.2f}" for v in os.getloadavg())


def machine_busy_seconds(stat: Path = Path("/proc/stat")) -> float:
    """CPU seconds all cores together have spent busy since boot (everything but idle and iowait)."""
    try:
        cpu = stat.read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in cpu[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants, from the parent ids in /proc/*/stat (empty when `pid` is gone)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                ppid = int(Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    if not Path(f"/proc/{pid}").exists():
        return []
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def process_tree_cpu_seconds(pid: int | None) -> float:
    """`process_cpu_seconds` of `pid` and of its descendants now alive: a server's HTTP workers and engines."""
    return sum(process_cpu_seconds(p) for p in process_tree(pid)) if pid is not None else 0.0


def process_cpu_seconds(pid: int | None) -> float:
    """User plus system CPU seconds of process `pid` (its own threads, not its children); 0 when it is gone."""
    return 0.0 if pid is None else _cpu_seconds(Path(f"/proc/{pid}/stat"))


def main_thread_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process `pid`'s main thread alone (a server's event loop runs there); 0 when
    it is gone."""
    return _cpu_seconds(Path(f"/proc/{pid}/task/{pid}/stat"))


def _cpu_seconds(stat: Path) -> float:
    try:
        # the command name in parentheses may hold spaces: count the fields after its closing parenthesis
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
