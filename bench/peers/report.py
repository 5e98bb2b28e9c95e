"""The comparison's report: medians over rounds (pure), and the Markdown made from the JSON-able result."""
from __future__ import annotations

import statistics

from vitserve.bench.peers.config import FASTAPI, RATIOS
from vitserve.bench.reliability import number, table

LABELS = {"vitserve": "vitserve", "triton": "Triton", "litserve": "LitServe",
          "vitserve-ray1": "vitserve on Ray (1 replica)", "vitserve-ray2": "vitserve on Ray (2 replicas)",
          "vitserve-base": "vitserve (baseline commit)", "vitserve-openvino": "vitserve on OpenVINO",
          "vitserve-onnxruntime": "vitserve on ONNX Runtime", "vitserve-bf16": "vitserve on OpenVINO bf16",
          "triton-bf16": "Triton on OpenVINO bf16", "triton-openvino": "Triton on OpenVINO",
          "vitserve-process": "vitserve with an engine process",
          "vitserve-inline": "vitserve, a session in each HTTP worker",
          "vitserve-lone": "vitserve, an engine process and a lone request in its worker",
          "vitserve-2runners": "vitserve, two batches at once", "fastapi": "the 20-line FastAPI app"}
PATH_LABELS = {"image": "image", "oip-json": "OIP JSON tensor", "oip-binary": "OIP binary tensor"}
_MEDIANS = ("ok_per_s", "p50_ms", "p99_ms")


def summarise(rows: list[dict], servers: list[str], paths: list[str], concurrency: list[int]) -> list[dict]:
    """Per path and connection count: each server's medians over its rounds (2xx req/s, p50, p99), its non-2xx
    answers and socket errors summed, and vitserve's req/s over Triton's (medians)."""
    out = []
    for path in paths:
        for connections in concurrency:
            entry: dict = {"path": path, "connections": connections}
            for server in servers:
                runs = [r for r in rows if (r["server"], r["path"], r["connections"]) == (server, path, connections)
                        and "skipped" not in r]
                if runs:
                    cpu = [r.get("server_cpu_ms_per_answer") for r in runs]  # absent from older reports
                    known_cpu = [c for c in cpu if c is not None]
                    entry[server] = {**{k: statistics.median(r[k] for r in runs) for k in _MEDIANS},
                                     "cpu_ms": statistics.median(known_cpu) if len(known_cpu) == len(cpu) else None,
                                     "rounds": len(runs), "non_2xx": sum(r["non_2xx"] for r in runs),
                                     "socket_errors": sum(sum(r["socket_errors"].values()) for r in runs)}
            if len(entry) > 2:
                for numerator, denominator in RATIOS:
                    mine, theirs = entry.get(numerator), entry.get(denominator)
                    if numerator == "vitserve" or (mine and theirs):  # vitserve's own: None says a peer was missing
                        entry[ratio_key(numerator, denominator)] = (
                            mine["ok_per_s"] / theirs["ok_per_s"] if mine and theirs and theirs["ok_per_s"] else None)
                out.append(entry)
    return out


def rate_by_round(rows: list[dict], server: str, path: str, connections: int,
                  key: str = "ok_per_s") -> dict[int, float]:
    """`server`'s 2xx req/s at that level in each round it was measured (`key`: wrk's count over its window, or
    `steady_ok_per_s`, from the first answer to the last, where the run timed its answers)."""
    return {r["round"]: r[key] for r in rows
            if (r["server"], r["path"], r["connections"]) == (server, path, connections) and "skipped" not in r
            and r.get(key) is not None}


def ratios_by_round(rows: list[dict], numerator: str, denominator: str, path: str, connections: int) -> list[float]:
    """numerator's req/s over denominator's in each round both ran (the two measured minutes apart, alternating):
    their spread is what the machine's drift does to the ratio."""
    mine, theirs = (rate_by_round(rows, server, path, connections) for server in (numerator, denominator))
    return [mine[n] / theirs[n] for n in sorted(mine) if theirs.get(n)]


def ratio_key(numerator: str, denominator: str) -> str:
    """"vitserve_over_triton": the summary's key for numerator's req/s over denominator's."""
    return f"{numerator}_over_{denominator}".replace("-", "_")


