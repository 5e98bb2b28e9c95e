"""What the reliability modes (`vitserve bench --mode overload|hol|soak`) share: their one set of defaults, the
servers under test (this code; up to two checkouts alternated round by round; or arms, this code with different
settings, alternated the same way), the server's process tree read from /proc (CPU, resident memory, open file
descriptors), and writing a report.

Standard library only: `vitserve` imports this module for every command (the help text shows its defaults); the
modes themselves live in bench/overload.py (overload) and bench/soak.py (head-of-line and soak).
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from vitserve.bench.config import LOOPBACK
from vitserve.bench.servers import ServerProcess
from vitserve.machine import process_tree

if TYPE_CHECKING:  # bench/oip.py imports this module
    from vitserve.bench.oip import OipConfig

MODES = ("overload", "hol", "soak")

# Arms: this code served with different settings, compared in one alternating run (`--arms refuse,degrade`). Under
# load the server either refuses (429) or answers at a cheaper token budget (service/engine/budgets.py).
ARMS: dict[str, dict[str, str]] = {
    "refuse": {"degrade_under_load": "false"},
    "degrade": {"degrade_under_load": "true"},
}
FULL_BUDGET_ARM = "refuse"  # every answer at the full budget: the arm whose closed loop is the saturation
DEGRADING_ARM = "degrade"


@dataclass
class ReliabilityConfig:
    mode: str = "overload"
    model: str = "models/vit-fmnist/model.onnx"  # an ONNX artifact, or a name in bench/presets.py
    out: Path | None = None  # None: build/bench/<mode>.md
    checkouts: list[Path] = field(default_factory=list)  # none: this code; two: alternated round by round
    arms: list[str] = field(default_factory=list)  # names in ARMS: this code, each arm's settings, alternated
    server_args: list[str] = field(default_factory=list)  # extra `vitserve serve` flags, the same for every server
    rounds: int = 1  # overload and head-of-line runs per server
    # the cores the servers and this process (the load generator) may run on; None: every core, shared. Apart, the
    # generator's CPU is not taken from the server it measures (on two cores: a one-core server, one core of load)
    server_cpus: tuple[int, ...] | None = None
    client_cpus: tuple[int, ...] | None = None
    num_images: int = 8
    seed: int = 0
    cache_dir: Path = Path("build/bench-models")
    log_dir: Path = Path("build/bench-logs")
    # overload: saturation by a closed loop, then an open loop at each of `overload_factors` x saturation
    overload_factors: list[float] = field(default_factory=lambda: [2.0])
    rate: float | None = None  # requests/s offered; None: each factor x the saturation measured
    saturation_clients: list[int] = field(default_factory=lambda: [32, 64])  # the best level is saturation
    saturation_s: float = 5.0
    overload_warmup_s: float = 2.0  # open loop before the measured window (the queue fills)
    overload_s: float = 25.0  # the measured window
    unloaded_requests: int = 50  # one client, one at a time, before the load: the latency to compare with
    probes: int = 10  # one client, one at a time, from the moment the load stops
    max_connections: int = 4000  # the open loop's connection cap (a request finding none free is "not sent")
    timeout_margin_s: float = 5.0  # the client waits the server's deadline plus this before it counts a timeout
    # head-of-line: small requests on a fixed schedule while heavy ones run
    # small requests per second; None: 20, or half the one-at-a-time rate when lower (a slow model like ViT-S/16)
    hol_rate: float | None = None
    hol_repeats: int = 3  # heavy pairs, one after the other
    hol_png_side: int = 6320  # the heavy greyscale PNG (classified with ?rollout=png)
    hol_oip_shape: tuple[int, int, int] = (32, 128, 128)  # the heavy Open Inference request: batch, height, width
    hol_phase_s: float = 2.0  # small requests alone, before the first heavy pair and after the last
    heavy_timeout_s: float = 300.0
    settle_s: float = 5.0  # hol and soak: idle after the load, before memory is read again
    memory_limit_mb: float = 1024.0
    # soak: mixed traffic, good and bad, at `soak_load` x saturation for `soak_minutes`
    soak_minutes: float = 10.0
    soak_load: float = 0.5
    soak_rate: float | None = None  # requests/s; None: soak_load x the lowest saturation measured
    sample_s: float = 5.0  # memory and file descriptors are read this often

    @property
    def report_path(self) -> Path:
        return self.out or Path(f"build/bench/{self.mode}.md")


# ---------------------------------------------------------------------------------------------------- servers


@dataclass(frozen=True)
class ServerUnderTest:
    """`vitserve serve` from this code (checkout None) or from another checkout, started as a user would; an arm
    (a name in ARMS) serves this code with that arm's settings over the run's own."""

    checkout: Path | None = None
    arm: str | None = None

    @property
    def label(self) -> str:
        return self.arm or (str(self.checkout.resolve()) if self.checkout else "this code")

    @property
    def slug(self) -> str:
        """The label as a file name (for the server's log)."""
        return self.arm or ("-".join(self.checkout.resolve().parts[1:]) if self.checkout else "this-code")

    @property
    def arm_settings(self) -> dict[str, str]:
        return ARMS[self.arm] if self.arm else {}

    @property
    def python(self) -> str:
        """The checkout's own virtual environment when it has one, else this interpreter."""
        own = self.checkout.resolve() / ".venv" / "bin" / "python" if self.checkout else None
        return str(own) if own and own.exists() else sys.executable

    def argv(self, model_path: Path, port: int, server_args: list[str]) -> list[str]:
        # -P: the bench's working directory must not come first on the path and shadow the checkout's packages
        prefix = [self.python, "-P"] if self.checkout else [sys.executable]
        return [*prefix, "-m", "vitserve.cli", "serve", "--model", str(model_path.resolve()), "--host", LOOPBACK,
                "--port", str(port), *server_args]

    def env(self, overrides: dict[str, str]) -> dict[str, str]:
        env = {"VITSERVE_LOG_LEVEL": "warning", "VITSERVE_GRPC_PORT": "0",
               **{f"VITSERVE_{k.upper()}": v for k, v in {**overrides, **self.arm_settings}.items()}}
        if self.checkout:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.checkout.resolve()),
                                                              os.environ.get("PYTHONPATH")]))
        return env

    def describe(self, overrides: dict[str, str], server_args: list[str]) -> dict:
        """What ran: the code's commit (and uncommitted changes), the interpreter, the server's settings."""
        where = self.checkout or Path.cwd()
        return {"label": self.label, "path": shown_path(where), "python": shown_path(Path(self.python)),
                "commit": _git(where, "rev-parse", "HEAD"),
                "uncommitted_files": len((_git(where, "status", "--porcelain") or "").splitlines()),
                "arm_settings": self.arm_settings, "settings": self.settings(overrides, server_args)}

    def settings(self, overrides: dict[str, str], server_args: list[str]) -> dict:
        """The server's effective `Settings`, read by the checkout's own code with the same variables and flags."""
        flags = {a[2:].replace("-", "_").upper(): v for a, v in zip(server_args[::2], server_args[1::2])}
        env = {**os.environ, **self.env(overrides), **{f"VITSERVE_{k}": v for k, v in flags.items()}}
        code = SETTINGS_READER
        argv = [self.python, "-P", "-c", code] if self.checkout else [sys.executable, "-c", code]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-500:]}

    def start(self, model_path: Path, port: int, cfg: ReliabilityConfig | OipConfig, overrides: dict[str, str],
              log_name: str) -> ServerProcess:
        """The server, started; `cfg` gives its flags, its log's folder and (the reliability modes) its cores."""
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        argv = self.argv(model_path, port, cfg.server_args)
        cpus = getattr(cfg, "server_cpus", None)  # the oip bench's config chooses no cores
        if cpus:  # taskset execs the server: the pid stays the server's, and it sizes itself to these
            argv = ["taskset", "--cpu-list", cpu_list(cpus), *argv]
        return ServerProcess(argv, port, env=self.env(overrides), log_path=cfg.log_dir / f"{log_name}.log")


