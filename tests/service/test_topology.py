"""`--engine auto`: a light model on the CPU served from one file gets a session of one thread in each HTTP worker,
decided from the file's plan without a session; a repository, a GPU or a heavy model gets the engine process."""
from __future__ import annotations

import os

import numpy as np
import pytest

from vitserve.service.engine import topology
from vitserve.service.engine.inference_model import intra_op_threads
from vitserve.service.engine.runtime import load_model
from vitserve.service.ground.processes import usable_cores
from vitserve.service.ground.settings import Settings
from service_fixtures import settings_for


def auto(model_path, **overrides) -> Settings:
    return settings_for(model_path, **{"engine": "auto", "intra_op_threads": 0, **overrides})


def _no_session(*args, **kwargs):
    raise AssertionError("a session was made to decide what needs none")


@pytest.fixture
def sessionless(monkeypatch):
    """The choice reads the file and its plan: no runtime makes a session for it."""
    from vitserve.service.engine import onnx_runtime, openvino_runtime
    monkeypatch.setattr(onnx_runtime.OnnxModel, "load", _no_session)
    monkeypatch.setattr(openvino_runtime, "openvino_model", _no_session)


def test_an_engine_named_by_the_user_is_kept(tiny_onnx):
    assert topology.engine_choice(auto(tiny_onnx, engine="process")) is None
    assert topology.engine_choice(auto(tiny_onnx, engine="inline")) is None
    assert Settings().engine == "auto"


def test_a_light_model_on_the_cpu_runs_in_every_worker_on_one_thread_decided_without_a_session(tiny_onnx,
                                                                                              sessionless):
    choice = topology.engine_choice(auto(tiny_onnx, runtime="auto", maps_free="auto"))
    assert choice is not None and choice.engine == "inline" and "light model" in choice.why
    assert choice.pinned == {"INTRA_OP_THREADS": "1", "WORKERS": str(usable_cores())}


def test_every_worker_loads_the_same_plan_and_answers_with_the_same_bits(tiny_onnx):
    choice = topology.engine_choice(auto(tiny_onnx, runtime="auto", maps_free="auto"))
    assert choice is not None
    worker = Settings(**{**auto(tiny_onnx, runtime="auto", maps_free="auto").model_dump(),
                         **{k.lower(): v for k, v in choice.environment.items()}})
    assert (worker.engine, worker.http_workers, intra_op_threads(worker)) == ("inline", usable_cores(), 1)
    first, second = load_model(worker), load_model(worker)
    assert first.capabilities.plan == second.capabilities.plan
    pixels = np.random.default_rng(0).normal(size=(3, first.info.channels, *first.info.image_size))
    pixels = pixels.astype(np.float32)
    for a, b in zip(first.run(pixels), second.run(pixels)):
        assert np.array_equal(a, b)  # two workers' answers to the same image: the same bits


def test_what_the_user_set_is_not_pinned_over(tiny_onnx):
    choice = topology.engine_choice(auto(tiny_onnx, runtime="onnxruntime", maps_free="off", workers=3))
    assert choice is not None and choice.engine == "inline"
    assert choice.pinned == {"INTRA_OP_THREADS": "1", "WORKERS": "3"}


def test_a_thread_count_set_for_one_shared_session_keeps_the_engine_process(tiny_onnx, sessionless):
    # the Kubernetes overlays set the threads and the workers to the CPU limit: in each worker that would be
    # workers x threads on the cores
    choice = topology.engine_choice(auto(tiny_onnx, intra_op_threads=4, workers=4))
    assert choice is not None and (choice.engine, choice.pinned) == ("process", {})
    assert "intra-op-threads 4" in choice.why


def test_a_heavy_model_keeps_the_engine_process(tiny_onnx, monkeypatch, sessionless):
    from vitserve.service.engine import serving_plan
    monkeypatch.setattr(serving_plan, "LIGHT_MODEL_MULTIPLY_ADDS", 1.0)  # every model heavy
    choice = topology.engine_choice(auto(tiny_onnx, runtime="auto"))
    assert choice is not None and (choice.engine, choice.pinned) == ("process", {})
    assert "heavy model (" in choice.why and "multiply-adds" in choice.why