def render(report: dict) -> str:
    env = report["environment"]
    lines = ["# vitserve side by side with Triton Inference Server and LitServe", "",
             f"`{report['command']}`, {env['date']}, commit `{(env['commit'] or 'unknown')[:12]}`{_dirty(env)}. "
             f"{env['cpu']} ({env['cpus']} CPUs). Load average (1 / 5 / 15 min) before {env['loadavg_start']}"
             f"{_waited(env)}, after {env['loadavg_end']}.", "", *_versions(env), "", *_commands(report), "",
             *_method(report), ""]
    lines += ["## The raw ONNX Runtime session (context)", "", *_raw_table(report["models"]), "",
              "vitserve's own session and preprocessing (bench/raw.py), no server: per-call p50 at batch 1, and "
              "images/s at each batch size.", ""]
    for entry in report["models"]:
        lines += _model_section(entry, report["settings"])
    lines += ["## Every round", "", "wrk's own output for every run is in the JSON beside this file.", "",
              *_rounds_table(report["models"]), ""]
    return "\n".join(lines)


def _dirty(env: dict) -> str:
    n = env.get("uncommitted_files")
    if not n:
        return ""
    ran = "vitserve ran from a commit, without them" if env.get("vitserve_commit") else "vitserve ran with them"
    return f" with {n} uncommitted file(s) in the working tree ({ran})"


def _waited(env: dict) -> str:
    waited = env["waited_for_quiet_s"]
    return f" (after waiting {waited:g} s for a quieter machine)" if waited else ""


def _versions(env: dict) -> list[str]:
    peers = env["peer_versions"]
    where = (f"commit `{env['vitserve_commit'][:12]}` (exported with git archive)" if env.get("vitserve_commit")
             else "this working tree")
    lines = [f"- **vitserve**: {where}, Python {env['python']}, onnxruntime {env['onnxruntime']}"]
    if "triton" in peers:
        t = peers["triton"]
        lines.append(f"- **Triton Inference Server** {env.get('triton_version', '?')} (the `tritonserver` in "
                     f"nvidia-pytriton {t['nvidia-pytriton']}), Python {t['python']}, numpy {t['numpy']}, "
                     f"onnxruntime {t['onnxruntime']}")
    if "litserve" in peers:
        ls = peers["litserve"]
        lines.append(f"- **LitServe** {ls['litserve']} (FastAPI {ls['fastapi']}, uvicorn {ls['uvicorn']}), Python "
                     f"{ls['python']}, numpy {ls['numpy']}, onnxruntime {ls['onnxruntime']}")
    if FASTAPI in peers:
        fa = peers[FASTAPI]
        lines.append(f"- **the FastAPI app**: FastAPI {fa['fastapi']}, uvicorn {fa['uvicorn']}, in vitserve's "
                     f"environment: Python {fa['python']}, numpy {fa['numpy']}, onnxruntime {fa['onnxruntime']}")
    return lines + [f"- load generator: {env['wrk']}"]


def _commands(report: dict) -> list[str]:
    """How to rerun it, and what each server was started with (ports are chosen free for every start)."""
    lines = ["## Commands", "", "Rerun: `make bench-peers` (`.venv/bin/python -m vitserve.bench.peers --out "
             "build/bench/peers.md`, then `python -m vitserve.bench.pages put docs/results/bench-peers.md --section "
             "vit-fmnist build/bench/peers.md`; `vitserve bench --mode peers` is the same). It makes "
             "build/peers/venv-triton and build/peers/venv-litserve with pinned versions (bench/peers/venvs.py) when "
             "absent and needs Debian's `wrk`.", "",
             "Servers, as started for the first model:", "", "```"]
    first = report["models"][0]["servers"] if report["models"] else {}
    for facts in first.values():
        env = " ".join(f"{k}={v}" for k, v in facts["env"].items())
        lines.append(f"{env} {' '.join(facts['argv'])}".strip())
    rows = [r for m in report["models"] for r in m["rounds"] if "wrk_argv" in r]
    if rows:
        lines.append(f"wrk {rows[-1]['wrk_argv']}")
    return lines + ["```"]


