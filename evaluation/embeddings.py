"""`python -m vitserve.evaluation.embeddings --out docs/embeddings.md`: are the served embeddings good for search?

Each of Fashion-MNIST's 10,000 test images is embedded by the served file (its `embedding` output, through ONNX
Runtime as the server runs it, or `--runtime openvino --precision-hint bf16` as `auto` may choose), and so is each
of the 60,000 training images; the test image's nearest training image (cosine similarity of the L2-normalised
vectors, as `POST /v1/embed?normalize=true` gives them) should share its label. The figure to beat is the
classifier's own accuracy: neighbours agreeing more often than that would be a surprise, far less often would say
the vector is a poor one to search by.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from vitserve.artifact import EMBEDDING_NAME, INPUT_NAME, OUTPUT_NAMES, ModelInfo
from vitserve.export.calibration import graph_outputs
from vitserve.export.verify import cpu_session
from vitserve.model.data import read_idx


def unit(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def nearest(queries: np.ndarray, keys: np.ndarray, chunk: int = 1000) -> np.ndarray:
    """For each unit query, the index of the unit key with the highest dot product (cosine similarity)."""
    return np.concatenate([np.argmax(queries[i:i + chunk] @ keys.T, axis=1) for i in range(0, len(queries), chunk)])


class ServedRuntime:
    """A runtime as the server loads it (service/engine/runtime.py), with an ONNX Runtime session's `run`."""

    def __init__(self, model: Path, runtime: str, precision_hint: str, threads: int):
        from vitserve.service.engine.runtime import load_model
        from vitserve.service.ground.settings import Settings

        self.model = load_model(Settings(model_path=model, providers=["cpu"], runtime=runtime,
                                         precision_hint=precision_hint, intra_op_threads=threads))
        self.info = self.model.info

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        outputs = dict(zip(self.info.output_names(), self.model.run(feeds[INPUT_NAME])))
        return [outputs[name] for name in names]


def measure(model: Path, data_dir: Path, threads: int, runtime: str = "onnxruntime",
            precision_hint: str = "auto") -> dict:
    if runtime == "onnxruntime":
        session = cpu_session(str(model), threads=threads)
        info = ModelInfo.from_metadata(session.get_modelmeta().custom_metadata_map)
        runs_on = "ONNX Runtime/CPU/fp32"
    else:
        session = ServedRuntime(model, runtime, precision_hint, threads)
        info, runs_on = session.info, session.model.provider
    if not info.embedding_size:
        raise SystemExit(f"{model} has no {EMBEDDING_NAME} output: export it again")

    def load(kind: str) -> tuple[np.ndarray, np.ndarray]:
        images = read_idx(next(data_dir.glob(f"{kind}-images-idx3-ubyte*")))[:, None]
        return images, read_idx(next(data_dir.glob(f"{kind}-labels-idx1-ubyte*"))).astype(np.int64)

    started = time.perf_counter()
    (train, train_labels), (test, test_labels) = load("train"), load("t10k")
    train_vectors, = graph_outputs(session, train, info.mean, info.std, [EMBEDDING_NAME])
    test_logits, test_vectors = graph_outputs(session, test, info.mean, info.std, [OUTPUT_NAMES[0], EMBEDDING_NAME])
    embedded_s = time.perf_counter() - started
    neighbour = nearest(unit(test_vectors), unit(train_vectors))
    agreement = float(np.mean(train_labels[neighbour] == test_labels))
    return {"model": str(model), "name": f"{info.name} {info.version} ({info.precision})", "runs_on": runs_on,
            "dim": info.embedding_size,
            "train": len(train), "test": len(test), "agreement": agreement,
            "accuracy": float(np.mean(test_logits.argmax(1) == test_labels)),
            "per_class": {label: float(np.mean(train_labels[neighbour[test_labels == i]] == i))
                          for i, label in enumerate(info.labels)},
            "embedded_s": embedded_s, "seconds": time.perf_counter() - started}


def markdown(result: dict) -> str:
    lines = ["# Embeddings: nearest neighbours", "", __doc__.split("\n\n", 1)[1].strip(), "",
             f"Model {result['name']}, `{result['model']}`, on {result['runs_on']}, {result['dim']}-d embeddings; "
             f"{result['test']:,} test images against {result['train']:,} training images; "
             f"{result['seconds']:.0f} s on this machine (embedding: {result['embedded_s']:.0f} s).", "",
             "| measure | value |", "| --- | --- |",
             f"| test images whose nearest training image shares their label | **{result['agreement']:.2%}** |",
             f"| the classifier's own accuracy on them | {result['accuracy']:.2%} |", "",
             "| class | nearest neighbour agrees |", "| --- | --- |"]
    lines += [f"| {label} | {value:.1%} |" for label, value in result["per_class"].items()]
    lines += ["", "Reproduce: `python -m vitserve.evaluation.embeddings --out docs/embeddings.md`. That the vectors "
              "are the PyTorch model's class token (within 1e-5 of the largest value, at the trained size and twice "
              "it, in both of the file's paths) is verified by every `vitserve export`."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vitserve.evaluation.embeddings", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=Path("models/vit-fmnist/model.onnx"))
    p.add_argument("--data-dir", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: the runtime's default)")
    p.add_argument("--runtime", choices=["onnxruntime", "openvino"], default="onnxruntime")
    p.add_argument("--precision-hint", choices=["auto", "fp32", "bf16"], default="auto",
                   help="with --runtime openvino")
    p.add_argument("--out", type=Path, help="write the Markdown here too")
    args = p.parse_args(argv)
    if args.threads < 0:
        p.error("--threads must be 0 (the runtime's default) or more")
    text = markdown(measure(args.model, args.data_dir, args.threads, args.runtime, args.precision_hint))
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
