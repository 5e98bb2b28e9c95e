"""`python -m vitserve.bench.tail`: where the slowest answers of a closed loop wait, stage by stage.

A closed loop of `--clients` keep-alive connections (Debian's wrk) sends the PNG to `vitserve serve --model M
--server-timing true` on `--path`: `image`, its bytes as the body of `POST /v1/classify?top_k=5`; `oip-json` and
`oip-binary`, the server's own preprocessing of it as an Open Inference Protocol tensor, JSON or binary, to `POST
/v2/models/NAME/infer` (bench/peers/bodies.py, the peers bench's requests); a Lua script keeps every answer's
Server-Timing header (docs/latency-budget.md names the stages). Per arm and round: wrk's req/s, p50 and p99 (the
client's view); each stage's p50, p90 and p99 over the answers, and its mean over the slowest 1% of them by the
server's `total`; the mean batch over the window, from the server's `vitserve_batch_size` histogram.

Arms are settings, given as environment variables: `--arm NAME:VITSERVE_X=V[,VITSERVE_Y=W]` (`--arm base:` the
defaults); `--baseline-commit REV` adds an arm serving that commit's tree with its defaults (`git archive`), so a
change's before and after alternate in one run. Each arm gets a fresh server every round, after `--warmup-s` of the
same load; the arms alternate within a round, their order reversed every other round, as this machine's speed drifts
within minutes. The bench's own environment reaches every arm (`VITSERVE_RUNTIME=onnxruntime python -m
vitserve.bench.tail ...` pins the runtime for all of them). Output: Markdown and JSON (`--out`).
"""
from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path
from types import SimpleNamespace

from vitserve.bench.config import LOOPBACK
from vitserve.bench.latency_budget import percentile, stages_of
from vitserve.bench.peers.bodies import PeerRequest, peer_request
from vitserve.bench.peers.wrk import find_wrk, lua_script, lua_string, run_wrk, wrk_argv
from vitserve.bench.raw import preprocessed
from vitserve.bench.report import at_least, command_line, publish
from vitserve.bench.servers import ServerProcess, free_port, scrape_metrics, serve_argv
from vitserve.machine import cpu_model_name, load_average

DEFAULT_MODEL = Path("models/vit-fmnist/model.onnx")
DEFAULT_IMAGE = Path("examples/ankle-boot.png")
STAGES = ("accept", "admit", "route", "body", "parse", "decode", "decode_wait", "queue", "inference", "engine_hop",
          "postprocess", "encode", "total")
BATCH_METRICS = ("vitserve_batch_size_sum", "vitserve_batch_size_count")  # images batched, batches: every model's
_ARM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,40}$")
_VARIABLE = re.compile(r"^VITSERVE_[A-Z0-9_]{1,60}$")

# Appended to the request's script: every answer's Server-Timing header, written to the file `path` when wrk ends
# (one Lua call and one table entry per answer: wrk's own rate falls by a few percent, the same for every arm).
TIMINGS = """
local threads = {{}}
function setup(thread) table.insert(threads, thread) end
function init(args) timings = {{}} end
function response(status, headers, body)
  if status == 200 then timings[#timings + 1] = headers["server-timing"] or headers["Server-Timing"] or "" end
end
function done(summary, latency, requests)
  local out = assert(io.open({path}, "w"))
  for _, t in ipairs(threads) do
    for _, line in ipairs(t:get("timings")) do out:write(line, "\\n") end
  end
  out:close()
end
"""


def parse_arm(text: str) -> tuple[str, dict[str, str]]:
    """`NAME:VITSERVE_X=V,VITSERVE_Y=W` -> (NAME, {VITSERVE_X: V, ...}); `NAME:` for the defaults."""
    name, sep, rest = text.partition(":")
    if not sep or not _ARM_NAME.match(name):
        raise argparse.ArgumentTypeError(f"an arm is NAME:VITSERVE_X=V[,...] with a NAME of letters, digits, "
                                         f"'_', '.', '-' (got {text!r})")
    variables: dict[str, str] = {}
    for pair in filter(None, rest.split(",")):
        key, eq, value = pair.partition("=")
        if not eq or not _VARIABLE.match(key):
            raise argparse.ArgumentTypeError(f"{pair!r} in arm {name!r} is not VITSERVE_NAME=VALUE")
        variables[key] = value
    return name, variables


