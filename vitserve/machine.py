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


def process_cpu_seconds(pid: int | None) -> float:
    """User plus system CPU seconds of process `pid` (its own threads, not its children); 0 when it is gone."""
    if pid is None:
        return 0.0
    try:
        # the command name in parentheses may hold spaces: count the fields after its closing parenthesis
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
