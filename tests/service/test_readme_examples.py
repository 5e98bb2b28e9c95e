"""The README's first answers are the bundled model's: its example /v1/classify answer, and its Triton client
example run as written (over HTTP, and over gRPC as the README says it also works), against a real `vitserve serve`
of models/vit-fmnist on ONNX Runtime float32, the runtime the README says its figures come from. Its repository
example runs as written too, in a folder of its own, from the files a fresh checkout has; and every export it gives
fits what the bundled file carries.

A re-exported model, a new field in the answer or a changed example then fails here, not in a new user's terminal.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from vitserve.onnx_header import read_model_info
from service_fixtures import free_port, ready_over_http, uvicorn_server, wait_until

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


# What the repository example's server runs with beyond its own command line: one worker and one thread (the test
# shares the CPUs), ONNX Runtime (the README's figures are its)
LIGHT_SERVER = {"VITSERVE_WORKERS": "1", "VITSERVE_RUNTIME": "onnxruntime", "VITSERVE_PROVIDERS": "cpu",
                "VITSERVE_INTRA_OP_THREADS": "1", "VITSERVE_LOG_LEVEL": "warning", "OMP_NUM_THREADS": "1"}


def bash_commands(block: str) -> list[str]:
    """A bash block's commands, continued lines joined, comment lines left out."""
    lines = block.replace("\\\n", " ").splitlines()
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def free_port_pair() -> int:
    """A free port whose next one is free too: `vitserve serve --port P` puts gRPC on P + 1."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def shown_answer(comment: str) -> dict:
    """The README's answer printed under a command (a comment, numbers cut short with `...`): its model, its
    predictions as (index, label, score as shown) and its OOD fields as shown."""
    predictions = re.findall(r'\{"index":(\d+),"label":"([^"]+)","score":([0-9.]+)\.\.\.\}', comment)
    ood = re.search(r'"ood":\{"score":([0-9.]+)\.\.\.,"threshold":([0-9.]+),"outside":(true|false)\}', comment)
    return {"model": json.loads(re.search(r'"model":(\{[^}]*\})', comment)[1]), "predictions": predictions,
            "ood": ood.groups(), "maps": re.search(r'"rollout":(\w+),"relevance":(\w+)', comment).groups()}


def test_the_readme_repository_example_runs_as_written_beside_make_serve(tmp_path):
    """The example's own commands, each in bash, from a folder that holds what a checkout has (models/, examples/,
    .venv/) and the repo/ they make; only its port is moved to a free one. It leaves `make serve`'s ports alone,
    needs no file a newcomer lacks, and its answer is the one it shows."""
    if shutil.which("curl") is None:
        pytest.skip("needs curl")
    block = readme_block("bash", "--model-repository repo")
    assert "8080" in block and not re.search(r"\b800[01]\b", block)  # beside `make serve` (8000, gRPC 8001)
    commands = bash_commands(block)
    serve = next(i for i, command in enumerate(commands) if " serve " in command)
    for name in ("models", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    port = free_port_pair()
    commands = [command.replace("8080", str(port)) for command in commands]

    def run(command: str) -> str:
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{command}: {done.stderr}"
        return done.stdout

    for command in commands[:serve]:
        run(command)
    server = subprocess.Popen(["bash", "-c", commands[serve]], cwd=tmp_path, env={**os.environ, **LIGHT_SERVER},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"

    ready = ready_over_http(server, base_url, lambda: server.stdout.read().decode())
    try:
        wait_until(ready, "the README's repository server ready")
        printed = [run(command) for command in commands[serve + 1:]]
        index = httpx.post(f"{base_url}/v2/repository/index", headers={"Authorization": "Bearer s3cret"}).json()
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # bash and the server it started: the group start_new_session made
        server.wait(30)
    loaded, answer = printed[-2], json.loads(printed[-1])
    assert loaded == "{}" and "# {}: 2 warmed up, then 1 drained" in block
    assert sorted((v["name"], v["version"], v["state"]) for v in index) == [("fmnist", "1", "UNAVAILABLE"),
                                                                             ("fmnist", "2", "READY")]
    shown = shown_answer(block.split(commands[-1].replace(str(port), "8080"), 1)[1])
    assert answer["model"] == shown["model"] == {"name": "fmnist", "version": "2"}
    assert len(answer["predictions"]) == len(shown["predictions"]) == 2
    for (index_shown, label, score), got in zip(shown["predictions"], answer["predictions"]):
        assert (int(index_shown), label) == (got["index"], got["label"])
        assert 0 <= got["score"] - float(score) < 10.0 ** -(len(score) - 2)  # shown cut short
    score, threshold, outside = shown["ood"]
    assert 0 <= answer["ood"]["score"] - float(score) < 0.1 and answer["ood"]["threshold"] == float(threshold)
    assert answer["ood"]["outside"] is (outside == "true") and shown["maps"] == ("null", "null")
    assert (answer["rollout"], answer["relevance"]) == (None, None)


def readme_exports() -> list[list[str]]:
    """Every `vitserve export` with arguments that the README gives, in its blocks or inline, as arguments."""
    inline = re.findall(r"`(vitserve export [^`]+)`", README)
    lines = re.findall(r"^(vitserve export .+?)(?:\s+#.*)?$", README, re.M)
    return [command.split()[2:] for command in inline + lines if len(command.split()) > 2]


def test_every_readme_export_fits_what_the_bundled_file_carries():
    """An export without --eval serves uncalibrated softmax and `"ood": null`, unlike the bundled model.onnx (and says
    so: tests/export/test_calibration.py). Every export the README gives names a labelled set, and the one that remakes
    the bundled file is the Makefile's. Running it takes over 2 minutes on 2 cores: its answers were compared with the
    bundled file's once, by hand (the README says what they were), not here."""
    exports = readme_exports()
    assert {"models/vit-fmnist/checkpoint", "runs/mine/checkpoint"} <= {args[0] for args in exports}
    assert [args for args in exports if "--eval" not in args] == []
    makefile = (REPO / "Makefile").read_text()
    made = re.search(r"^export-default:.*\n\t\$\(BIN\)/vitserve export (.+)$", makefile, re.M)[1]
    made = made.replace("$(MODEL_DIR)", "models/vit-fmnist").replace("$(DEFAULT_MODEL)", "OUT").replace(
        "$(FASHION_MNIST)", "/usr/share/datasets/fashion-mnist").split()
    remakes = [args for args in exports if args[0] == "models/vit-fmnist/checkpoint" and "--precision" not in args]
    assert len(remakes) == 1
    remake = remakes[0]
    assert remake[:remake.index("--out") + 1] + ["OUT"] + remake[remake.index("--out") + 2:] == made
    bundled = read_model_info(MODEL)
    fitted_on = "Fashion-MNIST test split (/usr/share/datasets/fashion-mnist)"
    assert (bundled.calibration["source"], bundled.ood["source"]) == (fitted_on, fitted_on)