def test_a_repository_or_a_gpu_keeps_the_engine_process_without_loading_the_model(tiny_onnx, tmp_path, monkeypatch,
                                                                                  sessionless):
    repository = tmp_path / "repository"
    (repository / "m" / "1").mkdir(parents=True)
    (repository / "m" / "1" / "model.onnx").write_bytes(tiny_onnx.read_bytes())
    choice = topology.engine_choice(auto(tiny_onnx, model_repository=repository))
    assert choice is not None and (choice.engine, choice.pinned) == ("process", {})
    monkeypatch.setattr(topology, "available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    choice = topology.engine_choice(auto(tiny_onnx, providers=["cuda", "cpu"]))
    assert choice is not None and choice.engine == "process" and "GPU" in choice.why
    # the CPU named alone: the GPU build's CUDA is not used, and the light model runs in the workers
    choice = topology.engine_choice(auto(tiny_onnx, providers=["cpu"]))
    assert choice is not None and choice.engine == "inline"


def test_serve_starts_the_default_model_in_every_worker(tiny_onnx, private_environ, monkeypatch):
    import uvicorn

    from vitserve.cli import main
    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.append(
        (kwargs, Settings(), os.path.isdir(os.environ["PROMETHEUS_MULTIPROC_DIR"]))))
    assert main(["serve", "--model", str(tiny_onnx), "--port", "9127", "--grpc-port", "0", "--runtime",
                 "onnxruntime"]) == 0
    kwargs, settings, metrics_dir_made = calls[0]
    assert settings.engine == "inline" and not settings.engine_addresses  # no engine process started
    assert kwargs["workers"] == settings.http_workers == usable_cores()
    assert intra_op_threads(settings) == 1 and settings.maps_free == "auto"  # each worker reads the same plan
    assert metrics_dir_made == (usable_cores() > 1)


def test_a_file_that_fails_to_load_stops_serve_before_any_worker_starts(tiny_onnx, tmp_path, private_environ,
                                                                        monkeypatch, caplog):
    import onnx
    import uvicorn

    from vitserve.cli import main
    broken = onnx.load(str(tiny_onnx))
    broken.graph.node[0].op_type = "NoSuchOperator"  # the header reads; the graph does not load
    path = tmp_path / "broken.onnx"
    onnx.save(broken, str(path))
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: pytest.fail("a worker started"))
    assert main(["serve", "--model", str(path), "--port", "9128", "--grpc-port", "0"]) == 1
    assert "cannot start" in caplog.text and "NoSuchOperator" in caplog.text


@pytest.mark.anyio
async def test_a_worker_with_its_own_model_takes_no_connection_before_it_is_warmed_up(tiny_onnx, tiny_model):
    # uvicorn listens once the lifespan has started: a worker still warming up would answer 503 where the others,
    # ready, answer, after a readiness probe that reached one of them
    import asyncio

    from vitserve.service.app import create_app
    from service_fixtures import PATIENCE_S, WrappedModel, until

    for engine, waits in (("inline", True), ("process", False)):
        model = WrappedModel(tiny_model)
        model.hold()  # the warm-up's calls wait here
        app = create_app(settings_for(tiny_onnx, engine=engine, grpc_port=0), model=model, serve_grpc=True)
        started = asyncio.Event()

        async def lifespan():
            async with app.router.lifespan_context(app):
                started.set()
                await until(lambda: app.state.service.ready, "warmed up")
        running = asyncio.create_task(lifespan())
        await until(lambda: model.entered, "the warm-up in the model")
        await asyncio.sleep(0.2)
        assert started.is_set() is not waits and not app.state.service.ready
        model.release()
        await asyncio.wait_for(running, PATIENCE_S)
        assert started.is_set()