def summarise(budgets: list[dict[str, float]]) -> dict:
    """Each stage's p50, p90 and p99 in ms over the answers, and its mean over the slowest 1% by `total`."""
    if not budgets:
        return {"answers": 0, "stages": {}}
    slowest = sorted(budgets, key=lambda b: b.get("total", 0.0))[-max(1, len(budgets) // 100):]
    stages = {}
    for name in [s for s in STAGES if any(s in b for b in budgets)]:
        values = [b.get(name, 0.0) for b in budgets]
        stages[name] = {"p50": percentile(values, 0.5), "p90": percentile(values, 0.9),
                        "p99": percentile(values, 0.99),
                        "slowest_1pct_mean": statistics.fmean(b.get(name, 0.0) for b in slowest)}
    return {"answers": len(budgets), "stages": stages}


def the_request(model: Path, png: bytes, path: str) -> PeerRequest:
    """What the loop sends on `path`: the peers bench's request for vitserve, the tensor paths carrying vitserve's own
    preprocessing of `png` for `model`."""
    from vitserve.service.engine.inference_model import read_model_file_info

    info = read_model_file_info(model)
    pixels = preprocessed(SimpleNamespace(info=info), [png])  # (1, C, H, W); it reads only the model's info
    return peer_request("vitserve", path, png, pixels, info.name)


def measure_arm(args, name: str, variables: dict[str, str], script_dir: Path, wrk: str, request: PeerRequest,
                source: Path | None = None) -> dict:
    """One arm's server (the tree's code, or `source`'s) under the loop: warm-up, then the measured window."""
    port = free_port()
    timings_path = script_dir / f"{name}.timings"
    body_path = script_dir / "request.body"
    body_path.write_bytes(request.body)
    script = script_dir / f"{name}.lua"
    script.write_text(lua_script(body_path, request) + TIMINGS.format(path=lua_string(str(timings_path.resolve()))))
    query = "?top_k=5" if args.path == "image" else ""
    url = f"http://{LOOPBACK}:{port}{request.target}{query}"
    env = {"VITSERVE_LOG_LEVEL": "warning", "VITSERVE_GRPC_PORT": "0", "VITSERVE_SERVER_TIMING": "true",
           **variables}
    argv = serve_argv(args.model.resolve(), port)
    if source is not None:  # -P: this repository, the working directory, must not come first and shadow `source`
        argv.insert(1, "-P")
        env["PYTHONPATH"] = str(source)
    with ServerProcess(argv, port, env=env, log_path=script_dir / f"{name}.log"):
        run_wrk(wrk_argv(wrk, url, args.clients, args.warmup_s, 30, script), args.warmup_s + 60)
        before = scrape_metrics(port, BATCH_METRICS)
        load = run_wrk(wrk_argv(wrk, url, args.clients, args.duration_s, 30, script), args.duration_s + 60)
        after = scrape_metrics(port, BATCH_METRICS)
    budgets = [stages_of(line) for line in timings_path.read_text().splitlines() if line]
    images, batches = (after.get(name, 0.0) - before.get(name, 0.0) for name in BATCH_METRICS)
    return {"arm": name, "settings": variables, "requests_per_s": load["requests_per_s"],
            "p50_ms": load.get("p50_ms"), "p99_ms": load.get("p99_ms"), "non_2xx": load["non_2xx"],
            "socket_errors": load["socket_errors"],
            "mean_batch": images / batches if batches else None, **summarise(budgets)}


def run(args, command: str, work_dir: Path) -> dict:
    wrk = find_wrk()
    request = the_request(args.model, args.image.read_bytes(), args.path)
    arms = args.arm or [("base", {})]
    sources: dict[str, Path] = {}
    if args.baseline_commit:
        from vitserve.bench.peers.servers import export_commit

        tree, sha = export_commit(args.baseline_commit, work_dir / "baseline")
        sources[sha[:12]] = tree
        arms = [*arms, (sha[:12], {})]
    rows = []
    for round_ in range(args.rounds):
        order = arms if round_ % 2 == 0 else arms[::-1]
        for name, variables in order:
            row = {"round": round_ + 1, **measure_arm(args, name, variables, work_dir, wrk, request, sources.get(name))}
            queue = row["stages"].get("queue", {})
            print(f"round {row['round']} {name}: {row['requests_per_s']:.1f} req/s, p50 {row['p50_ms']:.1f} ms, "
                  f"p99 {row['p99_ms']:.1f} ms, mean batch {row['mean_batch'] or 0:.1f}, queue p50/p90/p99 "
                  f"{queue.get('p50', 0):.2f}/{queue.get('p90', 0):.2f}/{queue.get('p99', 0):.2f} ms", flush=True)
            rows.append(row)
    return {"command": command, "machine": {"cpu": cpu_model_name(), "load_average": load_average()},
            "model": str(args.model), "image": str(args.image), "path": args.path, "target": request.target,
            "clients": args.clients,
            "duration_s": args.duration_s, "baseline_commit": next(iter(sources), None),
            "arms": [{"name": n, "settings": v, "code": "commit " + n if n in sources else "this tree"}
                     for n, v in arms], "rows": rows}


def markdown(report: dict) -> str:
    lines = ["# Where the slowest answers wait", "", f"`{report['command']}`", "",
             f"{report['machine']['cpu']}; `{report['model']}`, `{report['image']}` on the {report['path']} path "
             f"(`POST {report['target']}`); {report['clients']} clients (wrk, closed loop), {report['duration_s']} s "
             "a round after the warm-up; each arm a fresh server every round.", "",
             "| round | arm | req/s | p50 ms | p99 ms | mean batch | queue p50 / p90 / p99 ms | server total p99 ms |",
             "| ---: | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in report["rows"]:
        queue, total = r["stages"].get("queue", {}), r["stages"].get("total", {})
        batch = f"{r['mean_batch']:.1f}" if r["mean_batch"] else "-"
        lines.append(f"| {r['round']} | {r['arm']} | {r['requests_per_s']:.1f} | {r['p50_ms']:.1f} | "
                     f"{r['p99_ms']:.1f} | {batch} | {queue.get('p50', 0):.2f} / {queue.get('p90', 0):.2f} / "
                     f"{queue.get('p99', 0):.2f} | {total.get('p99', 0):.1f} |")
    for arm in report["arms"]:
        rows = [r for r in report["rows"] if r["arm"] == arm["name"]]
        settings = ", ".join(f"`{k}={v}`" for k, v in arm["settings"].items()) or "the defaults"
        lines += ["", f"## {arm['name']} ({arm['code']}, {settings}): each stage in ms, medians over the rounds", "",
                  "| stage | p50 | p90 | p99 | the slowest 1% (mean) |", "| --- | ---: | ---: | ---: | ---: |"]
        for stage in STAGES:
            per_round = [r["stages"][stage] for r in rows if stage in r["stages"]]
            if per_round:
                cells = [statistics.median(s[k] for s in per_round) for k in ("p50", "p90", "p99",
                                                                               "slowest_1pct_mean")]
                lines.append(f"| `{stage}` | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m vitserve.bench.tail", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--image", type=Path, default=DEFAULT_IMAGE)
    parser.add_argument("--path", choices=("image", "oip-json", "oip-binary"), default="image",
                        help="what the clients send (the module's doc)")
    parser.add_argument("--clients", type=at_least(1), default=32)
    parser.add_argument("--duration-s", type=at_least(1), default=10, help="the measured window, per arm and round")
    parser.add_argument("--warmup-s", type=at_least(1), default=3)
    parser.add_argument("--rounds", type=at_least(1), default=2)
    parser.add_argument("--arm", type=parse_arm, action="append",
                        help="NAME:VITSERVE_X=V[,...] (repeatable; default one arm, `base:`)")
    parser.add_argument("--baseline-commit", metavar="REV", help="one more arm: that commit's tree with its defaults")
    parser.add_argument("--out", type=Path, help="the Markdown report; its JSON beside it")
    args = parser.parse_args(argv)
    if len({name for name, _ in args.arm or []}) != len(args.arm or []):
        parser.error("each --arm needs a name of its own")
    for option, path in (("--model", args.model), ("--image", args.image)):
        if not path.is_file():
            parser.error(f"{option}: no file {path}")
    with tempfile.TemporaryDirectory(prefix="vitserve-tail-") as work:
        report = run(args, command_line("python -m vitserve.bench.tail", argv), Path(work))
    publish(markdown(report), report, args.out)


if __name__ == "__main__":
    main()
