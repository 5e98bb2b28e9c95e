"""`python -m vitserve.bench.invariance --model FILE [--model FILE ...]`: batch invariance measured through a real
server, at each token budget asked for.

Same input, same answer (docs/architecture.md, "Batch invariance"): for each model file, `vitserve serve` is started
as a user starts it (with `--set NAME=VALUE` server settings) and sent the first `--images` Fashion-MNIST test
images as PNGs (the `image` input of `/v2`, so decoding and preprocessing are the server's), first **alone** (one
client, one request at a time: every batch holds one image), then **mixed**: the same images shuffled into bursts of
1 to `--max-burst` requests, each burst sent at once so that the batcher puts its images together. The server's
statistics give the mean batch size of each phase, so a run in which nothing was batched cannot pass for invariance.

Each of `--max-tokens` (default: the file's full budget) is measured so, every request asking `max_tokens` and
`degrade: never` (docs/token-budgets.md): each answer must come at the budget the server's configuration says that
asks for, the same alone and mixed. An answer refused (429) or at another budget is counted, never compared, and
makes the run exit 1. A file's rungs without measured accuracies are served only with
`--set budget_unmeasured_rungs=true`.

Reported per file and budget: the budgets served, images whose top-1 class changed, the largest logit difference,
the mean batch size of each phase, and the top-1 accuracy of the served answers against the test labels beside the
file's own table at that budget (its metadata, measured by `vitserve export --eval`) and their difference in points.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from vitserve.bench.config import LOOPBACK
from vitserve.bench.oip import decode_outputs, infer_target
from vitserve.bench.report import command_line, publish
from vitserve.bench.servers import ServerProcess, free_port, serve_argv
from vitserve.model.config import FASHION_MNIST_DIR
from vitserve.onnx_header import read_model_info
from vitserve.service.schemas.binary_tensors import HEADER_LENGTH, join_body, pack_bytes, split_body

FASHION_MNIST_TEST = Path(FASHION_MNIST_DIR) / "t10k-images-idx3-ubyte.gz"
FASHION_MNIST_TEST_LABELS = Path(FASHION_MNIST_DIR) / "t10k-labels-idx1-ubyte.gz"


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


def idx_labels(path: Path, count: int) -> np.ndarray:
    """The first `count` labels of an IDX label file, as the model's class indices (a model trained on the set)."""
    from vitserve.model.data import read_idx

    labels = read_idx(path)[:count].astype(np.int64)
    if len(labels) < count:
        raise SystemExit(f"{path} holds {len(labels)} labels, fewer than the {count} images asked for")
    return labels


@dataclass(frozen=True)
class Answer:
    """One image's answer: its logits and the token budget it was answered at; both None when refused (429)."""

    logits: np.ndarray | None
    budget_tokens: int | None


REFUSED = Answer(None, None)