def _method(report: dict) -> list[str]:
    s = report["settings"]
    return [
        "## How it was run", "",
        f"One server at a time on 127.0.0.1, {s['rounds']} round(s), each starting every server in turn (the order "
        "reversed every other round) and stopping it before the next starts. Every server does the same per-image "
        "work: vitserve's `prepare_image` (Pillow decode, resize, normalise), one ONNX Runtime call per batch "
        "returning logits and rollout (vitserve's session options: cores shared among worker processes, no "
        "spinning), top 5 and the rollout grid in the answer (bench/peers/image_classifier.py). All batch "
        "dynamically with at most 16 images per batch and a 5 ms queue delay.", "",
        "- **vitserve**: `vitserve serve --model M` with its defaults (log level warning: no access log).",
        "- **Triton**: pytriton's `Triton().bind(...)` of two models, `vit-image` (BYTES input, the image) and "
        "`vit-tensor` (FP32 `pixel_values` [C, -1, -1]), `@batch` infer functions, `DynamicBatcher("
        "max_queue_delay_microseconds=5000)`, max batch 16; the C++ HTTP front end and batcher of `tritonserver`, "
        "the model code reached through the Python backend (bench/peers/triton_server.py).",
        "- **LitServe**: `LitServer(api, accelerator=\"cpu\", workers_per_device=<cores>, fast_queue=True)`, "
        "`max_batch_size=16, batch_timeout=0.005` on the `LitAPI`, `run(log_level=\"warning\", "
        "generate_client_file=False)` (bench/peers/litserve_server.py).",
        "- **the 20-line FastAPI app** (where it ran): what a user writes first, one ONNX Runtime session in one "
        "uvicorn process, `UploadFile`, the work in a sync endpoint (FastAPI's thread pool), no batching "
        "(bench/peers/fastapi_app.py).", "",
        "Paths: **image**: each server's own image endpoint (vitserve `POST /v1/classify` with the PNG as the body; "
        "Triton the PNG as a binary BYTES input of `vit-image`, outputs as JSON; LitServe `POST /predict` with the "
        "PNG as the multipart field `file`: LitServe 0.2 parses a body as a form or JSON only). **OIP JSON "
        "tensor** and **OIP binary tensor**: the same bytes to vitserve's `/v2/models/<name>/infer` and Triton's "
        "`vit-tensor` (bench/oip.py's bodies). Each request carries the same image.", "",
        f"Load: `wrk -t min(c,2) -c c -d {s['duration_s']}s --timeout {s['wrk_timeout_s']}s --latency -s "
        f"<path>.lua URL`, a closed loop over keep-alive connections, the Lua script sending one body read from a "
        f"file; before each measured run a discarded {s['warmup_s']} s run at the same level, and after each run one "
        "request answered alone (work left queued is done before the next run). wrk runs on the same two cores as "
        "the server. A model whose raw batch-1 latency exceeds "
        f"{s['compute_bound_ms']:g} ms is measured on the image path only, at "
        f"{', '.join(map(str, s['compute_bound_concurrency']))} connections, for "
        f"{max(s['duration_s'], s['compute_bound_duration_s'])} s per run (at 32 connections an answer takes "
        "seconds, and the first comes a whole batch late).", "",
        "Numbers: **req/s** counts 2xx answers only (median over rounds), then (p50 / p99 latency in ms, medians "
        "over rounds, from wrk's `--latency` distribution); *vitserve / Triton* is the ratio of the req/s medians. "
        "**CPU time per answer**: the user and system time of the server's whole process tree (front end, model "
        "process, helpers; psutil) over the measured run, divided by the answers wrk counted: on two cores shared "
        "with wrk, what decides how many answers a server can give.",
    ]


def _raw_table(models: list[dict]) -> list[str]:
    sizes = sorted({r["batch_size"] for m in models for r in m["raw"]})
    rows = []
    for m in models:
        by_size = {r["batch_size"]: r for r in m["raw"]}
        one = by_size[min(by_size)]
        rows.append([_model_name(m["model"]), number(one["p50_ms"], ".2f")]
                    + [number(by_size[b]["images_per_s"]) if b in by_size else "-" for b in sizes]
                    + [number(max(r["images_per_s"] for r in m["raw"]))])
    return table(["model", "batch-1 p50 ms", *(f"images/s at {b}" for b in sizes), "best images/s"], rows)


def _model_name(model: dict) -> str:
    precision = model.get("precision", "fp32")  # reports made before it was recorded: float32 files
    return f"{model['name']} ({model['height']}x{model['width']}{'' if precision == 'fp32' else ', ' + precision})"