def shown_path(path: Path) -> str:
    """A path as a report shows it: from the working directory (the checkout) when it is inside it, so a page names
    no machine's folders; as given otherwise (a checkout the command named)."""
    if path.is_absolute() and path.is_relative_to(Path.cwd()):
        return str(path.relative_to(Path.cwd())) or "."
    return str(path)


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """taskset's list form ("1", "0,2", "0-3") as the sorted cores, each one this process may run on."""
    cpus: set[int] = set()
    for part in text.split(","):
        span = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if span is None or int(span[2] or span[1]) < int(span[1]):
            raise ValueError(f"expected cores like 0 or 0,2 or 0-3, got {text!r}")
        cpus.update(range(int(span[1]), int(span[2] or span[1]) + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ValueError(f"cores {text!r}: this process may run on {cpu_list(tuple(sorted(allowed)))} only")
    return tuple(sorted(cpus))


def cpu_list(cpus: tuple[int, ...]) -> str:
    return ",".join(map(str, cpus))


def pin_load_generator(cfg: ReliabilityConfig) -> None:
    """This process (the load generator) on `client_cpus`, before it starts anything; its children (servers and
    their settings readers) are pinned again by `start`."""
    if cfg.client_cpus:
        os.sched_setaffinity(0, cfg.client_cpus)


# Run by the checkout's own Python: its Settings under whichever name its layout gives them (this one's; before the
# ground floor, vitserve.service.settings; before the one import name, service.settings).
SETTINGS_READER = """
for name in ("vitserve.service.ground.settings", "vitserve.service.settings", "service.settings"):
    try:
        Settings = __import__(name, fromlist=["Settings"]).Settings
        break
    except ImportError:
        continue
print(Settings().model_dump_json())
"""


def _git(where: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def servers_under_test(cfg: ReliabilityConfig, overrides: dict[str, str] | None = None) -> list[ServerUnderTest]:
    """This code, the checkouts, or the arms; SystemExit for a set that cannot be compared."""
    if cfg.arms:
        return arms_under_test(cfg, overrides or {})
    if len(cfg.checkouts) > 2:
        raise SystemExit("vitserve bench: at most two --checkout directories (they are compared round by round)")
    for path in cfg.checkouts:
        if not (path / "service").is_dir():
            raise SystemExit(f"vitserve bench: {path} is not a vitserve checkout (no service/ in it)")
    return [ServerUnderTest(p) for p in cfg.checkouts] or [ServerUnderTest()]


def arms_under_test(cfg: ReliabilityConfig, overrides: dict[str, str]) -> list[ServerUnderTest]:
    if cfg.checkouts:
        raise SystemExit("vitserve bench: --arms and --checkout do not combine (arms compare settings on this code, "
                         "checkouts compare code trees); give one of them")
    unknown = [a for a in cfg.arms if a not in ARMS]
    if unknown or len(set(cfg.arms)) != len(cfg.arms):
        raise SystemExit(f"vitserve bench: --arms takes distinct names among {', '.join(ARMS)}, got "
                         f"{','.join(cfg.arms)}")
    fixed = sorted({k for a in cfg.arms for k in ARMS[a]} & set(overrides))
    if fixed:
        raise SystemExit(f"vitserve bench: the arms set {', '.join(fixed)} themselves: leave it out of --set")
    return [ServerUnderTest(arm=a) for a in cfg.arms]


_Arm = TypeVar("_Arm")  # a server, an encoding, a model file: whatever takes turns


def alternated(servers: list[_Arm], rounds: int) -> list[tuple[int, _Arm]]:
    """(round, server) in the order they run: A B, then B A, ... so that a machine whose speed drifts favours
    neither."""
    return [(r, s) for r in range(rounds) for s in (servers if r % 2 == 0 else servers[::-1])]


# ---------------------------------------------------------------------------------------------------- /proc


@dataclass
class TreeSample:
    """The server's processes at one moment: resident memory (the sum over processes), open descriptors, CPU."""

    t: float  # time.monotonic()
    processes: int
    rss_mb: float
    fds: int
    threads: int
    cpu_s: float  # user + system seconds so far, all processes


def sample_tree(pid: int) -> TreeSample:
    page, tick = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_CLK_TCK")
    rss = fds = threads = 0
    cpu = 0.0
    pids = process_tree(pid)
    for p in pids:
        try:
            rss += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * page
            stat = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            cpu += (int(stat[11]) + int(stat[12])) / tick  # utime + stime
            threads += int(stat[17])
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except (OSError, IndexError, ValueError):
            continue  # a process that ended between the listing and the reading
    return TreeSample(time.monotonic(), len(pids), rss / 2**20, fds, threads, cpu)


class TreeSampler:
    """Samples the server's process tree every `interval_s` in a thread while running (reading /proc takes a few
    milliseconds: it must not hold up the load generator's event loop)."""

    def __init__(self, pid: int, interval_s: float):
        self.pid, self.interval_s = pid, interval_s
        self.samples: list[TreeSample] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            self.samples.append(await asyncio.to_thread(sample_tree, self.pid))
            await asyncio.sleep(self.interval_s)

    async def __aenter__(self) -> TreeSampler:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.samples.append(await asyncio.to_thread(sample_tree, self.pid))

    @property
    def peak_rss_mb(self) -> float:
        return max((s.rss_mb for s in self.samples), default=float("nan"))


# ---------------------------------------------------------------------------------------------------- reports


def contention(env: dict, other_cores: list[float]) -> dict:
    """The run's end facts: load average, and the cores other processes used during the measured windows."""
    from vitserve.machine import load_average

    other = sum(other_cores) / len(other_cores) if other_cores else float("nan")
    return {**env, "loadavg_end": load_average(), "other_cores_mean": other, "contended": bool(other > 0.25)}


def write_report(report: dict, markdown: str, out: Path) -> list[Path]:
    """The Markdown and, beside it, the JSON it was made from."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown)
    data = out.with_suffix(".json")
    data.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return [out, data]


def preamble(report: dict, title: str) -> list[str]:
    """Title, command, machine and contention, model, and the servers that ran (commit, settings that differ)."""
    env, m = report["environment"], report["model"]
    lines = [f"# `vitserve bench --mode {report['mode']}`: {title}", "",
             f"`{report['command']}`, {env['date']}. Model `{m['path']}` ({m['name']} {m['version']}, "
             f"{m['height']}x{m['width']}, {m['channels']} channel(s), patch {m['patch_size']}). {env['cpu']} "
             f"({env['cpus']} CPUs), Python {env['python']}, onnxruntime {env['onnxruntime']}. Load average at start "
             f"{env['loadavg_start']}, at end {env['loadavg_end']}; other processes used **"
             f"{env['other_cores_mean']:.2f} cores** on average while the load ran "
             f"({'contended' if env['contended'] else 'quiet machine'}).", "", "Servers under test "
             "(`vitserve serve` in a child process on 127.0.0.1, default settings unless stated):", ""]
    for s in report["servers"]:
        dirty = f", {s['uncommitted_files']} uncommitted file(s)" if s["uncommitted_files"] else ""
        arm = "".join(f" {k}={v}" for k, v in s.get("arm_settings", {}).items())
        lines.append(f"- **{s['label']}**{arm}: commit `{(s['commit'] or 'unknown')[:12]}`{dirty}; `{s['python']}`; "
                     f"deadline (request_timeout_ms) {s['settings'].get('request_timeout_ms')} ms, max_queue_size "
                     f"{s['settings'].get('max_queue_size')}, max_batch_size {s['settings'].get('max_batch_size')}")
    settings = report["settings"]
    if settings.get("server_cpus") or settings.get("client_cpus"):
        servers, generator = (cpu_list(settings[k]) if settings[k] else "every core" for k in ("server_cpus",
                                                                                              "client_cpus"))
        lines.append(f"- cores: the servers on {servers}, the load generator on {generator} (`--server-cpus`, "
                     f"`--client-cpus`)")
    if settings["server_overrides"] or settings["server_args"]:
        lines.append(f"- settings under test: {settings['server_overrides']} {' '.join(settings['server_args'])}")
    return lines + [""]


def number(value, fmt: str = ".1f") -> str:
    """`value` formatted, or "-" for None and NaN."""
    return "-" if value is None or value != value else format(value, fmt)  # None or NaN


def table(header: list[str], rows: list[list[str]], text_columns: int = 1) -> list[str]:
    """A Markdown table; the first `text_columns` columns left-aligned, the numbers right-aligned."""
    align = [":---" if i < text_columns else "---:" for i in range(len(header))]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|", *("| " + " | ".join(r) + " |" for r in rows)]


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**missed**")
