"""The load: Debian's `wrk`, closed loop over keep-alive connections, one Lua script per server and path that sends
the same body every time (read from a file the script names), and its `--latency` report parsed into numbers.

wrk runs `min(connections, 2)` threads. Its requests/s counts every answer; `ok_per_s` counts the 2xx ones only
(wrk reports the others as "Non-2xx or 3xx responses"), so a server that answers fast refusals is not credited.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from vitserve.bench.peers.bodies import PeerRequest

INSTALL_HINT = "install it with `apt-get update && apt-get install -y wrk` (Debian's package)"
_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}
_NUMBER_UNIT = r"([\d.]+)(us|ms|s|m|h)"


def find_wrk() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise SystemExit(f"bench peers: no `wrk` on PATH; {INSTALL_HINT}")
    return path


def wrk_version(wrk: str) -> str:
    out = subprocess.run([wrk, "-v"], capture_output=True, text=True, timeout=10)
    return (out.stdout + out.stderr).splitlines()[0].split(" Copyright")[0] if out.stdout + out.stderr else "?"


def lua_script(body_path: Path, request: PeerRequest) -> str:
    """A script that POSTs the file's bytes, with the request's headers (wrk adds Host and Content-Length)."""
    lines = ["-- written by bench/peers/wrk.py: the same body on every request",
             f"local f = assert(io.open({lua_string(str(body_path.resolve()))}, \"rb\"))",
             "wrk.method = \"POST\"", "wrk.body = f:read(\"*a\")", "f:close()"]
    lines += [f"wrk.headers[{lua_string(k)}] = {lua_string(v)}" for k, v in request.headers.items()]
    return "\n".join(lines) + "\n"


def lua_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


# Appended to a script, this counts the answers' status codes (wrk says only how many were not 2xx or 3xx) and
# prints them at the end. A Lua call per response costs wrk time, so only a short extra run uses it.
STATUS_COUNTER = """
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) statuses = {} end
function response(status, headers, body) statuses[status] = (statuses[status] or 0) + 1 end
function done(summary, latency, requests)
  local total = {}
  for _, t in ipairs(threads) do
    for code, n in pairs(t:get("statuses")) do total[code] = (total[code] or 0) + n end
  end
  for code, n in pairs(total) do io.write(string.format("status %d: %d\\n", code, n)) end
end
"""


# Appended to a script, this prints the monotonic time of every 2xx answer (LuaJIT's ffi: wrk's Lua has no clock
# finer than a second). For a model slow enough that answers come back a batch at a time, wrk's count over its
# fixed window loses the work in flight when the window closes (up to a batch: a fifteenth of a 15 s window where a
# batch takes a second), which a session timed call by call does not; `steady_rate` counts from the first answer
# to the last instead. One Lua call and one table entry per
# answer: meant for runs of tens of answers a second, not thousands.
ANSWER_TIMES = """
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } vitserve_timespec;
int clock_gettime(int clock_id, vitserve_timespec *tp);
]]
local CLOCK_MONOTONIC = 1
local clock = ffi.new("vitserve_timespec")
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) answered_at = {} end
function response(status, headers, body)
  if status >= 200 and status < 300 then
    ffi.C.clock_gettime(CLOCK_MONOTONIC, clock)
    answered_at[#answered_at + 1] = tonumber(clock.tv_sec) + tonumber(clock.tv_nsec) * 1e-9
  end
end
function done(summary, latency, requests)
  for _, t in ipairs(threads) do
    for _, at in ipairs(t:get("answered_at")) do io.write(string.format("answered at %.6f\\n", at)) end
  end
end
"""


def write_script(directory: Path, name: str, request: PeerRequest) -> Path:
    """`name`.body, `name`.lua, `name`.status.lua (the same, counting status codes) and `name`.times.lua (the
    same, printing when each 2xx answer came) in `directory`; the script's path."""
    directory.mkdir(parents=True, exist_ok=True)
    body_path = directory / f"{name}.body"
    body_path.write_bytes(request.body)
    script = directory / f"{name}.lua"
    script.write_text(lua_script(body_path, request))
    script.with_suffix(".status.lua").write_text(lua_script(body_path, request) + STATUS_COUNTER)
    script.with_suffix(".times.lua").write_text(lua_script(body_path, request) + ANSWER_TIMES)
    return script


def parse_statuses(text: str) -> dict[str, int]:
    """The status counts a STATUS_COUNTER script printed, e.g. {"200": 877, "429": 438}."""
    return {code: int(n) for code, n in sorted(re.findall(r"^status (\d+): (\d+)$", text, re.M))}


_ANSWERED_AT = re.compile(r"^answered at ([\d.]+)\n", re.M)


def take_answer_times(text: str) -> tuple[list[float], str]:
    """The times an ANSWER_TIMES script printed, sorted, and wrk's report without them."""
    return sorted(float(t) for t in _ANSWERED_AT.findall(text)), _ANSWERED_AT.sub("", text)


def steady_rate(times: list[float], burst_gap_s: float) -> float | None:
    """Answers per second from the first answer to the last, for answers that come in bursts (a batch's answers
    within `burst_gap_s` of each other): the answers of every burst after the first over the time from the first
    burst's start to the last's. Bursts b apart in time t give b / t, however the window cut them; answers one at a
    time are bursts of one. None with fewer than two bursts."""
    starts, sizes = [], []
    for i, t in enumerate(times):
        if i == 0 or t - times[i - 1] > burst_gap_s:
            starts.append(t)
            sizes.append(0)
        sizes[-1] += 1
    if len(starts) < 2 or starts[-1] <= starts[0]:
        return None
    return sum(sizes[1:]) / (starts[-1] - starts[0])


def threads_for(connections: int) -> int:
    return min(connections, 2)


def wrk_argv(wrk: str, url: str, connections: int, duration_s: int, timeout_s: int, script: Path) -> list[str]:
    return [wrk, "-t", str(threads_for(connections)), "-c", str(connections), "-d", f"{duration_s}s",
            "--timeout", f"{timeout_s}s", "--latency", "-s", str(script), url]


def _ms(number: str, unit: str) -> float:
    return float(number) * _UNITS_MS[unit]


def parse_wrk(text: str) -> dict:
    """wrk's `--latency` report -> requests, seconds, req/s (all and 2xx only), p50/p75/p90/p99 in ms, non-2xx,
    socket errors."""
    done = re.search(r"(\d+) requests in " + _NUMBER_UNIT, text)
    rate = re.search(r"Requests/sec:\s+([\d.]+)", text)
    if not done or not rate:
        raise ValueError(f"not a wrk report: {text[-500:]!r}")
    requests, seconds = int(done.group(1)), _ms(done.group(2), done.group(3)) / 1000
    percentiles = {f"p{p}_ms": _ms(n, u) for p, n, u in re.findall(r"^\s+(\d+)%\s+" + _NUMBER_UNIT, text, re.M)}
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    socket_errors = dict(zip(("connect", "read", "write", "timeout"), map(int, errors.groups()))) if errors else {}
    bad = int(non_2xx.group(1)) if non_2xx else 0
    return {"requests": requests, "seconds": seconds, "requests_per_s": float(rate.group(1)),
            "ok_per_s": (requests - bad) / seconds if seconds else 0.0, **percentiles, "non_2xx": bad,
            "socket_errors": socket_errors}


def run_wrk(argv: list[str], timeout_s: float) -> dict:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"wrk exited {out.returncode}: {out.stderr[-500:] or out.stdout[-500:]}")
    return {**parse_wrk(out.stdout), "wrk_output": out.stdout}