def _model_section(entry: dict, settings: dict) -> list[str]:
    m = entry["model"]
    kind = "compute-bound" if m["compute_bound"] else "HTTP-bound"
    servers = [s for s in settings["servers"]]
    lines = [f"## {_model_name(m)}, {kind}", "",
             f"`{m['path']}`: {m['name']} {m['version']}, {m['channels']} channel(s), patch {m['patch_size']}, "
             f"{m['size_mb']} MB.", "", *_summary_table(entry["summary"], servers, entry["rounds"]), "",
             *_cpu_table(entry["summary"], servers), *_alone_table(entry, servers)]
    errors = [f"{LABELS[s]} {PATH_LABELS[e['path']]} at {e['connections']}: {e[s]['non_2xx']} non-2xx, "
              f"{e[s]['socket_errors']} socket errors" for e in entry["summary"] for s in servers
              if s in e and (e[s]["non_2xx"] or e[s]["socket_errors"])]
    lines.append("Errors (all rounds): " + ("; ".join(errors) if errors else "none: every answer was 2xx.") + "")
    lines += _statuses(entry)
    lines += ["", "Answers checked (one request per path after each start, against the raw session on the same image; "
              "top-1 class and values within 1e-4: logits on the tensor paths, the top-5 probabilities on the image "
              "path):", ""]
    for server, checks in entry["checks"].items():
        lines.append(f"- {LABELS[server]}: " + "; ".join(_checks(path, runs) for path, runs in checks.items()))
    sizes = entry["request_bytes"]
    lines += ["", "Request bodies (bytes): " + "; ".join(
        f"{LABELS[s]} " + ", ".join(f"{PATH_LABELS[p]} {n:,}" for p, n in sizes[s].items()) for s in sizes) + ".", ""]
    return lines


def served_of_alone(entry: dict, server: str, path: str, connections: int,
                    key: str = "ok_per_s") -> float | None:
    """The median over rounds of `server`'s req/s at that level (`key`, as `rate_by_round`) over the session
    alone's best images/s measured in the same round (None without both)."""
    best = {a["round"]: max(r["images_per_s"] for r in a["raw"]) for a in entry.get("session_alone_rounds", [])}
    rates = rate_by_round(entry["rounds"], server, path, connections, key)
    ratios = [rate / best[n] for n, rate in rates.items() if best.get(n)]
    return statistics.median(ratios) if ratios else None


def _alone_cell(entry: dict, server: str, path: str, connections: int) -> str:
    """The share from the first answer to the last, and in brackets wrk's over its window; older reports: wrk's."""
    steady = served_of_alone(entry, server, path, connections, "steady_ok_per_s")
    window = number(served_of_alone(entry, server, path, connections), ".2f")
    return window if steady is None else f"{steady:.2f} ({window})"


def _alone_table(entry: dict, servers: list[str]) -> list[str]:
    """Each server's req/s as a share of the session alone measured in the same round (a compute-bound model)."""
    alone = entry.get("session_alone_rounds") or []
    if not alone:
        return []
    levels = [(e["path"], e["connections"]) for e in entry["summary"]]
    rows = [[PATH_LABELS[path], str(c)] + [_alone_cell(entry, s, path, c) for s in servers] for path, c in levels]
    rounds = "; ".join(f"round {a['round']} " + ", ".join(f"{r['images_per_s']:.1f} at {r['batch_size']}"
                                                        for r in a["raw"]) for a in alone)
    return ["", "Served as a share of the session alone (req/s over the session's best images/s, the session run as "
            "one more turn of the same round, on the same cores; medians over rounds). The req/s: the answers after "
            "the first batch's over the time from the first batch's answers to the last's (bench/peers/wrk.py "
            "`steady_rate`), as the session is timed call by call; in brackets wrk's count over its fixed window, "
            "which loses the work in flight when the window closes (up to a batch):", "",
            *table(["path", "clients", *(LABELS[s] for s in servers)], rows), "",
            f"The session alone, images/s at each batch size: {rounds}.", ""]


def _checks(path: str, runs: list[dict]) -> str:
    """A path's checks over the rounds: right in all, or which rounds were not and why."""
    right = [c for c in runs if c["ok"]]
    text = f"{PATH_LABELS[path]} right in {len(right)} of {len(runs)} round(s)"
    if right:
        worst = max(c["max_abs_diff"] for c in right)
        text += f" (top-1 {right[0]['top1']}, max abs diff {worst:.1e})"
    for c in runs:
        if "error" in c:
            text += f"; round {c['round']} **failed** ({c['status']}: {c['error'][:120]})"
        elif not c["ok"]:
            text += f"; round {c['round']} **WRONG** (top-1 {c['top1']}, max abs diff {c['max_abs_diff']:.1e})"
    return text


