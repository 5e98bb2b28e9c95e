"""A run's report as Markdown (the target ratios first, then one table per phase), its JSON, and a plot."""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from pathlib import Path

from vitserve.bench.config import LOOPBACK


def write_report(report: dict, out: Path) -> list[Path]:
    """The Markdown table, the JSON it was made from, and the plot (when matplotlib is there), side by side."""
    out.parent.mkdir(parents=True, exist_ok=True)
    plot = out.with_suffix(".png")
    has_plot = plot_report(report, plot)
    out.write_text(render_markdown(report, plot.name if has_plot else None))
    data = out.with_suffix(".json")
    data.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return [out, data] + ([plot] if has_plot else [])


def publish(text: str, data, out: Path | None) -> None:
    """A table-only bench's Markdown printed, and with `out` written there (its folder made if need be) with the
    JSON it was made from beside it."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")


def command_line(prog: str, argv: list[str] | None) -> str:
    """The command as the user typed it: the server settings it ran with from the environment (`served_with`),
    `prog` and its arguments (sys.argv's when called from the shell), each quoted as a shell needs it
    (`--serve-flags '--runtime onnxruntime'`)."""
    return " ".join([*served_with(), prog, *map(shlex.quote, sys.argv[1:] if argv is None else argv)])


def served_with() -> list[str]:
    """`VITSERVE_X=value` for each vitserve setting in this environment: the servers a bench starts inherit them
    (`VITSERVE_RUNTIME=onnxruntime` pins the runtime), so a rerun needs them as much as the flags."""
    return [f"{name}={shlex.quote(value)}" for name, value in sorted(os.environ.items())
            if name.startswith("VITSERVE_")]


def at_least(low: int):
    """An argparse type: an integer of at least `low`, or a one-line error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"at least {low}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


# ---------------------------------------------------------------------------------------------------- targets


def targets(report: dict) -> dict:
    """The target ratios, from this run's rows: saturation throughput and one-client latency, served vs raw."""
    raw = {r["batch_size"]: r for r in report["raw"]}
    served = [r for r in report["served"] if "skipped" not in r and r["input"] == "png"]
    out: dict = {}
    for batching, raw_bs in (("on", report["settings"]["max_batch_size"]), ("off", 1)):
        rows = [r for r in served if r["batching"] == batching]
        if rows and raw_bs in raw:
            out[f"saturation_batching_{batching}"] = _saturation(rows, raw[raw_bs])
        one_client = _one_client_latency(rows, raw, report.get("paired", []), batching)
        if one_client:
            out[f"one_client_latency_batching_{batching}"] = one_client
    bare = {r["concurrency"]: r for r in report.get("bare", []) if "skipped" not in r and r["input"] == "png"}
    if bare:
        out["served_vs_bare"] = [
            {"concurrency": r["concurrency"], "batching": r["batching"], "served_requests_per_s": r["requests_per_s"],
             "bare_requests_per_s": bare[r["concurrency"]]["requests_per_s"],
             "ratio": r["requests_per_s"] / bare[r["concurrency"]]["requests_per_s"]}
            for r in served if r["concurrency"] in bare]
    return out


def _saturation(rows: list[dict], raw: dict) -> dict:
    """The best served PNG throughput against the raw session at the batch size the server runs."""
    best = max(rows, key=lambda r: r["requests_per_s"])
    return {"served_images_per_s": best["requests_per_s"], "at_concurrency": best["concurrency"],
            "raw_batch_size": raw["batch_size"], "raw_images_per_s": raw["images_per_s"],
            "ratio": best["requests_per_s"] / raw["images_per_s"], "target": ">= 0.85",
            # images per CPU-second, served over raw: what serving costs, whatever else the machine runs
            "cpu_ratio": _per_cpu(best["requests_per_s"], best.get("server_cores"))
            / _per_cpu(raw["images_per_s"], raw.get("session_cores"))}


def _one_client_latency(rows: list[dict], raw: dict, paired: list[dict], batching: str) -> dict | None:
    pair = next((r for r in paired if r["batching"] == batching), None)
    one = [r for r in rows if r["concurrency"] == 1]
    if pair:  # the robust one: each served request against the raw call just before it
        return {"served_p50_ms": pair["served_p50_ms"], "raw_batch1_p50_ms": pair["raw_p50_ms"],
                "overhead_ms": pair["overhead_p50_ms"], "method": f"median of {pair['pairs']} paired differences",
                "target": "<= +3 ms"}
    if one and 1 in raw:
        return {"served_p50_ms": one[0]["p50_ms"], "raw_batch1_p50_ms": raw[1]["p50_ms"],
                "overhead_ms": one[0]["p50_ms"] - raw[1]["p50_ms"], "method": "p50s of separate phases",
                "target": "<= +3 ms"}
    return None


def targets_lines(t: dict) -> list[str]:
    """The targets as Markdown bullets (also what the command prints at the end)."""
    lines = []
    for key, v in t.items():
        if key.startswith("saturation"):
            lines.append(f"- **{key.replace('_', ' ')}**: served {v['served_images_per_s']:.1f} images/s "
                         f"(PNG, {v['at_concurrency']} clients) / raw {v['raw_images_per_s']:.1f} images/s at batch "
                         f"size {v['raw_batch_size']} = **{v['ratio']:.2f}** (target {v['target']}); per CPU-second "
                         f"used (server process vs session): {_f(v['cpu_ratio'], '.2f')}")
        elif key.startswith("one_client"):
            lines.append(f"- **{key.replace('_', ' ')}**: served p50 {v['served_p50_ms']:.2f} ms vs raw batch-1 p50 "
                         f"{v['raw_batch1_p50_ms']:.2f} ms: overhead **{v['overhead_ms']:+.2f} ms** ({v['method']}; "
                         f"target {v['target']})")
        elif key == "served_vs_bare":
            for r in v:
                lines.append(f"- served/bare requests/s, batching {r['batching']}, {r['concurrency']} clients: "
                             f"{r['served_requests_per_s']:.1f} / {r['bare_requests_per_s']:.1f} = "
                             f"**{r['ratio']:.2f}**")
    return lines


def _per_cpu(per_second: float, cores: float | None) -> float:
    return per_second / cores if cores else float("nan")


# ---------------------------------------------------------------------------------------------------- Markdown


def _f(value, fmt: str = ".1f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def _table(header: list[str], rows: list[list[str]], text_columns: int = 0) -> list[str]:
    """A Markdown table; the first `text_columns` are left-aligned, the numbers right-aligned."""
    align = [":---" if i < text_columns else "---:" for i in range(len(header))]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|", *("| " + " | ".join(r) + " |" for r in rows)]


def _raw_table(raw: list[dict]) -> list[str]:
    return _table(["batch size", "images/s", "latency p50 ms", "p99 ms", "calls", "images/CPU-s", "session cores",
                   "other cores"],
                  [[str(r["batch_size"]), _f(r["images_per_s"]), _f(r["p50_ms"], ".2f"), _f(r["p99_ms"], ".2f"),
                    str(r["calls"]), _f(_per_cpu(r["images_per_s"], r.get("session_cores"))),
                    _f(r.get("session_cores"), ".2f"), _f(r.get("other_cores"), ".2f")] for r in raw])


def _paired_table(rows: list[dict]) -> list[str]:
    return _table(["batching", "pairs", "raw p50 ms", "served p50 ms", "overhead p10 ms", "overhead p50 ms",
                   "overhead p90 ms"],
                  [[r["batching"], str(r["pairs"]), _f(r["raw_p50_ms"], ".2f"), _f(r["served_p50_ms"], ".2f"),
                    *(_f(r[f"overhead_{q}_ms"], "+.2f") for q in ("p10", "p50", "p90"))] for r in rows],
                  text_columns=1)


def _load_table(rows: list[dict], with_batching: bool = True) -> list[str]:
    header = (["input", "batching"] if with_batching else ["input"]) + [
        "clients", "req/s", "p50 ms", "p90 ms", "p99 ms", "errors", "window s", "req/CPU-s", "mean batch", "ORT busy",
        "server cores", "client cores", "other cores"]
    body = []
    for r in rows:
        head = [r["input"]] + ([r["batching"]] if with_batching else []) + [str(r["concurrency"])]
        if "skipped" in r:
            body.append(head + [f"skipped ({r['skipped']})"] + ["-"] * (len(header) - len(head) - 1))
            continue
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(r["errors"].items())) or "0"
        body.append(head + [_f(r["requests_per_s"]), _f(r["p50_ms"], ".2f"), _f(r["p90_ms"], ".2f"),
                            _f(r["p99_ms"], ".2f"), errors, _f(r["window_s"], ".1f"),
                            _f(_per_cpu(r["requests_per_s"], r["server_cores"])), _f(r.get("mean_batch_size"), ".2f"),
                            _f(r.get("inference_busy"), ".0%"), _f(r["server_cores"], ".2f"),
                            _f(r["client_cores"], ".2f"), _f(r["other_cores"], ".2f")])
    return _table(header, body, text_columns=2 if with_batching else 1)


def _preamble(report: dict) -> list[str]:
    """The title, the machine and model, and how the load was made."""
    m, s, env = report["model"], report["settings"], report["environment"]
    return [f"# `vitserve bench`: {m['name']} {m['version']} ({m['height']}x{m['width']}, {m['channels']} channel(s), "
            f"patch {m['patch_size']})", "",
            f"`{report['command']}`, {env['date']}. Model `{m['path']}` ({m['size_mb']:.1f} MB, {m['precision']}), "
            f"provider {m['provider']}; onnxruntime {env['onnxruntime']}, Python {env['python']}; "
            f"{env['cpu']} ({env['cpus']} CPUs). Load average at start {env['loadavg_start']}, at end "
            f"{env['loadavg_end']}; other processes used **{env['other_cores_mean']:.2f} cores** on average during "
            f"the measured windows (raw and served) ({'contended' if env['contended'] else 'quiet machine'}).", "",
            f"Server: `vitserve serve` in a uvicorn child process on {LOOPBACK}; batching on = max batch size "
            f"{s['max_batch_size']}, off = 1; max queue delay {s['max_queue_delay_ms']} ms; other settings "
            f"{s['server_settings'] or 'default'}. Closed loop: each client sends its next request when the last "
            f"is answered; {s['warmup_s']} s warm-up then {s['duration_s']} s measured per level (stretched, up to "
            f"{s['max_duration_factor']}x, until {s['min_completed_per_client']} answers per client). Requests: "
            f"`POST /v1/classify` with the image as the body (top_k 5, rollout grid); PNG = {m['height']}x{m['width']} "
            f"pre-sized, JPEG = 640x480 (decoded and resized by the server). The raw session gets the server's "
            f"own preprocessing of the PNGs. Load generator: {s['load_generator']}.", ""]


_COLUMNS = ("Columns: *window s* is the measured window (stretched for slow models); *mean batch* comes from "
            "the server's own `vitserve_batch_size` histogram over the window; *ORT busy* is the server's "
            "`vitserve_inference_seconds` sum over the window divided by its length (above 100% when that "
            "metric counts time a batch waited for the runner thread behind another batch); *cores* are CPU "
            "seconds per second used by the server process, this load generator (raw table: the session), "
            "and everything else on the machine; *images/CPU-s* and *req/CPU-s* divide throughput by the CPU the "
            "session or the server process used, which stays comparable when other work shares the machine.")


def render_markdown(report: dict, plot_name: str | None) -> str:
    lines = [*_preamble(report),
             "## Targets (this run)", "", *targets_lines(report["targets"]), "",
             "## Raw ONNX Runtime session (no HTTP)", "", *_raw_table(report["raw"]), "",
             "## Served", "", *_load_table(report["served"]), ""]
    if report.get("paired"):
        lines += ["## One client, paired with the raw session", "",
                  f"A raw batch-1 call, then one served PNG request of the same image, in turn "
                  f"({report['settings']['pair_gap_s'] * 1000:.0f} ms apart); *overhead* is served minus the raw "
                  f"call just before it.", "", *_paired_table(report["paired"]), ""]
    if report.get("bare"):
        lines += ["## Bare FastAPI endpoint returning a constant (same uvicorn options)", "",
                  *_load_table(report["bare"], with_batching=False), ""]
    lines += [_COLUMNS, ""]
    if plot_name:
        lines += [f"![latency vs throughput]({plot_name})", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- plot


def plot_report(report: dict, path: Path) -> bool:
    """Latency (p50 solid, p99 dashed) vs throughput per configuration, raw ORT images/s as vertical lines.

    Returns False, with a message, when matplotlib (the `train` extra) is not installed.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot written", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    _plot_load_curves(ax, report["served"] + report.get("bare", []))
    for r in report["raw"]:
        ax.axvline(r["images_per_s"], color="grey", lw=0.8, ls=":")
        ax.annotate(f"raw bs {r['batch_size']}", (r["images_per_s"], 1), rotation=90, fontsize=7, color="grey",
                    xycoords=("data", "axes fraction"), va="top", ha="right")
    ax.set(xscale="log", yscale="log", xlabel="throughput (images/s = requests/s)",
           ylabel="latency (ms); p50 solid, p99 dashed",
           title=f"vitserve bench: {report['model']['name']} (point labels: concurrent clients)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _plot_load_curves(ax, rows: list[dict]) -> None:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if "skipped" not in r and r["completed"]:
            label = f"{r.get('app', 'served')} {r['input']}" + (f" batching {r['batching']}" if "batching" in r else "")
            groups.setdefault(label, []).append(r)
    for label, group in groups.items():
        group.sort(key=lambda r: r["concurrency"])
        x = [r["requests_per_s"] for r in group]
        (line,) = ax.plot(x, [r["p50_ms"] for r in group], marker="o", label=label)
        ax.plot(x, [r["p99_ms"] for r in group], ls="--", color=line.get_color(), alpha=0.6)
        for r in group:
            ax.annotate(str(r["concurrency"]), (r["requests_per_s"], r["p50_ms"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
