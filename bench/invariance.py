"""`python -m vitserve.bench.invariance --model FILE [--model FILE ...]`: batch invariance measured through a real
server.

Same input, same answer (docs/architecture.md, "Batch invariance"): for each model file, `vitserve serve` is started
as a user starts it and sent the first `--images` Fashion-MNIST test images as PNGs (the `image` input of `/v2`,
so decoding and preprocessing are the server's), first **alone** (one client, one request at a time: every batch
holds one image), then **mixed**: the same images shuffled into bursts of 1 to `--max-burst` requests, each burst
sent at once so that the batcher puts its images together. The server's statistics give the mean batch size of
each phase, so a run in which nothing was batched cannot pass for invariance. Reported per file: images whose top-1
class changed, the largest logit difference, the mean batch size of each phase.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import time
from pathlib import Path

import numpy as np
from PIL import Image

from vitserve.bench.config import LOOPBACK
from vitserve.bench.oip import decode_outputs, infer_target
from vitserve.bench.report import command_line, publish
from vitserve.bench.servers import ServerProcess, free_port, serve_argv
from vitserve.model.config import FASHION_MNIST_DIR
from vitserve.service.schemas.binary_tensors import HEADER_LENGTH, join_body, pack_bytes

FASHION_MNIST_TEST = Path(FASHION_MNIST_DIR) / "t10k-images-idx3-ubyte.gz"


def idx_pngs(path: Path, count: int) -> list[bytes]:
    """The first `count` images of an IDX file of grey images (N, H, W) as PNGs."""
    from vitserve.model.data import read_idx  # the training's own reader (it checks the header); torch comes with it

    images = read_idx(path)[:count]
    out = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image, "L").save(buffer, "PNG")
        out.append(buffer.getvalue())
    return out


def logits_request(png: bytes) -> tuple[bytes, dict[str, str]]:
    """The PNG as the `image` input; `logits` answered as a binary float32 tensor (compared bit for bit)."""
    data = pack_bytes([png])
    tensor = {"name": "image", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": len(data)}}
    return join_body({"inputs": [tensor], "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]},
                     [data])


async def logits_of(client, model: str, png: bytes) -> np.ndarray:
    body, headers = logits_request(png)
    answer = await client.post(infer_target(model), content=body, headers=headers)
    answer.raise_for_status()
    outputs, _ = decode_outputs(answer.content, answer.headers.get(HEADER_LENGTH))
    return outputs["logits"][0]


async def batching_counts(client, model: str) -> tuple[int, int]:
    """(inferences, executions) of the model so far: their ratio is the mean batch size."""
    stats = (await client.get(f"/v2/models/{model}/stats")).json()["model_stats"]
    return sum(s["inference_count"] for s in stats), sum(s["execution_count"] for s in stats)


async def measure(port: int, pngs: list[bytes], max_burst: int, seed: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=max_burst)
    async with httpx.AsyncClient(base_url=f"http://{LOOPBACK}:{port}", limits=limits, timeout=120) as client:
        model = (await client.get("/v1/models")).json()["models"][0]["name"]
        counted = await batching_counts(client, model)
        alone = np.stack([await logits_of(client, model, png) for png in pngs])
        after_alone = await batching_counts(client, model)
        rng = np.random.default_rng(seed)
        order, mixed, start = rng.permutation(len(pngs)), np.empty_like(alone), 0
        while start < len(order):
            burst = order[start:start + int(rng.integers(1, max_burst + 1))]
            answers = await asyncio.gather(*(logits_of(client, model, pngs[i]) for i in burst))
            mixed[burst] = np.stack(answers)
            start += len(burst)
        after_mixed = await batching_counts(client, model)
    return {"model": model, "images": len(pngs), "top1_changes": int((alone.argmax(1) != mixed.argmax(1)).sum()),
            "max_logit_diff": float(np.abs(alone - mixed).max()),
            "mean_batch_alone": _mean_batch(counted, after_alone), "mean_batch_mixed": _mean_batch(after_alone,
                                                                                                   after_mixed)}


def _mean_batch(before: tuple[int, int], after: tuple[int, int]) -> float:
    inferences, executions = after[0] - before[0], after[1] - before[1]
    return inferences / executions if executions else 0.0


def run_file(path: Path, pngs: list[bytes], max_burst: int, seed: int, runtime: str, queue_delay_ms: int,
             precision_hint: str) -> dict:
    port = free_port()
    # Every request waits out the queue delay (not run at once by an idle model): bursts then fill batches, the
    # case invariance is about; alone, each image still runs by itself.
    env = {"VITSERVE_LOG_LEVEL": "info", "VITSERVE_GRPC_PORT": "0", "VITSERVE_RUNTIME": runtime,
           "VITSERVE_MAX_QUEUE_DELAY_MS": str(queue_delay_ms), "VITSERVE_DISPATCH_WHEN_IDLE": "false",
           "VITSERVE_PRECISION_HINT": precision_hint}
    # the server's log kept (build/bench-logs): a connection the server dropped mid-run is explained there
    log_dir = Path("build/bench-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"invariance-{path.stem}-{runtime}-{precision_hint}.log"
    with ServerProcess(serve_argv(path, port), port, env=env, log_path=log_path):
        started = time.perf_counter()
        row = asyncio.run(measure(port, pngs, max_burst, seed))
    return {"file": str(path), "runtime": runtime, "precision_hint": precision_hint, **row,
            "seconds": round(time.perf_counter() - started, 1)}


def render(rows: list[dict], command: str) -> str:
    lines = ["# Batch invariance through the server", "", f"`{command}`", "",
             "| file | runtime | precision hint | images | top-1 changes | largest logit difference | "
             "mean batch alone | mean batch mixed |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['file']} | {r['runtime']} | {r['precision_hint']} | {r['images']} | {r['top1_changes']} | "
              f"{r['max_logit_diff']:.3g} | "
              f"{r['mean_batch_alone']:.2f} | {r['mean_batch_mixed']:.2f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vitserve.bench.invariance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", type=Path, required=True, help="a model file (repeatable)")
    parser.add_argument("--images", type=int, default=2000, help="Fashion-MNIST test images (default 2000)")
    parser.add_argument("--max-burst", type=int, default=32, help="largest burst of concurrent requests")
    parser.add_argument("--runtime", default="onnxruntime", help="VITSERVE_RUNTIME of the servers")
    parser.add_argument("--precision-hint", default="auto", help="VITSERVE_PRECISION_HINT of the servers (bf16 "
                                                                   "on a CPU that has it)")
    parser.add_argument("--queue-delay-ms", type=int, default=50, help="the servers' batching delay (default 50)")
    parser.add_argument("--test-images", type=Path, default=FASHION_MNIST_TEST, help="an IDX image file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the Markdown (and its JSON) here")
    args = parser.parse_args(argv)
    pngs = idx_pngs(args.test_images, args.images)
    rows = [run_file(path, pngs, args.max_burst, args.seed, args.runtime, args.queue_delay_ms,
                     args.precision_hint) for path in args.model]
    publish(render(rows, command_line("python -m vitserve.bench.invariance", argv)), rows, args.out)


if __name__ == "__main__":
    main()
