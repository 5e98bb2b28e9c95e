"""The README's first answers are the bundled model's: its example /v1/classify answer, and its Triton client
example run as written (over HTTP, and over gRPC as the README says it also works), against a real `vitserve serve`
of models/vit-fmnist on ONNX Runtime float32, the runtime the README says its figures come from.

A re-exported model, a new field in the answer or a changed example then fails here, not in a new user's terminal.
"""
from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import httpx
import pytest

from service_fixtures import free_port, uvicorn_server

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
MODEL = REPO / "models" / "vit-fmnist" / "model.onnx"
IMAGE = REPO / "examples" / "ankle-boot.png"
# ONNX Runtime's kernels differ by instruction set (CI's CPU is not this one's): the last printed digit may move
TOLERANCE = 2e-6

pytestmark = pytest.mark.skipif(not MODEL.is_file(), reason="needs the bundled model (models/vit-fmnist/model.onnx)")


def readme_block(language: str, containing: str) -> str:
    """The README's one fenced `language` block that contains `containing`."""
    blocks = [b for b in re.findall(rf"```{language}\n(.*?)```", README, re.S) if containing in b]
    assert len(blocks) == 1, f"expected one ```{language} block with {containing!r} in the README"
    return blocks[0]


@pytest.fixture(scope="module")
def server():
    grpc_port = free_port()
    with uvicorn_server(MODEL, "--grpc-port", str(grpc_port)) as (base_url, _):
        yield base_url, grpc_port


def test_the_readme_example_answer_is_the_bundled_models(server):
    base_url, _ = server
    block = readme_block("json", '"predictions"')
    answer = httpx.post(f"{base_url}/v1/classify", params={"top_k": 3}, timeout=60,
                        files={"file": (IMAGE.name, IMAGE.read_bytes(), "image/png")}).json()
    assert [f'"{key}"' in block for key in answer] == [True] * len(answer)  # every field the answer has is shown
    shown = re.findall(r'\{"index": (\d+), "label": "([^"]+)", "score": ([0-9.]+)\.\.\.\}', block)
    assert len(shown) == 2
    for (index, label, score), got in zip(shown, answer["predictions"]):
        assert (int(index), label) == (got["index"], got["label"])
        assert got["score"] == pytest.approx(float(score), abs=10.0 ** -(len(score) - 2))  # shown cut short
    rollout = re.search(r'"values": \[\[([-0-9., ]+), \.\.\.\]', block)[1]
    assert answer["rollout"]["values"][0][:3] == pytest.approx([float(v) for v in rollout.split(",")], abs=TOLERANCE)
    ood = json.loads(re.search(r'"ood": (\{[^}]*\})', block)[1])
    assert (answer["ood"]["threshold"], answer["ood"]["outside"]) == (ood["threshold"], ood["outside"])
    assert answer["ood"]["score"] == pytest.approx(ood["score"], abs=1e-3)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_readme_triton_client_example_runs_as_written_and_prints_what_it_shows(server, protocol, monkeypatch):
    base_url, grpc_port = server
    code = readme_block("python", "tritonclient.http as triton")
    printed = re.search(r"^# (\[\[b'.*\]\])$", code, re.M)[1]  # numpy's print: no commas between the entries
    expected = re.findall(r"b'([^']*)'", printed)
    address = base_url.removeprefix("http://") if protocol == "http" else f"127.0.0.1:{grpc_port}"
    code = code.replace('"127.0.0.1:8000"', repr(address)).replace("tritonclient.http", f"tritonclient.{protocol}")
    monkeypatch.chdir(REPO)  # the example opens examples/ankle-boot.png from the repository's root
    scope: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 (the README's own example, run as a user would)
    got = scope["result"].as_numpy("logits")[0]
    scope["client"].close()
    assert len(got) == len(expected)
    for entry, shown in zip(got, expected):
        value, index, label = entry.decode().split(":")
        shown_value, shown_index, shown_label = shown.split(":")
        assert (index, label) == (shown_index, shown_label)
        assert float(value) == pytest.approx(float(shown_value), abs=TOLERANCE)
