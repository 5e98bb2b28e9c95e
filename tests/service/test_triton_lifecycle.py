"""Triton's own lifecycle tests of a repository that changes under a running server, ported to vitserve.

Source: triton-inference-server/server, qa/L0_lifecycle/lifecycle_test.py and the test.sh that runs it: the cases
test.sh runs with `--model-control-mode=poll --repository-poll-secs=1` (test_dynamic_model_load_unload,
test_dynamic_version_load_unload, test_dynamic_model_modify, test_dynamic_file_delete, and the curl block that
calls the repository API of a server in poll mode), and their two `_disabled` counterparts, which test.sh runs with
`--model-control-mode=none` to show that nothing follows the files then. Each runs a real `vitserve serve` process
with the same flags and drives it through tritonclient's HTTP and gRPC clients, unmodified, as Triton's test does;
each keeps the original's checks in its order: the server live and ready, each model version ready or not,
inference on the versions that should answer (and the refusal of those that should not), the statistics' entries
and their success counts; and, with each readiness check, the model metadata's `versions` (Triton lists the
ready ones there too).

What stands for what:

- Triton's QA models (`onnx_float32_float32_float32` and friends: versions 1, 2 and 3, the float32 ones with the
  version policy `specific [1, 3]`, the int32 one with `all`; gen_qa_models.py) are the tiny ViT under the same
  names, in the same folders: version 1 is `tiny_onnx`, every later version `tiny_onnx_other` (other weights), as
  Triton's later versions swap their outputs (`swap=(v != 1)`): an answer compared with the file's own ONNX Runtime
  output says which version ran it. `config.pbtxt` is `config.json` (the same version policy, in its JSON form).
- `iu.infer_exact` (one request of batch 1, over HTTP and gRPC, the outputs compared with what the model must
  compute) is `infer_exact` below: `pixel_values` of batch 1 at the trained size, `logits` and `rollout` compared
  with the file run by ONNX Runtime in this process.
- Triton's `time.sleep(5)` after each change to the repository is a wait for the expected state that fails after
  the same 5 s: a model copied in must be ready within the time Triton's test sleeps (the times are printed).
  Where the expected state is that nothing changes (control mode none), the test sleeps the whole 5 s, as Triton's.

Where vitserve deliberately differs (docs/repository.md; docs/open-inference-protocol.md for the protocol):

- Errors: Triton's messages for a model or version not served are "Request for unknown model: 'M' has no available
  versions", "... 'M' is not found" and "... 'M' version 1 is not at ready state"; vitserve's own are checked
  instead: "model 'M' has no ready version" (503), "no model named 'M' is loaded; loaded: ..." (404) and
  "model 'M' version 1 is unloading" or "... is unavailable: <why>" (503).
- test_dynamic_model_modify changes the label file that config.pbtxt names; a vitserve model's labels travel in its
  file (principle 9), so the labels change with a new file copied over version 3's. Triton's change is to the
  configuration alone, which Triton serves by reloading the model: that stays a step of its own, a config.json
  change that leaves the versions as they were (`max_batch_size`), to be served within the same 5 s; it runs last,
  so that Triton's version-policy step before it is checked either way.
- The curl block runs Triton with `--repository-poll-secs=0` (no polling after startup); vitserve's least interval
  is 0.1 s, so it runs with one that does not come during the test (3600 s). Triton refuses load and unload in poll
  mode with 503 (gRPC UNAVAILABLE), vitserve with 403 `repository_control_disabled` (gRPC PERMISSION_DENIED).
- A file copied in is loaded once it has kept its size and modification time for one poll interval (a copy still
  being written is not loaded half-done); Triton loads what it finds at the next poll.

Not ported: test_multiple_model_repository_polling (vitserve serves one `--model-repository`), and the cases of
the explicit mode, custom configurations, ensembles and backends vitserve does not have.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from service_fixtures import PATIENCE_S, free_port, uvicorn_server

pytestmark = pytest.mark.slow  # a server per test, its models loaded and unloaded under tritonclient

POLL_S = 1  # test.sh: --repository-poll-secs=1
TRITON_WAIT_S = 5.0  # lifecycle_test.py: time.sleep(5) after each change to the repository
F32, I32 = "float32_float32_float32", "int32_int32_int32"
ONNX, PLAN, OPENVINO, LIBTORCH = (f"{backend}_{F32}" for backend in ("onnx", "plan", "openvino", "libtorch"))
LIBTORCH_I32 = f"libtorch_{I32}"
SPECIFIC_1_3 = {"specific": {"versions": [1, 3]}}  # gen_qa_models.py's policy for the float32 models
ALL = {"all": {}}  # and for the int32 ones
TRAINED = (32, 32)  # the tiny ViT's trained size (tests/conftest.py)
LABELS_9 = ["cat9", "dog9", "bird9"]  # test.sh: sed 's/label/label9/' on the labels
# Triton's "Request for unknown model: 'M' version 1 is not at ready state": vitserve says "unloading" during the
# half second a retired version still runs what was routed to it (service/engine/server.py), "unavailable" after
NOT_READY = "^model '{}' version 1 is (unloading|unavailable)"
CLASS_ENTRY = re.compile(r"^-?\d+\.\d{6}:(\d+):(\w+)$")  # classification's "value:index:label"

# Every wait for a change to the repository to be served, as the tests observed it: (case, what, seconds)
LOAD_TO_READY: list[tuple[str, str, float]] = []


# --- the repository, the server and its clients ---


@pytest.fixture(scope="module", autouse=True)
def report_load_times():
    """Every wait this file made for a change to be served, listed once at the end (`pytest -s` shows it)."""
    yield
    print("\nwaits for a change to the repository to be served (Triton's test sleeps 5 s):",
          *(f"  {seconds:5.2f} s  {case}: {what}" for case, what, seconds in LOAD_TO_READY), sep="\n")


@pytest.fixture(scope="module")
def files(tiny_onnx, tiny_onnx_other, tmp_path_factory) -> dict[str, Path]:
    """The model files: version 1, every later version, and the later one with Triton's "label9" labels."""
    import onnx

    relabelled = onnx.load(str(tiny_onnx_other))
    for prop in relabelled.metadata_props:
        if prop.key == "vitserve.labels":
            prop.value = json.dumps(LABELS_9)
    path = tmp_path_factory.mktemp("relabelled") / "model.onnx"
    onnx.save(relabelled, str(path))
    return {"first": tiny_onnx, "later": tiny_onnx_other, "relabelled": path}