def logits_request(png: bytes, max_tokens: int) -> tuple[bytes, dict[str, str]]:
    """The PNG as the `image` input; `logits` answered as a binary float32 tensor (compared bit for bit). At most
    `max_tokens`, never cheaper under load: an answer at another budget would compare two different models."""
    data = pack_bytes([png])
    tensor = {"name": "image", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": len(data)}}
    return join_body({"inputs": [tensor], "outputs": [{"name": "logits", "parameters": {"binary_data": True}}],
                      "parameters": {"max_tokens": max_tokens, "degrade": "never"}}, [data])


async def answer_of(client, model: str, png: bytes, max_tokens: int) -> Answer:
    body, headers = logits_request(png, max_tokens)
    answer = await client.post(infer_target(model), content=body, headers=headers)
    if answer.status_code == 429:  # refused rather than answered cheaper: counted, the measurement fails
        return REFUSED
    answer.raise_for_status()
    header_length = answer.headers.get(HEADER_LENGTH)
    outputs, _ = decode_outputs(answer.content, header_length)
    parameters = json.loads(split_body(answer.content, header_length)[0]).get("parameters") or {}
    return Answer(outputs["logits"][0], parameters.get("budget_tokens"))


async def batching_counts(client, model: str) -> tuple[int, int]:
    """(inferences, executions) of the model so far: their ratio is the mean batch size."""
    stats = (await client.get(f"/v2/models/{model}/stats")).json()["model_stats"]
    return sum(s["inference_count"] for s in stats), sum(s["execution_count"] for s in stats)


async def served_budgets(client, model: str) -> list[int]:
    """The token budgets the server serves this model at, the full budget first (its /v2 configuration)."""
    parameters = (await client.get(f"/v2/models/{model}/config")).json()["parameters"]
    return [int(t) for t in parameters["budget_tokens"]["string_value"].split(",")]


def expected_rung(served: list[int], max_tokens: int) -> int:
    """The budget a request of `max_tokens` must be answered at: the most accurate served one within it."""
    if max_tokens >= served[0]:
        return served[0]
    within = [tokens for tokens in served if tokens <= max_tokens]
    if not within:
        raise SystemExit(f"max_tokens {max_tokens} is below every budget served ({served}): budgets without a "
                         f"measured accuracy need --set budget_unmeasured_rungs=true, those below the floor a lower "
                         f"--set budget_accuracy_floor=POINTS")
    return within[0]


async def alone_phase(client, model: str, pngs: list[bytes], max_tokens: int) -> list[Answer]:
    return [await answer_of(client, model, png, max_tokens) for png in pngs]


async def mixed_phase(client, model: str, pngs: list[bytes], max_tokens: int, max_burst: int,
                      rng: np.random.Generator) -> list[Answer]:
    """The images shuffled into bursts of 1 to `max_burst` requests, each burst sent at once."""
    order, answers, start = rng.permutation(len(pngs)), [REFUSED] * len(pngs), 0
    while start < len(order):
        burst = order[start:start + int(rng.integers(1, max_burst + 1))]
        for i, answer in zip(burst, await asyncio.gather(*(answer_of(client, model, pngs[i], max_tokens)
                                                           for i in burst))):
            answers[i] = answer
        start += len(burst)
    return answers


async def measure(port: int, pngs: list[bytes], labels: np.ndarray, budgets: list[int] | None, max_burst: int,
                  seed: int) -> list[dict]:
    """One row per budget asked (None: the full budget): its alone and mixed phases, compared."""
    import httpx

    limits = httpx.Limits(max_connections=max_burst)
    async with httpx.AsyncClient(base_url=f"http://{LOOPBACK}:{port}", limits=limits, timeout=120) as client:
        model = (await client.get("/v1/models")).json()["models"][0]["name"]
        served = await served_budgets(client, model)
        rng, rows = np.random.default_rng(seed), []
        for max_tokens in budgets or served[:1]:
            expected = expected_rung(served, max_tokens)
            started, counted = time.perf_counter(), await batching_counts(client, model)
            alone = await alone_phase(client, model, pngs, max_tokens)
            after_alone = await batching_counts(client, model)
            mixed = await mixed_phase(client, model, pngs, max_tokens, max_burst, rng)
            after_mixed = await batching_counts(client, model)
            rows.append({"model": model, "max_tokens": max_tokens, "expected_tokens": expected,
                         **compare(alone, mixed, labels, expected),
                         "mean_batch_alone": _mean_batch(counted, after_alone),
                         "mean_batch_mixed": _mean_batch(after_alone, after_mixed),
                         "seconds": round(time.perf_counter() - started, 1)})
    return rows


def compare(alone: list[Answer], mixed: list[Answer], labels: np.ndarray, expected: int) -> dict:
    """Alone against mixed, over the images answered at the expected budget in both; every other answer counted
    (refused, or at another budget) instead of compared. Accuracy: the alone answers of the images compared."""
    answered = [a for a in alone + mixed if a.logits is not None]
    at_budget = [i for i, (a, m) in enumerate(zip(alone, mixed)) if a.budget_tokens == m.budget_tokens == expected]
    counts = {"images": len(alone), "refused": len(alone) + len(mixed) - len(answered),
              "off_budget": sum(a.budget_tokens != expected for a in answered), "compared": len(at_budget),
              "budget_tokens": sorted({a.budget_tokens for a in answered if a.budget_tokens is not None})}
    if not at_budget:
        return {**counts, "top1_changes": 0, "max_logit_diff": None, "accuracy": None}
    first, second = _stacked(alone, at_budget), _stacked(mixed, at_budget)
    correct = first.argmax(1) == labels[at_budget]
    return {**counts, "top1_changes": int((first.argmax(1) != second.argmax(1)).sum()),
            "max_logit_diff": float(np.abs(first - second).max()), "accuracy": float(correct.mean())}


def _stacked(answers: list[Answer], indices: list[int]) -> np.ndarray:
    return np.stack([logits for i in indices if (logits := answers[i].logits) is not None])


def _mean_batch(before: tuple[int, int], after: tuple[int, int]) -> float:
    inferences, executions = after[0] - before[0], after[1] - before[1]
    return inferences / executions if executions else 0.0


def with_file_accuracy(row: dict, path: Path | str) -> dict:
    """The row with the file's own accuracy at the budget served (its metadata's table; None: not measured) and
    the served accuracy's difference from it, in percentage points."""
    table = {rung.tokens: rung.accuracy for rung in read_model_info(path).ladder}
    own = table.get(row["expected_tokens"])
    diff = None if own is None or row["accuracy"] is None else round((row["accuracy"] - own) * 100, 4)
    return {**row, "file_accuracy": own, "accuracy_diff_points": diff}


def run_file(path: Path, pngs: list[bytes], labels: np.ndarray, args: argparse.Namespace) -> list[dict]:
    port = free_port()
    # Every request waits out the queue delay (not run at once by an idle model): bursts then fill batches, the
    # case invariance is about; alone, each image still runs by itself.
    env = {"VITSERVE_LOG_LEVEL": "info", "VITSERVE_GRPC_PORT": "0", "VITSERVE_RUNTIME": args.runtime,
           "VITSERVE_MAX_QUEUE_DELAY_MS": str(args.queue_delay_ms), "VITSERVE_DISPATCH_WHEN_IDLE": "false",
           "VITSERVE_PRECISION_HINT": args.precision_hint,
           **{f"VITSERVE_{name.upper()}": value for name, value in args.settings}}
    # the server's log kept (build/bench-logs): a connection the server dropped mid-run is explained there
    log_dir = Path("build/bench-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"invariance-{path.stem}-{args.runtime}-{args.precision_hint}.log"
    with ServerProcess(serve_argv(path, port), port, env=env, log_path=log_path):
        rows = asyncio.run(measure(port, pngs, labels, args.max_tokens, args.max_burst, args.seed))
    return [with_file_accuracy({"file": str(path), "runtime": args.runtime, "precision_hint": args.precision_hint,
                                **row}, path) for row in rows]


def render(rows: list[dict], command: str) -> str:
    lines = ["# Batch invariance through the server", "", f"`{command}`", "",
             "Each budget asked with `max_tokens` and `degrade: never`; refused: answers refused with 429; off "
             "budget: answers at another budget than the one asked for (neither is compared). Accuracy: the alone "
             "answers' top-1 against the test labels, beside the file's own table at that budget.", "",
             "| file | runtime | precision hint | max tokens | budget tokens served | images | refused | off budget | "
             "top-1 changes | largest logit difference | mean batch alone | mean batch mixed | served accuracy | "
             "file's accuracy | difference (points) |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['file']} | {r['runtime']} | {r['precision_hint']} | {r['max_tokens']} | "
              f"{', '.join(map(str, r['budget_tokens'])) or '-'} | {r['images']} | {r['refused']} | "
              f"{r['off_budget']} | {r['top1_changes']} | {_number(r['max_logit_diff'], '.3g')} | "
              f"{r['mean_batch_alone']:.2f} | {r['mean_batch_mixed']:.2f} | {_percent(r['accuracy'])} | "
              f"{_percent(r['file_accuracy'])} | {_number(r['accuracy_diff_points'], '+.2f')} |" for r in rows]
    return "\n".join(lines) + "\n"


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.2%}"


def failures(rows: list[dict]) -> list[str]:
    """What makes a row no measurement: an answer refused or at another budget, an image not compared."""
    return [f"{r['file']} at max_tokens {r['max_tokens']}: {r['refused']} refused, {r['off_budget']} off budget, "
            f"{r['images'] - r['compared']} of {r['images']} images not compared"
            for r in rows if r["refused"] or r["off_budget"] or r["compared"] < r["images"]]


def _token_counts(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (a server setting), got {text!r}")
    return name.strip().lower().removeprefix("vitserve_"), value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m vitserve.bench.invariance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", type=Path, required=True, help="a model file (repeatable)")
    parser.add_argument("--images", type=int, default=2000, help="Fashion-MNIST test images (default 2000)")
    parser.add_argument("--max-tokens", nargs="+", type=_token_counts, metavar="N",
                        help="token budgets to measure, each on its own row (N N ... or N,N,...; default: each "
                             "file's full budget)")
    parser.add_argument("--max-burst", type=int, default=32, help="largest burst of concurrent requests")
    parser.add_argument("--runtime", default="onnxruntime", help="VITSERVE_RUNTIME of the servers")
    parser.add_argument("--precision-hint", default="auto", help="VITSERVE_PRECISION_HINT of the servers (bf16 "
                                                                   "on a CPU that has it)")
    parser.add_argument("--queue-delay-ms", type=int, default=50, help="the servers' batching delay (default 50)")
    parser.add_argument("--set", dest="settings", type=_setting, action="append", default=[], metavar="NAME=VALUE",
                        help="a server setting (repeatable), e.g. --set budget_unmeasured_rungs=true")
    parser.add_argument("--test-images", type=Path, default=FASHION_MNIST_TEST, help="an IDX image file")
    parser.add_argument("--test-labels", type=Path, default=FASHION_MNIST_TEST_LABELS, help="its IDX label file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the Markdown (and its JSON) here")
    args = parser.parse_args(argv)
    args.max_tokens = [n for group in args.max_tokens for n in group] if args.max_tokens else None
    return args


def main(argv: list[str] | None = None) -> int:
    """Exit status 1 when a row is no measurement (`failures`): its table is still written."""
    args = parse_args(argv)
    pngs = idx_pngs(args.test_images, args.images)
    labels = idx_labels(args.test_labels, args.images)
    rows = [row for path in args.model for row in run_file(path, pngs, labels, args)]
    publish(render(rows, command_line("python -m vitserve.bench.invariance", argv)), rows, args.out)
    for failure in failures(rows):
        print(f"not measured: {failure}", file=sys.stderr)
    return 1 if failures(rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
