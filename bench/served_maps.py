"""`python -m vitserve.bench.served_maps`: is the map a server sends the map the evaluation measured?

For each plan (server settings, e.g. `precision_hint=fp32`; `default` for none), starts `vitserve serve` on the
model file as a user does, and asks `POST /v2/models/NAME/infer` for `rollout` and `relevance` (the top-1's) of
the first N Fashion-MNIST test images, sent as the model's own FP32 pixel tensor (normalised, at the trained size:
nothing is decoded or resampled on the way). The same pixels go through the checkpoint in eager PyTorch
(export.relevance.explain, what `vitserve evaluate explanations` measures). Per plan: the largest absolute
difference of each map, the largest relative to each image's largest |value|, the mean Spearman of the two
relevance maps, and the runtime and precision the server's card names.

Writes a Markdown report with its JSON beside it (`--out`); only the command's parser loads at import.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_IMAGES = 200
REQUEST_IMAGES = 8  # images per /v2 request: the relevance path's batch limit (max_relevance_batch_size)


def served_maps(port: int, name: str, pixels) -> dict:
    """{'rollout', 'relevance'}: (N, gh, gw) float64 from /v2 infer, REQUEST_IMAGES at a time."""
    import httpx
    import numpy as np

    out: dict[str, list] = {"rollout": [], "relevance": []}
    for start in range(0, len(pixels), REQUEST_IMAGES):
        part = pixels[start:start + REQUEST_IMAGES]
        body = {"inputs": [{"name": "pixel_values", "shape": list(part.shape), "datatype": "FP32",
                            "data": part.ravel().tolist()}],
                "outputs": [{"name": "rollout"}, {"name": "relevance"}]}
        answer = httpx.post(f"http://127.0.0.1:{port}/v2/models/{name}/infer", json=body, timeout=120)
        if answer.status_code != 200:
            raise SystemExit(f"/v2 infer answered {answer.status_code}: {answer.text[:300]}")
        for output in answer.json()["outputs"]:
            out[output["name"]].append(np.asarray(output["data"], np.float64).reshape(output["shape"]))
    return {k: np.concatenate(v) for k, v in out.items()}


def compare(served: dict, offline: dict) -> dict:
    import numpy as np

    from vitserve.evaluation.explanations import mean_ci, spearman_rows

    n, row = len(offline["relevance"]), {}
    for name in ("rollout", "relevance"):
        diff = np.abs(served[name] - offline[name]).reshape(n, -1)
        scale = np.abs(offline[name]).reshape(n, -1).max(-1)
        row[name] = {"max_abs_diff": float(diff.max()), "max_rel_diff": float((diff.max(-1) / scale).max()),
                     "spearman": mean_ci(spearman_rows(served[name].reshape(n, -1), offline[name].reshape(n, -1)))}
    return row


def run_plan(model: Path, plan: str, pixels) -> dict:
    import httpx

    from vitserve.bench.servers import ServerProcess, free_port, serve_argv

    env = {"VITSERVE_LOG_LEVEL": "warning", "VITSERVE_GRPC_PORT": "0"}
    for setting in ([] if plan == "default" else plan.split(",")):
        key, _, value = setting.partition("=")
        env[f"VITSERVE_{key.strip().upper()}"] = value.strip()
    port = free_port()
    with ServerProcess(serve_argv(model, port), port, env=env):
        card = httpx.get(f"http://127.0.0.1:{port}/v1/model", timeout=30).json()
        return {"plan": plan, "card": {k: card.get(k) for k in ("name", "version", "precision", "provider")},
                "served": served_maps(port, card["name"], pixels)}


def render(rows: list[dict], command: str, images: int, machine: str) -> str:
    lines = ["# The served maps against the evaluation's (`python -m vitserve.bench.served_maps`)", "",
             f"`{command}`. {images} Fashion-MNIST test images as FP32 pixel tensors; machine: {machine}.", "",
             "| plan | served on | rollout: max abs diff | relevance: max abs diff | relevance: max diff / image's "
             "max abs | relevance: Spearman |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        rel = r["relevance"]
        lines.append(f"| {r['plan']} | {r['card']['provider']}, {r['card']['precision']} | "
                     f"{r['rollout']['max_abs_diff']:.2e} | {rel['max_abs_diff']:.2e} | {rel['max_rel_diff']:.2e} "
                     f"| {rel['spearman']['mean']:.6f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vitserve.bench.served_maps", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=Path("models/vit-fmnist/model.onnx"))
    p.add_argument("--checkpoint", type=Path, default=Path("models/vit-fmnist/checkpoint"),
                   help="the checkpoint the file was exported from")
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--images", type=int, default=DEFAULT_IMAGES)
    p.add_argument("--plans", nargs="+", default=["precision_hint=fp32", "default"],
                   help="server settings per plan, comma-separated NAME=VALUE; 'default' for none")
    p.add_argument("--out", type=Path, default=Path("build/bench/served-maps.md"))
    args = p.parse_args(argv)
    if args.images < 1:
        p.error("--images must be at least 1")


    from vitserve.bench.report import publish
    from vitserve.bench.shadow import machine
    from vitserve.evaluation.explanations import load_test_images, model_input
    from vitserve.export.relevance import explain
    from vitserve.model.checkpoint import load_checkpoint

    vit, meta = load_checkpoint(args.checkpoint)
    images, _ = load_test_images(args.data_dir, args.images)
    pixels = model_input(images, vit.cfg.in_channels, meta.mean, meta.std)
    _, rollout, relevance = explain(vit.eval(), pixels)
    offline = {"rollout": rollout.double().numpy(), "relevance": relevance.double().numpy()}
    rows = []
    for plan in args.plans:
        result = run_plan(args.model, plan, pixels.numpy())
        rows.append({"plan": plan, "card": result["card"], **compare(result["served"], offline)})
        print(rows[-1], file=sys.stderr, flush=True)
    command = "python -m vitserve.bench.served_maps " + " ".join(argv if argv is not None else sys.argv[1:])
    publish(render(rows, command, args.images, machine()), {"command": command, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
