"""The README's first answers are the bundled model's: its `curl` and `vitserve predict` examples print what it
shows, and its Triton client example runs as written (over HTTP, and over gRPC as the README says it also works),
against a real `vitserve serve` of models/vit-fmnist on ONNX Runtime float32, the runtime the README says its
outputs come from; its table of what differs by CPU holds, the bfloat16 column on a CPU with bfloat16 units. The
repository example (docs/repository.md) runs as written too, in a folder of its own, from the files a fresh
checkout has; and every export the README and docs/training.md give fits what the bundled file carries.

A re-exported model, a new field in the answer or a changed example then fails here, not in a new user's terminal.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from vitserve.onnx_header import read_model_info
from vitserve.service.engine.openvino_runtime import computes_bf16
from service_fixtures import free_port, ready_over_http, uvicorn_server, wait_until

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
# where the README's reference moved: the repository example, the training and export commands
REPOSITORY_DOC = (REPO / "docs" / "repository.md").read_text()
TRAINING_DOC = (REPO / "docs" / "training.md").read_text()
MODEL = REPO / "models" / "vit-fmnist" / "model.onnx"
IMAGE = REPO / "examples" / "ankle-boot.png"
# ONNX Runtime's kernels differ by instruction set (CI's CPU is not this one's): the last printed digit may move
TOLERANCE = 2e-6

pytestmark = pytest.mark.skipif(not MODEL.is_file(), reason="needs the bundled model (models/vit-fmnist/model.onnx)")


def readme_block(language: str, containing: str, page: str = README) -> str:
    """The README's (or `page`'s) one fenced `language` block that contains `containing`."""
    blocks = [b for b in re.findall(rf"```{language}\n(.*?)```", page, re.S) if containing in b]
    assert len(blocks) == 1, f"expected one ```{language} block with {containing!r}"
    return blocks[0]


@pytest.fixture(scope="module")
def server():
    grpc_port = free_port()
    with uvicorn_server(MODEL, "--grpc-port", str(grpc_port)) as (base_url, _):
        yield base_url, grpc_port


def curl_query(block: str) -> dict[str, str]:
    """The query of the block's `curl ... 'http://127.0.0.1:8000/v1/classify?...'`."""
    query = re.search(r"'http://127\.0\.0\.1:8000/v1/classify\?([^']*)'", block)[1]
    return dict(part.split("=", 1) for part in query.split("&"))


def classify(base_url: str, params: dict) -> dict:
    return httpx.post(f"{base_url}/v1/classify", params=params, timeout=60,
                      files={"file": (IMAGE.name, IMAGE.read_bytes(), "image/png")}).json()


def assert_printed_as_shown(shown: dict, answer: dict, path: str = "") -> None:
    """The answer is the line the README shows: the same fields in the same order, the same values, numbers within
    float32's error across instruction sets, `timing_ms` (a new figure every request) by its fields only."""
    if isinstance(shown, dict):
        assert list(answer) == list(shown), path
        for key in shown:
            if key == "timing_ms":
                assert list(answer[key]) == list(shown[key])
            else:
                assert_printed_as_shown(shown[key], answer[key], f"{path}.{key}")
    elif isinstance(shown, list):
        assert len(answer) == len(shown), path
        for i, (a, b) in enumerate(zip(shown, answer)):
            assert_printed_as_shown(a, b, f"{path}[{i}]")
    elif isinstance(shown, float):
        assert answer == pytest.approx(shown, abs=TOLERANCE if abs(shown) < 1 else 2e-4), path
    else:
        assert answer == shown, path


def test_the_readme_curl_example_prints_what_it_shows(server):
    base_url, _ = server
    command = readme_block("bash", "curl -s -F file=@examples/ankle-boot.png")
    printed = json.loads(readme_block("json", '"predictions"'))  # exactly one line, as curl prints it
    assert_printed_as_shown(printed, classify(base_url, curl_query(command)))