def qa_model(root: Path, name: str, files: dict[str, Path], policy: dict, versions=(1, 2, 3)) -> Path:
    """`root/name/<v>/model.onnx` for each version (1: the first file, later ones the other) and its config.json."""
    for version in versions:
        (root / name / str(version)).mkdir(parents=True)
        shutil.copy2(files["first" if version == 1 else "later"], root / name / str(version) / "model.onnx")
    (root / name / "config.json").write_text(json.dumps({"version_policy": policy}))
    return root / name


def place_file(source: Path, target: Path) -> None:
    """Copy under a temporary name, then rename into place: how docs/repository.md says to replace a file."""
    temporary = target.with_name(".incoming.onnx")
    shutil.copyfile(source, temporary)
    os.replace(temporary, target)


class Server:
    """A running `vitserve serve`: its addresses for tritonclient and its log, read as it is written."""

    def __init__(self, http_url: str, grpc_url: str, process):
        self.http_url, self.grpc_url, self.lines = http_url, grpc_url, []
        self._reader = threading.Thread(target=self._read, args=(process.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream) -> None:
        for line in iter(stream.readline, b""):
            self.lines.append(line.decode(errors="replace").rstrip())

    def clients(self) -> list:
        """A fresh HTTP and gRPC client, as each step of Triton's test makes."""
        return [httpclient.InferenceServerClient(self.http_url, network_timeout=PATIENCE_S),
                grpcclient.InferenceServerClient(self.grpc_url)]


@contextmanager
def lifecycle_server(root: Path, model_file: Path, mode: str, poll_secs: float = POLL_S):
    """test.sh's server for `root` in control `mode`; its log printed when the test ends (shown if it failed)."""
    grpc_port = free_port()
    flags = ["--model-repository", str(root), "--model-control-mode", mode, "--grpc-port", str(grpc_port),
             "--log-level", "info", "--drain-timeout-s", "5"]  # --exit-timeout-secs=5
    if mode == "poll":
        flags += ["--repository-poll-secs", str(poll_secs)]
    with uvicorn_server(model_file, *flags) as (base_url, process):
        server = Server(base_url.removeprefix("http://"), f"127.0.0.1:{grpc_port}", process)
        try:
            yield server
        finally:
            print(f"--- vitserve serve --model-control-mode {mode} log ---", *server.lines, sep="\n")


# --- Triton's checks ---


def assert_states(server: Server, expected: dict[tuple[str, str], bool]) -> None:
    """Over HTTP and gRPC: the server live and ready, each (model, version) ready or not as `expected`, and the
    metadata of a model with a ready version listing those expected ready and none of the others."""
    for client in server.clients():
        transport = type(client).__module__
        try:
            assert client.is_server_live(), transport
            assert client.is_server_ready(), transport
            for (model, version), ready in expected.items():
                assert client.is_model_ready(model, version) == ready, (transport, model, version)
            for model in {m for (m, _), ready in expected.items() if ready}:
                listed = set(metadata(client, model)["versions"])
                wanted = {v for (m, v), ready in expected.items() if m == model and ready}
                unwanted = {v for (m, v), ready in expected.items() if m == model and not ready}
                assert wanted <= listed and not unwanted & listed, (transport, model, listed)
        finally:
            client.close()


def metadata(client, model: str) -> dict:
    if isinstance(client, httpclient.InferenceServerClient):
        return client.get_model_metadata(model)
    return client.get_model_metadata(model, as_json=True)


def passes_within(check, changed_at: float) -> float:
    """`check()` retried until it raises no AssertionError, at most Triton's 5 s from `changed_at` (its last failure
    raised after that); the seconds from `changed_at` until it passed."""
    deadline = changed_at + TRITON_WAIT_S
    while True:
        try:
            check()
            return time.monotonic() - changed_at
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def states_within(server: Server, expected: dict[tuple[str, str], bool], case: str, what: str,
                  changed_at: float) -> float:
    """Wait until `expected` holds, at most Triton's 5 s from `changed_at` (when the repository changed), then
    check it over both clients; the seconds it took, recorded in LOAD_TO_READY."""
    took = passes_within(lambda: assert_states(server, expected), changed_at)
    LOAD_TO_READY.append((case, what, took))
    print(f"{case}: {what} within {took:.2f} s (Triton waits {TRITON_WAIT_S:.0f} s)")
    return took


def states_after_sleep(server: Server, expected: dict[tuple[str, str], bool]) -> None:
    """Triton's sleep where nothing must change: the whole 5 s, then the check."""
    time.sleep(TRITON_WAIT_S)
    assert_states(server, expected)


def reference(path: Path) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda pixels: dict(zip(("logits", "rollout"), session.run(["logits", "rollout"],
                                                                      {"pixel_values": pixels})))


def request(client, array: np.ndarray, class_count: int = 0):
    """The inputs and outputs of one request for `client`'s module (tritonclient.http or .grpc)."""
    module = httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient
    pixels = module.InferInput("pixel_values", list(array.shape), "FP32")
    pixels.set_data_from_numpy(array)
    outputs = [module.InferRequestedOutput("logits", class_count=class_count), module.InferRequestedOutput("rollout")]
    return [pixels], outputs


def infer_exact(server: Server, model: str, file: Path, version: str | None = None, *, served_by: str) -> None:
    """iu.infer_exact: one image over HTTP and over gRPC, answered by version `served_by` with `file`'s outputs."""
    array = np.random.default_rng(7).normal(size=(1, 3, *TRAINED)).astype(np.float32)
    expected = reference(file)(array)
    for client in server.clients():
        try:
            inputs, outputs = request(client, array)
            result = client.infer(model, inputs, model_version=version or "", outputs=outputs)
            answered = result.get_response()
            answered_version = answered["model_version"] if isinstance(answered, dict) else answered.model_version
            assert answered_version == served_by, (type(client).__module__, answered_version)
            for name, want in expected.items():
                np.testing.assert_allclose(result.as_numpy(name), want, rtol=1e-5, atol=1e-5, err_msg=name)
        finally:
            client.close()


def infer_labels(server: Server, model: str, version: str, file: Path, labels: list[str]) -> None:
    """iu.infer_exact with output0_raw=False: the classification extension names the classes with `labels`."""
    array = np.random.default_rng(7).normal(size=(1, 3, *TRAINED)).astype(np.float32)
    order = np.argsort(-reference(file)(array)["logits"][0])
    for client in server.clients():
        try:
            inputs, outputs = request(client, array, class_count=len(labels))
            entries = client.infer(model, inputs, model_version=version, outputs=outputs).as_numpy("logits")[0]
            parsed = [CLASS_ENTRY.match(e.decode()).groups() for e in entries]
            assert [(int(i), label) for i, label in parsed] == [(int(i), labels[i]) for i in order], parsed
        finally:
            client.close()


def infer_refused(server: Server, model: str, version: str | None, message: str) -> None:
    """The request fails on both transports, and the error says `message` (a regular expression)."""
    array = np.zeros((1, 3, *TRAINED), np.float32)
    for client in server.clients():
        try:
            inputs, outputs = request(client, array)
            with pytest.raises(InferenceServerException) as caught:
                client.infer(model, inputs, model_version=version or "", outputs=outputs)
            assert re.search(message, caught.value.message()), (type(client).__module__, caught.value.message())
        finally:
            client.close()


def success_counts(server: Server, model: str) -> list[dict[str, int]]:
    """get_inference_statistics(model) over HTTP and over gRPC: each entry's {version: success count}, after
    checking every entry is the model's."""
    http, grpc = server.clients()
    try:
        http_stats = http.get_inference_statistics(model)["model_stats"]
        grpc_stats = grpc.get_inference_statistics(model).model_stats
    finally:
        http.close()
        grpc.close()
    assert [s["name"] for s in http_stats] == [model] * len(http_stats)
    assert [s.name for s in grpc_stats] == [model] * len(grpc_stats)
    return [{s["version"]: s["inference_stats"]["success"]["count"] for s in http_stats},
            {s.version: s.inference_stats.success.count for s in grpc_stats}]


def ready(model: str, *versions: str, state: bool = True) -> dict[tuple[str, str], bool]:
    return {(model, v): state for v in versions}


# --- the cases test.sh runs in poll mode ---


def test_dynamic_model_load_unload(tmp_path, files):
    """A model copied into the repository is served, with its own statistics; removed, it is unloaded and refused;
    copied back, it is served again with its statistics from zero; another model removed goes too."""
    root, staged = tmp_path / "models", tmp_path / "staged"
    for name in (OPENVINO, ONNX, PLAN):
        qa_model(root, name, files, SPECIFIC_1_3)
    qa_model(staged, LIBTORCH, files, SPECIFIC_1_3)
    with lifecycle_server(root, files["first"], "poll") as server:
        assert_states(server, {**ready(LIBTORCH, "1", "3", state=False), **ready(ONNX, "1", "3")})

        # Add libtorch model to the model repository and give it time to load
        changed = time.monotonic()
        shutil.copytree(staged / LIBTORCH, root / LIBTORCH)
        states_within(server, {**ready(LIBTORCH, "1", "3"), **ready(ONNX, "1", "3")},
                      "test_dynamic_model_load_unload", f"{LIBTORCH} copied in: versions 1 and 3 ready", changed)
        infer_exact(server, LIBTORCH, files["later"], served_by="3")  # swap=True: the newest, version 3

        # Make sure libtorch has execution stats: version 1 none, version 3 some
        for counts in success_counts(server, LIBTORCH):
            assert set(counts) == {"1", "3"} and counts["1"] == 0 and counts["3"] != 0, counts

        # Remove libtorch model from the model repository: no longer available
        changed = time.monotonic()
        shutil.rmtree(root / LIBTORCH)
        states_within(server, {**ready(LIBTORCH, "1", "3", state=False), **ready(ONNX, "1", "3")},
                      "test_dynamic_model_load_unload", f"{LIBTORCH} removed: unloaded", changed)
        infer_refused(server, LIBTORCH, None, f"model '{LIBTORCH}' has no ready version \\(")

        # Add back the same model. The status/stats should be reset.
        changed = time.monotonic()
        shutil.copytree(staged / LIBTORCH, root / LIBTORCH)
        states_within(server, {**ready(LIBTORCH, "1", "3"), **ready(ONNX, "1", "3")},
                      "test_dynamic_model_load_unload", f"{LIBTORCH} copied back: versions 1 and 3 ready", changed)
        for counts in success_counts(server, LIBTORCH):
            assert counts == {"1": 0, "3": 0}, counts

        # Remove onnx model from the model repository: unavailable, libtorch still served
        changed = time.monotonic()
        shutil.rmtree(root / ONNX)
        states_within(server, {**ready(LIBTORCH, "1", "3"), **ready(ONNX, "1", "3", state=False)},
                      "test_dynamic_model_load_unload", f"{ONNX} removed: unloaded", changed)
        infer_refused(server, ONNX, None, f"model '{ONNX}' has no ready version \\(")


def test_dynamic_version_load_unload(tmp_path, files):
    """A version removed from the repository is unloaded and refused by number; one copied in is served."""
    root = tmp_path / "models"
    qa_model(root, LIBTORCH_I32, files, ALL)
    case = "test_dynamic_version_load_unload"
    with lifecycle_server(root, files["first"], "poll") as server:
        assert_states(server, ready(LIBTORCH_I32, "1", "2", "3"))
        infer_exact(server, LIBTORCH_I32, files["first"], "1", served_by="1")  # swap=False, model_version=1

        # Make sure only version 1 has execution stats
        for counts in success_counts(server, LIBTORCH_I32):
            assert set(counts) == {"1", "2", "3"} and counts["1"] != 0 and counts["2"] == counts["3"] == 0, counts

        # Remove version 1 from the model repository: unavailable
        changed = time.monotonic()
        shutil.rmtree(root / LIBTORCH_I32 / "1")
        states_within(server, {**ready(LIBTORCH_I32, "1", state=False), **ready(LIBTORCH_I32, "2", "3")},
                      case, "version 1 removed: unloaded", changed)
        infer_refused(server, LIBTORCH_I32, "1", NOT_READY.format(LIBTORCH_I32))

        # Add another version to the model repository
        changed = time.monotonic()
        shutil.copytree(root / LIBTORCH_I32 / "2", root / LIBTORCH_I32 / "7")
        states_within(server, {**ready(LIBTORCH_I32, "1", state=False), **ready(LIBTORCH_I32, "2", "3", "7")},
                      case, "version 7 copied in: ready", changed)


def test_dynamic_model_modify(tmp_path, files):
    """A changed model is served as changed: new labels (with its file, where vitserve keeps them), a changed
    configuration, and a version policy that no longer names version 1 (refused since, version 3 still served)."""
    root = tmp_path / "models"
    models = (LIBTORCH, PLAN)
    for name in models:
        qa_model(root, name, files, SPECIFIC_1_3)
    case = "test_dynamic_model_modify"
    with lifecycle_server(root, files["first"], "poll") as server:
        assert_states(server, {k: v for name in models for k, v in ready(name, "1", "3").items()})
        for version, file in (("1", files["first"]), ("3", files["later"])):  # swap=(version == 3)
            for name in models:
                infer_exact(server, name, file, version, served_by=version)

        # Change the labels ("wrong_output0_labels"): version 3's file with labels "label9"
        changed = time.monotonic()
        for name in models:
            place_file(files["relabelled"], root / name / "3" / "model.onnx")
        states_within(server, {k: v for name in models for k, v in ready(name, "1", "3").items()},
                      case, "version 3's file replaced: versions 1 and 3 still ready", changed)
        for name in models:
            wait_for_labels(server, name, "3", files["relabelled"], changed, case)

        # The default version policy (latest 1): only version 3 is available
        changed = time.monotonic()
        for name in models:
            (root / name / "config.json").write_text(json.dumps({}))
        states_within(server, {k: v for name in models for k, v in
                               {**ready(name, "1", state=False), **ready(name, "3")}.items()},
                      case, "version_policy removed from config.json: version 1 unloaded", changed)
        for name in models:
            infer_refused(server, name, "1", NOT_READY.format(name))
            infer_exact(server, name, files["relabelled"], "3", served_by="3")

        # Triton's first change was to the configuration alone: a config.json change that leaves the versions as
        # they are must be served within the same wait too (last here, so that the steps above run either way).
        # The configuration served is then config.json's as it is now: its batch size, the default version policy
        # (and, as Triton's, the version's own file name).
        changed = time.monotonic()
        for name in models:
            (root / name / "config.json").write_text(json.dumps({"max_batch_size": 2}))
        now = {"max_batch_size": 2, "version_policy": {"latest": {"num_versions": 1}},
               "default_model_filename": "model.onnx"}
        for name in models:
            wait_for_config(server, name, now, changed, case,
                            f"{name}'s config.json changed (max_batch_size 2): served")


def wait_for_labels(server: Server, model: str, version: str, file: Path, changed_at: float, case: str) -> None:
    """The classification names `file`'s labels within Triton's 5 s of the change."""
    took = passes_within(lambda: infer_labels(server, model, version, file, LABELS_9), changed_at)
    LOAD_TO_READY.append((case, f"{model} version {version} relabelled: served", took))
    print(f"{case}: {model} version {version}'s new labels served within {took:.2f} s")


def wait_for_config(server: Server, model: str, wanted: dict, changed_at: float, case: str, what: str) -> None:
    """get_model_config over HTTP and gRPC (as JSON) has the `wanted` values within Triton's 5 s of the change."""
    deadline = changed_at + TRITON_WAIT_S
    while True:
        http, grpc = server.clients()
        try:
            configs = [http.get_model_config(model), grpc.get_model_config(model, as_json=True)["config"]]
        finally:
            http.close()
            grpc.close()
        served = [{k: config.get(k) for k in wanted} for config in configs]
        if served == [wanted, wanted]:
            break
        assert time.monotonic() <= deadline, f"{what}: not within {TRITON_WAIT_S:.0f} s; served (HTTP, gRPC): {served}"
        time.sleep(0.05)
    took = time.monotonic() - changed_at
    LOAD_TO_READY.append((case, what, took))
    print(f"{case}: {what} within {took:.2f} s")


def test_dynamic_file_delete(tmp_path, files):
    """The model's configuration deleted: the default version policy (the latest one) serves version 3 only."""
    root = tmp_path / "models"
    models = (ONNX, PLAN)
    for name in models:
        qa_model(root, name, files, SPECIFIC_1_3)
    with lifecycle_server(root, files["first"], "poll") as server:
        assert_states(server, {k: v for name in models for k, v in ready(name, "1", "3").items()})
        for version, file in (("1", files["first"]), ("3", files["later"])):
            for name in models:
                infer_exact(server, name, file, version, served_by=version)

        # Delete the model configuration: only version 3 (latest) available
        changed = time.monotonic()
        for name in models:
            os.remove(root / name / "config.json")
        states_within(server, {k: v for name in models for k, v in
                               {**ready(name, "1", state=False), **ready(name, "3")}.items()},
                      "test_dynamic_file_delete", "config.json deleted: version 1 unloaded", changed)
        for name in models:
            infer_exact(server, name, files["later"], "3", served_by="3")
            infer_refused(server, name, "1", NOT_READY.format(name))


def test_poll_mode_refuses_the_repository_api_and_keeps_serving(tmp_path, files):
    """test.sh's curl block: in poll mode the load and unload calls are refused, and a model whose files are
    deleted stays ready (no poll comes during the test: Triton's --repository-poll-secs=0). Triton refuses with
    503 (gRPC UNAVAILABLE) "explicit model load / unload is not allowed if polling is enabled"; vitserve with 403
    `repository_control_disabled` (gRPC PERMISSION_DENIED), as it refuses them in control mode none."""
    root = tmp_path / "models"
    for name in (OPENVINO, LIBTORCH, ONNX, PLAN):
        qa_model(root, name, files, SPECIFIC_1_3)
    with lifecycle_server(root, files["first"], "poll", poll_secs=3600) as server:
        http, grpc = server.clients()
        try:
            assert refusal(http.unload_model, OPENVINO) == "403"  # unload API should return bad request
            assert refusal(grpc.unload_model, OPENVINO) == "StatusCode.PERMISSION_DENIED"
            assert http.is_model_ready(OPENVINO)  # the model should be available/ready
            for version in (1, 2, 3):  # remove model files so that if reload is triggered, it becomes unavailable
                (root / OPENVINO / str(version) / "model.onnx").unlink()
            assert refusal(http.load_model, OPENVINO) == "403"  # load API should return bad request
            assert refusal(grpc.load_model, OPENVINO) == "StatusCode.PERMISSION_DENIED"
            assert http.is_model_ready(OPENVINO) and grpc.is_model_ready(OPENVINO)  # still available/ready
        finally:
            http.close()
            grpc.close()
        infer_exact(server, OPENVINO, files["later"], served_by="3")


def refusal(call, model: str) -> str:
    """The status of the InferenceServerException that `call(model)` raises, after checking its message."""
    with pytest.raises(InferenceServerException) as caught:
        call(model)
    assert caught.value.message().startswith("load and unload need --model-control-mode explicit"), caught.value
    return caught.value.status()


# --- their counterparts with --model-control-mode=none ---


def test_dynamic_model_load_unload_disabled(tmp_path, files):
    """Control mode none: a model copied in is not loaded, and one removed stays served."""
    root, staged = tmp_path / "models", tmp_path / "staged"
    for name in (OPENVINO, ONNX, PLAN):
        qa_model(root, name, files, SPECIFIC_1_3)
    qa_model(staged, LIBTORCH, files, SPECIFIC_1_3)
    unchanged = {**ready(LIBTORCH, "1", "3", state=False), **ready(ONNX, "1", "3")}
    with lifecycle_server(root, files["first"], "none") as server:
        assert_states(server, unchanged)

        # Add libtorch model to the model repository: it shouldn't load
        shutil.copytree(staged / LIBTORCH, root / LIBTORCH)
        states_after_sleep(server, unchanged)
        infer_refused(server, LIBTORCH, None, f"no model named '{LIBTORCH}' is loaded; loaded: ")

        # Remove one of the original models: unloading is disabled, so it remains served
        shutil.rmtree(root / ONNX)
        states_after_sleep(server, unchanged)
        infer_exact(server, ONNX, files["later"], served_by="3")  # swap=True


def test_dynamic_version_load_unload_disabled(tmp_path, files):
    """Control mode none: a version copied in is not loaded, and one removed stays served."""
    root = tmp_path / "models"
    qa_model(root, LIBTORCH_I32, files, ALL)
    unchanged = {**ready(LIBTORCH_I32, "1", "2", "3"), **ready(LIBTORCH_I32, "7", state=False)}
    with lifecycle_server(root, files["first"], "none") as server:
        # Add a new version to the model repository: it shouldn't load
        shutil.copytree(root / LIBTORCH_I32 / "2", root / LIBTORCH_I32 / "7")
        states_after_sleep(server, unchanged)

        # Remove one of the original versions: unloading is disabled, so it remains served
        shutil.rmtree(root / LIBTORCH_I32 / "1")
        states_after_sleep(server, unchanged)
        infer_exact(server, LIBTORCH_I32, files["first"], "1", served_by="1")  # swap=False, model_version=1
