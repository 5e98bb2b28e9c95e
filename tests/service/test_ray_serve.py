"""vitserve on Ray Serve, for real: `vitserve serve --ray` starts a local Ray cluster (the same engine as a large
one) with two replicas behind Ray's HTTP proxy. Concurrent requests get the same answers as the model run
directly, spread over both replicas; errors are the app's own; every replica's metrics reach Ray's metrics
export under our names; a replica killed under load is replaced and no request hangs; SIGTERM takes it all down.
The deployment's options from the settings are checked without Ray running."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from service_fixtures import REPO, free_port, image_bytes, patterned_png, ready_over_http, samples, wait_until
from test_monitoring_config import RULE_FILES, api_get, needs_promtool, running_prometheus

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'vitserve[ray]')")

from vitserve.service.ray_serve import (REPLICA_HEADER, deployment_options, local_shortfall,  # noqa: E402
                                        replica_settings, start_local_cluster)
from vitserve.service.ground.settings import Settings  # noqa: E402

REPLICAS = 2
RAY_PATIENCE_S = 180.0  # a Ray cluster (a retried start included: 30 s more) and two warmed-up replicas, loaded 2 cores


# --- the deployment from the settings (no cluster) ---

def test_replicas_run_the_model_in_process_with_the_cpus_ray_reserves(tmp_path):
    settings = replica_settings(Settings(model_path=Path("m.onnx"), ray_replica_cpus=2.5, workers=4))
    assert (settings.engine, settings.workers, settings.intra_op_threads) == ("inline", 1, 2)
    assert settings.model_path == Path.cwd() / "m.onnx"
    # what was not set stays unset, so a replica applies its own defaults (the providers' best available)
    assert "providers" not in settings.model_fields_set
    named = replica_settings(Settings(model_path=tmp_path / "m.onnx", intra_op_threads=3))
    assert named.intra_op_threads == 3


def test_deployment_options_carry_the_admission_limit_and_the_drain():
    fixed = deployment_options(Settings(ray_replicas=3, max_requests_in_flight=40, drain_timeout_s=20,
                                        ray_max_queued_requests=100, retry_after_s=2, ray_replica_gpus=0.5))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["max_ongoing_requests"] == 40 and fixed["max_queued_requests"] == 100
    assert fixed["backpressure_config"] == {"status_code": 429, "retry_after_s": 2}
    assert fixed["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.5}
    assert fixed["graceful_shutdown_timeout_s"] == 22.0
    scaled = deployment_options(Settings(ray_replicas=1, ray_max_replicas=4, ray_target_ongoing_requests=8))
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8.0}


def test_a_local_cluster_too_small_for_the_replicas_is_refused_before_deploying():
    assert local_shortfall(Settings(ray_replicas=2), {"CPU": 2.0}) is None
    assert local_shortfall(Settings(ray_replicas=3), {"CPU": 2.0}) == (
        "3 replica(s) of 1 CPU(s) need 3; this machine has 2: lower --ray-replicas or --ray-replica-cpus")
    assert local_shortfall(Settings(ray_replicas=1, ray_replica_gpus=1), {"CPU": 8.0}) == (
        "1 replica(s) of 1 GPU(s) need 1; this machine has 0: lower --ray-replicas or --ray-replica-gpus")


class _LateRaylet:
    """A `ray` whose first `init` starts a process (a raylet that never registered, say) and raises what Ray raises
    when its fixed 30 s wait runs out; later calls start nothing and succeed."""

    def __init__(self, failures: int, error: str = "The current node timed out during startup. This could happen "
                                                      "because some of the raylet failed to startup"):
        self.failures, self.error, self.calls, self.started = failures, error, [], []

    def init(self, **options):
        self.calls.append(options)
        if len(self.calls) <= self.failures:
            self.started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
            raise Exception(self.error)


def test_a_local_cluster_that_misses_rays_start_wait_is_stopped_and_started_again():
    ray = _LateRaylet(failures=1)
    start_local_cluster(ray, {"address": None, "_metrics_export_port": 1234})
    assert ray.calls == [{"address": None, "_metrics_export_port": 1234}] * 2
    (stray,) = ray.started
    assert stray.poll() is not None  # what the failed attempt left running was stopped before the second


def test_a_local_cluster_start_gives_up_after_its_attempts_and_other_errors_are_not_retried():
    ray = _LateRaylet(failures=5)
    with pytest.raises(Exception, match="timed out during startup"):
        start_local_cluster(ray, {}, attempts=2)
    assert len(ray.calls) == 2
    assert ray.started[0].poll() is not None
    ray.started[-1].kill()  # the last attempt's leftovers are Ray's reaper's (it fate-shares with the server)
    other = _LateRaylet(failures=1, error="Ray has not been started yet")
    with pytest.raises(Exception, match="not been started"):
        start_local_cluster(other, {})
    assert len(other.calls) == 1
    other.started[0].kill()


def test_max_replicas_below_replicas_is_refused():
    with pytest.raises(ValueError, match="ray_max_replicas 1 is below ray_replicas 2"):
        Settings(ray_replicas=2, ray_max_replicas=1)


def test_the_shipped_serve_config_is_valid_for_ray_and_the_rayservice_carries_it():
    from ray.serve.schema import ServeDeploySchema
    config = yaml.safe_load((REPO / "deploy/ray/serve-config.yaml").read_text())
    ServeDeploySchema.model_validate(config)  # Ray's own schema: what `serve deploy` checks
    (application,) = config["applications"]
    assert application["import_path"] == "vitserve.service.ray_serve:build_app"
    settings = Settings(**application["args"])  # every key a vitserve setting
    assert (settings.ray_replicas, settings.ray_max_replicas) == (2, 8)
    assert deployment_options(settings)["autoscaling_config"]["max_replicas"] == 8
    rayservice = yaml.safe_load((REPO / "deploy/ray/rayservice.yaml").read_text())
    assert yaml.safe_load(rayservice["spec"]["serveConfigV2"]) == config


# --- a real local cluster ---

@contextmanager
def ray_server(model_path: Path, log_path: Path, *flags: str):
    """`vitserve serve --ray` in a process of its own (`model_path` a file or a repository); yields (base_url,
    metrics_url, process) once ready."""
    port, metrics_port = free_port(), free_port()  # below the ephemeral range (service_fixtures)
    model = ["--model-repository" if model_path.is_dir() else "--model", str(model_path)]
    argv = [sys.executable, "-m", "vitserve.cli", "serve", "--ray", *model, "--port", str(port),
            "--ray-replicas", str(REPLICAS), "--ray-metrics-export-port", str(metrics_port), "--providers", "cpu",
            "--warmup-batch-sizes", "1", "--log-level", "warning", "--max-loop-lag-ms", "60000",
            "--runtime", "onnxruntime", *flags]  # `auto` could pick OpenVINO bf16, whose top-3 may differ from ORT's
    # Ray's own report interval (10 s) stays: its agent forgets a gauge not re-sent within two of them, so
    # shortening it in some processes only would lose the gauges.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    with open(log_path, "wb") as log:  # Ray logs every request: a pipe nobody reads would fill and stall it
        process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"

    ready = ready_over_http(process, base_url, lambda: log_path.read_text()[-4000:])
    try:
        wait_until(ready, "vitserve on Ray Serve ready", RAY_PATIENCE_S)
        yield base_url, f"http://127.0.0.1:{metrics_port}/metrics", process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                for pid in [*descendants(process.pid), process.pid]:
                    _kill(pid)
                process.wait()


@pytest.fixture(scope="module")
def ray_cluster(tiny_onnx, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("ray") / "server.log"
    with ray_server(tiny_onnx, log_path) as server:
        yield server


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Ray's GCS, raylet, agents and workers under the server), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def replica_pids(server_pid: int) -> list[int]:
    pids = []
    for pid in descendants(server_pid):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if title.startswith(b"ray::ServeReplica:vitserve"):
            pids.append(pid)
    return pids


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def classify(url: str, data: bytes, client: httpx.Client | None = None, **params) -> httpx.Response:
    post = client.post if client else httpx.post
    return post(f"{url}/v1/classify", params=params, files={"file": ("a.png", data, "image/png")}, timeout=60)


@pytest.mark.slow
def test_two_replicas_answer_concurrent_requests_like_the_model_itself(ray_cluster, tiny_model):
    url, _, _ = ray_cluster
    images = [patterned_png((40 + 8 * i, 36)) for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(lambda i: classify(url, images[i % 6], top_k=3), range(96)))
    assert [r.status_code for r in responses] == [200] * 96
    by_replica = Counter(r.headers[REPLICA_HEADER] for r in responses)
    assert len(by_replica) == REPLICAS, by_replica  # both replicas served
    assert min(by_replica.values()) >= 5, by_replica
    # the same answers as the model run here directly, whichever replica gave them
    from vitserve.service.usecases.preprocess import prepare_image
    for i, response in enumerate(responses[:6]):
        prepared = prepare_image(images[i], tiny_model.info, resize="fit", max_bytes=10**7, max_pixels=10**7,
                                 max_tokens=4096, keep_source=False, max_render_side=1024)
        logits = tiny_model.run(prepared.pixels[None])[0][0]
        expected = np.argsort(-logits)[:3].tolist()
        assert [p["index"] for p in response.json()["predictions"]] == expected


@pytest.mark.slow
def test_the_same_errors_and_protocols_as_the_plain_server(ray_cluster):
    url, _, _ = ray_cluster
    not_an_image = httpx.post(f"{url}/v1/classify", files={"file": ("a.txt", b"hello", "text/plain")}, timeout=30)
    assert not_an_image.status_code == 415 and not_an_image.json()["error"]["code"] == "unsupported_media_type"
    bad_parameter = classify(url, image_bytes("PNG"), top_k=0)
    assert bad_parameter.status_code == 422 and bad_parameter.json()["error"]["code"] == "invalid_parameter"
    huge = httpx.post(f"{url}/v1/classify", content=b"\0" * (21 * 2**20), headers={"content-type": "image/png"},
                      timeout=60)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "payload_too_large"
    unknown_model = httpx.post(f"{url}/v2/models/nope/infer", json={"inputs": []}, timeout=30)
    assert unknown_model.status_code == 404 and "error" in unknown_model.json()
    # Triton's own client, unmodified, through Ray's proxy
    import tritonclient.http as triton
    client = triton.InferenceServerClient(url.removeprefix("http://"))
    assert client.is_server_ready() and client.is_model_ready("tiny-vit")
    pixels = np.zeros((2, 3, 32, 32), np.float32)
    tensor = triton.InferInput("pixel_values", list(pixels.shape), "FP32")
    tensor.set_data_from_numpy(pixels, binary_data=True)
    result = client.infer("tiny-vit", [tensor], outputs=[triton.InferRequestedOutput("logits", binary_data=True)])
    assert result.as_numpy("logits").shape[0] == 2


@pytest.mark.slow
def test_every_replicas_metrics_reach_rays_export_under_our_names(ray_cluster):
    url, metrics_url, _ = ray_cluster
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answered = list(pool.map(lambda _: classify(url, image_bytes("PNG")), range(48)))
    replicas = {r.headers[REPLICA_HEADER] for r in answered}
    assert classify(url, b"not an image").status_code == 400  # a rejection of its own: the counter has a series
    ours = {"ray_vitserve_request_duration_seconds_bucket", "ray_vitserve_inference_seconds_count",
            "ray_vitserve_queue_wait_seconds_sum", "ray_vitserve_requests_rejected_total", "ray_vitserve_ready",
            "ray_vitserve_model_info", "ray_vitserve_batches_total"}
    found: dict = {}

    def exported() -> bool:
        # Ray exports each replica's series on its own schedule: wait for all of them, not only the first ones
        found.clear()
        found.update(samples(httpx.get(metrics_url, timeout=10).text))
        per_replica = {dict(labels).get("replica") for (name, labels) in found if name == "ray_vitserve_images_total"}
        return replicas <= per_replica and ours <= {name for name, _ in found}

    wait_until(exported, "both replicas' vitserve_images_total and every series of ours in Ray's metrics export", 60)
    ready = {dict(labels)["replica"]: v for (name, labels), v in found.items() if name == "ray_vitserve_ready"}
    assert set(ready.values()) == {1.0} and len(ready) >= REPLICAS
    # the labels are ours, with Ray's deployment and replica tags beside them
    endpoints = {dict(labels).get("endpoint") for (name, labels) in found
                 if name == "ray_vitserve_request_duration_seconds_count"}
    assert "/v1/classify" in endpoints
    assert all(dict(labels).get("deployment") == "vitserve" for (name, labels) in found
               if name == "ray_vitserve_images_total")


@needs_promtool
@pytest.mark.slow
def test_prometheus_scrapes_rays_export_into_our_names_with_the_shipped_job(ray_cluster, tmp_path):
    """deploy/ray/prometheus.yml's job, its service discovery swapped for this cluster's agent: a real Prometheus
    sees vitserve_* per replica, and the shipped recording rules evaluate on them."""
    url, metrics_url, _ = ray_cluster
    job = yaml.safe_load((REPO / "deploy/ray/prometheus.yml").read_text())["scrape_configs"][0]
    del job["file_sd_configs"]
    job.update(scrape_interval="1s", static_configs=[{"targets": [metrics_url.split("/")[2]]}])
    config = {"global": {"evaluation_interval": "1s"}, "scrape_configs": [job],
              "rule_files": [str(p) for p in RULE_FILES]}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: classify(url, image_bytes("PNG")), range(32)))
    with running_prometheus(config, tmp_path) as prometheus:
        def scraped(promql: str) -> list[dict]:
            return api_get(prometheus, "/api/v1/query", query=promql)["data"]["result"]

        wait_until(lambda: len(scraped("vitserve_images_total")) >= REPLICAS, "vitserve_images_total per replica "
                   "in Prometheus", 60)
        assert not scraped("{__name__=~'ray_vitserve_.*'}")  # every one renamed
        assert {r["metric"]["replica"] for r in scraped("vitserve_ready == 1")} >= set(
            r["metric"]["replica"] for r in scraped("vitserve_images_total"))
        wait_until(lambda: bool(scraped("vitserve:images:rate5m")), "the recording rule over Ray's series", 60)


@pytest.mark.slow
def test_a_replica_killed_under_load_is_replaced_and_no_request_hangs(ray_cluster):
    url, _, process = ray_cluster
    victims = replica_pids(process.pid)
    assert len(victims) == REPLICAS
    image = image_bytes("PNG")
    stop_at = time.monotonic() + 8.0
    outcomes: list[tuple[int | str, str | None]] = []

    def load() -> None:
        with httpx.Client(timeout=30) as client:  # a hung request would raise ReadTimeout here
            while time.monotonic() < stop_at:
                response = classify(url, image, client)
                outcomes.append((response.status_code, response.headers.get(REPLICA_HEADER)))

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        senders = [pool.submit(load) for _ in range(6)]
        time.sleep(3.0)
        _kill(victims[0])  # as the kernel's OOM killer would
        for sender in senders:
            sender.result()  # re-raises a client timeout: a request that hung
    statuses = Counter(status for status, _ in outcomes)
    assert statuses[200] > 0 and set(statuses) <= {200, 500, 503}, statuses
    # Ray starts a new replica in its place; both serve again
    wait_until(lambda: len(set(replica_pids(process.pid)) - {victims[0]}) == REPLICAS,
               "a new replica in the killed one's place", RAY_PATIENCE_S)
    wait_until(lambda: httpx.get(f"{url}/v2/health/ready", timeout=10).status_code == 200, "ready again", 60)
    answered_by: set[str] = set()

    def both_serve() -> bool:
        # Ray's router learns of the new replica a moment after it is up (seconds on a loaded machine): every
        # answer must be a 200 meanwhile, and within the patience both replicas must answer.
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            after = list(pool.map(lambda _: classify(url, image), range(64)))
        assert [r.status_code for r in after] == [200] * 64
        answered_by.update(r.headers[REPLICA_HEADER] for r in after)
        return len(answered_by) == REPLICAS  # the killed replica answers no more: two ids are the two live ones

    wait_until(both_serve, "both replicas answering", RAY_PATIENCE_S)


@pytest.mark.slow
def test_sigterm_takes_the_application_and_the_local_cluster_down(ray_cluster):
    _, _, process = ray_cluster
    below = descendants(process.pid)
    assert len(below) >= 4  # GCS, raylet, the agents, the controller, the proxy, the replicas
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0

    def all_gone() -> bool:
        return not [pid for pid in below if Path(f"/proc/{pid}").exists()
                    and "zombie" not in Path(f"/proc/{pid}/status").read_text()]

    wait_until(all_gone, "every Ray process of the server gone", 30)


@pytest.mark.slow
def test_multiplexed_replicas_load_the_model_a_request_names_and_hold_at_most_n(tiny_onnx, tmp_path):
    """Ray's model multiplexing (--ray-models-per-replica 1) over a repository of three models: each request's
    model is loaded by the replica it reaches, a replica holds one at a time (the least recently used unloaded),
    the answers name the model asked for, and the repository's load API is refused."""
    import shutil
    root = tmp_path / "repo"
    for name in ("a", "b", "c"):
        (root / name / "1").mkdir(parents=True)
        shutil.copyfile(tiny_onnx, root / name / "1" / "model.onnx")
    with ray_server(root, tmp_path / "server.log", "--ray-models-per-replica", "1") as (url, _, _):
        png = image_bytes("PNG")
        for name in ("a", "b", "c", "a", "c"):
            header = {"serve_multiplexed_model_id": name}
            reply = httpx.post(f"{url}/v1/classify", params={"model": name}, headers=header,
                               files={"file": ("a.png", png, "image/png")}, timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"]["name"] == name
            index = httpx.post(f"{url}/v2/repository/index", headers=header, timeout=30).json()
            ready = {entry["name"] for entry in index if entry.get("state") == "READY"}
            assert ready == {name}, index  # the replica that answered holds this model and no other
        refused = httpx.post(f"{url}/v2/repository/models/a/load", timeout=30)
        assert refused.status_code == 403 and "multiplexing" in refused.json()["error"]
        unknown = httpx.post(f"{url}/v2/models/nope/infer", json={"inputs": []}, timeout=30)
        assert unknown.status_code == 404 and "nope" in unknown.json()["error"]
        hostile = httpx.post(f"{url}/v1/classify", params={"model": "../a"}, files={"file": ("a.png", png)},
                             timeout=30)
        assert hostile.status_code in (400, 404, 422) and "error" in hostile.json()