def test_the_readme_predict_example_prints_what_it_shows(server, tmp_path):
    base_url, _ = server
    command = readme_block("bash", "vitserve predict").strip()
    shown = readme_block("text", "rank  label").rstrip("\n")
    args = shlex.split(command.replace("http://127.0.0.1:8000", base_url).replace("/tmp", str(tmp_path)))
    assert args[0] == ".venv/bin/vitserve" and "--out-dir" in args
    done = subprocess.run([sys.executable, "-m", "vitserve.cli", *args[1:]], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip("\n") == shown.replace("/tmp", str(tmp_path))
    assert (tmp_path / "ankle-boot.rollout.png").is_file()


def cpu_table() -> dict[str, tuple[str, str]]:
    """The README's table of what differs by CPU: its first column -> (float32's, bfloat16's) as printed."""
    section = README.split("**What differs by CPU.**", 1)[1]
    rows = re.findall(r"^\| ([^|]+?) \| ([^|]+?) \| ([^|]+?) \|$", section, re.M)
    return {name: (fp32, bf16) for name, fp32, bf16 in rows[2:] if not set(name) <= set("- ")}


def figures(cell: str) -> list[float]:
    return [float(v) for v in re.findall(r"-?\d+\.\d+", cell)]


def cpu_table_answers(base_url: str) -> dict[str, list[float]]:
    """This server's figures for each row of the table, in the row's order."""
    none, grid = (classify(base_url, {"top_k": 2, "map": "none"}), classify(base_url, {"top_k": 2}))
    return {"Ankle boot's score, `map=none` / with the rollout": [none["predictions"][0]["score"],
                                                                   grid["predictions"][0]["score"]],
            "Pullover's score, `map=none`": [none["predictions"][1]["score"]],
            "`ood.score`, `map=none` / with the rollout": [none["ood"]["score"], grid["ood"]["score"]],
            "the rollout's first three values": grid["rollout"]["values"][0][:3]}


# On another bfloat16 CPU (AMX rather than AVX512-BF16) OpenVINO's kernels may accumulate in another order: the
# bfloat16 column holds within these (the OOD score's is still below its float32/bfloat16 difference with map=none)
BF16_TOLERANCE = {"score": 1e-3, "ood": 1.0, "rollout": 0.01}


def tolerance(row: str, precision: str) -> float:
    kind = "ood" if "ood" in row else "rollout" if "rollout's" in row else "score"
    if precision == "bf16":
        return BF16_TOLERANCE[kind]
    return {"score": 1e-6, "ood": 2e-4, "rollout": TOLERANCE}[kind]


def test_the_readme_float32_column_is_onnx_runtimes(server):
    base_url, _ = server
    table, answers = cpu_table(), cpu_table_answers(base_url)
    assert set(answers) <= set(table) and table["the `predict` table"] == ("as shown", "as shown")
    for row, got in answers.items():
        assert got == pytest.approx(figures(table[row][0]), abs=tolerance(row, "fp32")), row


@pytest.mark.slow
@pytest.mark.skipif(not computes_bf16(), reason="this CPU has no bfloat16 units (AVX512-BF16 or AMX)")
def test_the_readme_bfloat16_column_is_what_make_serve_answers_on_a_bf16_cpu():
    """`make serve`'s runtime on this CPU (`auto`: OpenVINO bf16, with the graph without maps for `map=none`)."""
    table = cpu_table()
    with uvicorn_server(MODEL, "--runtime", "auto", "--maps-free", "auto") as (base_url, _):
        assert httpx.get(f"{base_url}/v1/model").json()["provider"] == "OpenVINO/CPU/bf16"
        answers = cpu_table_answers(base_url)
    for row, got in answers.items():
        assert got == pytest.approx(figures(table[row][1]), abs=tolerance(row, "bf16")), row


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


@pytest.mark.slow
def test_the_readme_repository_example_runs_as_written_beside_make_serve(tmp_path):
    """The example's own commands, each in bash, from a folder that holds what a checkout has (models/, examples/,
    .venv/) and the repo/ they make; only its port is moved to a free one. It leaves `make serve`'s ports alone,
    needs no file a newcomer lacks, and its answer is the one it shows."""
    if shutil.which("curl") is None:
        pytest.skip("needs curl")
    block = readme_block("bash", "--model-repository repo", REPOSITORY_DOC)
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
    """Every `vitserve export` with arguments that the README and docs/training.md give, in their blocks or inline,
    as arguments."""
    text = README + TRAINING_DOC
    inline = re.findall(r"`(vitserve export [^`]+)`", text)
    lines = re.findall(r"^(vitserve export .+?)(?:\s+#.*)?$", text, re.M)
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