def _statuses(entry: dict) -> list[str]:
    """What the non-2xx answers were: the status codes of a short extra run after each level that had some."""
    seen: dict[str, dict[str, int]] = {}
    for r in entry["rounds"]:
        for code, n in (r.get("status_sample") or {}).items():
            if not code.startswith("2"):
                counts = seen.setdefault(LABELS[r["server"]], {})
                counts[code] = counts.get(code, 0) + n
    if not seen:
        return []
    return ["", "Their status codes, counted in a short extra run (the warm-up's length) after each level that "
                  "had some: " + "; ".join(
        f"{server} " + ", ".join(f"{code} x{n}" for code, n in sorted(c.items())) for server, c in seen.items()) + "."]


def _cell(value: dict | None) -> str:
    if value is None:
        return "-"
    rate = value["ok_per_s"]
    return f"{rate:.{0 if rate >= 100 else 1}f} ({value['p50_ms']:.1f} / {value['p99_ms']:.1f})"


def _summary_table(summary: list[dict], servers: list[str], rounds: list[dict]) -> list[str]:
    """Each server's medians; the ratio to Triton, and to the baseline commit when it ran, with each round's."""
    pairs = [(a, b) for a, b in RATIOS if a in servers and b in servers] or [("vitserve", "triton")]
    by_round = {(e["path"], e["connections"], a, b): ratios_by_round(rounds, a, b, e["path"], e["connections"])
                for e in summary for a, b in pairs}
    rows = [[PATH_LABELS[e["path"]], str(e["connections"]), *(_cell(e.get(s)) for s in servers),
             *(_ratio_cell(e.get(ratio_key(a, b)), by_round[e["path"], e["connections"], a, b]) for a, b in pairs)]
            for e in summary]
    header = ["path", "clients", *(f"{LABELS[s]} req/s (p50 / p99 ms)" for s in servers),
              *(f"{LABELS[a]} / {LABELS[b]}" for a, b in pairs)]
    lines = table(header, rows, text_columns=1)
    if any(len(ratios) > 1 for ratios in by_round.values()):
        lines += ["", "A ratio is of the medians; in brackets, the same ratio in each round (the servers take turns "
                  "within a round): their spread is what the machine's drift does to it."]
    return lines


def _ratio_cell(ratio: float | None, by_round: list[float]) -> str:
    if len(by_round) < 2:
        return number(ratio, ".2f")
    return f"{number(ratio, '.2f')} ({', '.join(format(r, '.2f') for r in by_round)})"


def _cpu_table(summary: list[dict], servers: list[str]) -> list[str]:
    """Each server's CPU time per answer (its whole process tree, user and system; medians): on a machine the load
    saturates, the cost that decides req/s. Nothing when the report predates the measurement."""
    if not any((e.get(s) or {}).get("cpu_ms") is not None for e in summary for s in servers):
        return []
    rows = [[PATH_LABELS[e["path"]], str(e["connections"]), *(number((e.get(s) or {}).get("cpu_ms"), ".3f")
                                                                 for s in servers)] for e in summary]
    return ["CPU time per answer, ms (the server's processes, user and system, during the measured run; medians):",
            "", *table(["path", "clients", *(LABELS[s] for s in servers)], rows, text_columns=1), ""]


def _rounds_table(models: list[dict]) -> list[str]:
    rows = []
    for m in models:
        for r in m["rounds"]:
            head = [m["model"]["name"], str(r["round"]), LABELS[r["server"]], PATH_LABELS[r["path"]],
                    str(r["connections"])]
            if "skipped" in r:
                rows.append(head + [f"skipped ({r['skipped']})"] + ["-"] * 6)
                continue
            rows.append(head + [number(r["ok_per_s"]), number(r["p50_ms"], ".2f"), number(r["p99_ms"], ".2f"),
                                number(r.get("server_cpu_ms_per_answer"), ".3f"), str(r["non_2xx"]),
                                str(sum(r["socket_errors"].values())), number(r["load1_before"], ".2f")])
    return table(["model", "round", "server", "path", "clients", "req/s (2xx)", "p50 ms", "p99 ms",
                  "CPU ms / answer", "non-2xx", "socket errors", "load (1 min)"], rows, text_columns=5)
