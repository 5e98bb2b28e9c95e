"""The ONNX Runtime layer (load errors, providers, session), Settings, and the `serve` flags that map onto them."""
from __future__ import annotations

import os
from typing import get_args

import numpy as np
import onnx
import pytest

from vitserve.service.cli import DRAIN_MARGIN_S
from vitserve.service.ground.errors import ModelLoadError
from vitserve.service.engine.providers import GPU_PROVIDERS, ORT_PROVIDERS, openvino_provider, runs_on_cpu
from vitserve.service.engine.onnx_runtime import OnnxModel, provider_chain, session_options
from vitserve.service.engine.inference_model import intra_op_threads
from vitserve.service.engine.runtime import load_engine_model, warm_up
from vitserve.service.ground.settings import INTERNAL, Provider, Settings
from service_fixtures import settings_for

def test_load_errors_are_clear(tmp_path, tiny_onnx):
    foreign = onnx.load(str(tiny_onnx))
    del foreign.metadata_props[:]
    onnx.save(foreign, str(tmp_path / "foreign.onnx"))
    (tmp_path / "garbage.onnx").write_bytes(b"\x0a\xff\xff\xff\x0f" + b"x" * 10)
    for name, message in (("missing.onnx", "not found"), ("garbage.onnx", "not an ONNX model"),
                          ("foreign.onnx", "was it exported by `vitserve export`")):
        with pytest.raises(ModelLoadError, match=message):
            OnnxModel.load(settings_for(tmp_path / name))


def test_provider_chain_prefers_accelerators_and_falls_back_to_cpu():
    settings = Settings(providers="tensorrt,cuda,cpu", cuda_device_id=1, cuda_mem_limit_bytes=2**30,
                        cudnn_conv_algo_search="EXHAUSTIVE", tensorrt_fp16=True, tensorrt_cache_dir="/tmp/trt")
    everything = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    chain = provider_chain(settings, everything)
    assert [name for name, _ in chain] == everything
    trt, cuda, cpu = (options for _, options in chain)
    assert cuda == {"device_id": 1, "cudnn_conv_algo_search": "EXHAUSTIVE", "arena_extend_strategy": "kNextPowerOfTwo",
                    "do_copy_in_default_stream": True, "gpu_mem_limit": 2**30}
    assert trt == {"device_id": 1, "trt_fp16_enable": True, "trt_engine_cache_enable": True,
                   "trt_engine_cache_path": "/tmp/trt"}
    assert cpu == {}
    assert provider_chain(Settings(providers="cuda"), ["CPUExecutionProvider"]) == [("CPUExecutionProvider", {})]


def test_the_provider_table_names_every_provider_a_setting_can_choose():
    assert set(ORT_PROVIDERS) == set(get_args(Provider))
    assert set(GPU_PROVIDERS) == {"CUDAExecutionProvider", "TensorrtExecutionProvider"}
    assert openvino_provider("bf16") == "OpenVINO/CPU/bf16"
    assert runs_on_cpu("CPUExecutionProvider") and runs_on_cpu("OpenVINO/CPU/fp32")
    assert not any(runs_on_cpu(name) for name in GPU_PROVIDERS)


def test_session_options_follow_settings():
    options = session_options(Settings(intra_op_threads=3, inter_op_threads=2, intra_op_spinning=False))
    assert options.intra_op_num_threads == 3 and options.inter_op_num_threads == 2
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert intra_op_threads(Settings()) == 0  # ORT's default: every core for the one engine process
    assert intra_op_threads(Settings(workers=2)) == 0  # however many HTTP workers feed it
    # inline engines, one per worker: the cores shared out, no oversubscription
    assert intra_op_threads(Settings(engine="inline", workers=2)) == max(1, len(os.sched_getaffinity(0)) // 2)


def test_cores_are_the_ones_this_process_may_run_on(monkeypatch):
    # a server under `taskset -c 0-3` (or a container's cpuset) on a 16-core machine sizes itself for 4 cores
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert Settings().http_workers == 4
    assert intra_op_threads(Settings(engine="inline", workers=2)) == 2
    # batches run at once share their process's threads: the engine's cores, or an inline worker's share of them
    assert intra_op_threads(Settings(batch_runners=2)) == 2
    assert intra_op_threads(Settings(engine="inline", workers=2, batch_runners=2)) == 1
    assert intra_op_threads(Settings(batch_runners=3, intra_op_threads=4)) == 4  # a count set is the count
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert Settings().http_workers == 1 and intra_op_threads(Settings(engine="inline", workers=2)) == 1


def test_a_wide_copy_only_where_the_runners_share_the_cores_out_on_the_cpu(monkeypatch):
    from vitserve.service.engine.inference_model import wide_settings

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    wide = wide_settings(Settings(batch_runners=2), on_cpu=True)
    assert wide is not None and wide.batch_runners == 1 and intra_op_threads(wide) == 0  # every core's thread
    assert wide_settings(Settings(), on_cpu=True) is None  # one runner has them already
    assert wide_settings(Settings(batch_runners=2, intra_op_threads=1), on_cpu=True) is None  # a count set
    assert wide_settings(Settings(batch_runners=2), on_cpu=False) is None  # a GPU
    # inline workers, each with its own session: a worker's share of the cores, wider than a runner's
    assert wide_settings(Settings(engine="inline", workers=2, batch_runners=2), on_cpu=True) is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    inline = wide_settings(Settings(engine="inline", workers=2, batch_runners=2), on_cpu=True)
    assert inline is not None and intra_op_threads(inline) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert wide_settings(Settings(batch_runners=2), on_cpu=True) is None  # one core: nothing wider


def test_model_runs_at_several_resolutions(tiny_model):
    warm_up(tiny_model, [1, 2])
    for batch, height, width in ((1, 32, 32), (3, 16, 48), (2, 40, 24)):
        logits, rollout, *_ = tiny_model.run(np.zeros((batch, 3, height, width), np.float32))
        assert logits.shape == (batch, 3) and rollout.shape == (batch, height // 8, width // 8)
    assert tiny_model.provider == "CPUExecutionProvider" and tiny_model.info.name == "tiny-vit"


def test_the_io_binding_path_gives_the_plain_calls_results(tiny_model):
    """The path GPU sessions take (an IOBinding), forced on the CPU session: here is where it ran (no GPU)."""
    bound = OnnxModel(tiny_model.session, tiny_model.info, io_binding=True)
    assert not tiny_model.io_binding and bound.io_binding  # the CPU provider binds nothing by default
    pixels = np.random.default_rng(2).normal(size=(3, 3, 16, 24)).astype(np.float32)
    for plain, via_binding in zip(tiny_model.run(pixels), bound.run(pixels)):
        np.testing.assert_array_equal(plain, via_binding)


def test_settings_from_environment(monkeypatch):
    monkeypatch.setenv("VITSERVE_MAX_BATCH_SIZE", "8")
    monkeypatch.setenv("VITSERVE_PROVIDERS", "CUDA, cpu")
    monkeypatch.setenv("VITSERVE_MAX_QUEUE_DELAY_MS", "7.5")
    settings = Settings()
    assert settings.max_batch_size == 8 and settings.providers == ["cuda", "cpu"]
    assert settings.max_queue_delay_s == 0.0075 and settings.warmup_batch_sizes == [1, 8]
    with pytest.raises(ValueError):
        Settings(warmup_batch_sizes="1,9")  # beyond max_batch_size
    with pytest.raises(ValueError):
        Settings(providers="tpu")



def test_every_setting_is_a_serve_flag_and_flags_reach_uvicorn(tiny_onnx, private_environ, monkeypatch):
    import uvicorn

    from vitserve.cli import build_parser, main
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    flags = {a.dest for a in serve._actions}
    internal = {name for name, field in Settings.model_fields.items() if field.description == INTERNAL}
    assert internal == {"engine_addresses"} and set(Settings.model_fields) - internal <= flags
    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.append(
        (app, kwargs, Settings(), os.path.isdir(os.environ["PROMETHEUS_MULTIPROC_DIR"]))))
    assert main(["serve", "--model", str(tiny_onnx), "--engine", "inline", "--port", "9123", "--workers", "2",
                 "--max-batch-size", "7",
                 "--providers", "cuda,cpu", "--tensorrt-fp16", "true", "--drain-timeout-s", "5"]) == 0
    app, kwargs, settings, metrics_dir_made = calls[0]
    assert app == "vitserve.service.app:app_from_env" and kwargs["factory"] is True
    assert (kwargs["port"], kwargs["workers"], kwargs["timeout_graceful_shutdown"]) == (9123, 2, 5 + DRAIN_MARGIN_S)
    assert settings.max_batch_size == 7 and settings.providers == ["cuda", "cpu"] and settings.tensorrt_fp16
    assert metrics_dir_made  # several workers: multiprocess metrics, in a directory made for this run...
    assert not os.path.exists(os.environ["PROMETHEUS_MULTIPROC_DIR"])  # ...and removed when it ends


@pytest.mark.parametrize("content, message", [(None, "model file not found"), (b"", "model file is empty"),
                                              (b"\xff\xfenot protobuf", "is not an ONNX model")])
def test_serve_rejects_missing_or_garbage_model_before_starting(tmp_path, private_environ, capsys, content, message):
    from vitserve.cli import main
    path = tmp_path / "model.onnx"
    if content is not None:
        path.write_bytes(content)
    assert main(["serve", "--model", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_settings_are_grouped_and_help_leads_with_the_common_ones(capsys):
    from vitserve.service.ground.settings import SETTING_GROUPS
    from vitserve.cli import main
    grouped = [name for names in SETTING_GROUPS.values() for name in names]
    internal = {name for name, field in Settings.model_fields.items() if field.description == INTERNAL}
    assert sorted(grouped) == sorted(set(Settings.model_fields) - internal)  # each in exactly one group
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    short = capsys.readouterr().out
    assert "--model-repository" in short and "--max-json-values" not in short and "--help-all" in short
    assert len(short.splitlines()) < 70
    with pytest.raises(SystemExit):
        main(["serve", "--help-all"])
    full = capsys.readouterr().out
    assert all(f"{title} options:" in full for title in SETTING_GROUPS) and "--max-json-values" in full


def test_the_repository_flags_reach_the_settings_and_an_open_repository_api_is_refused(tiny_onnx, tmp_path,
                                                                                        private_environ, capsys):
    from vitserve.cli import main
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.onnx").write_bytes(tiny_onnx.read_bytes())
    def refused(*flags: str) -> str:
        for name in [k for k in os.environ if k.startswith("VITSERVE_")]:  # `serve` writes its flags there
            del os.environ[name]
        assert main(["serve", *flags]) == 2
        return capsys.readouterr().err

    assert "set --admin-key" in refused("--model-repository", str(tmp_path), "--model-control-mode", "explicit",
                                        "--host", "0.0.0.0")
    assert "not a directory" in refused("--model-repository", str(tmp_path / "nope"))
    assert "needs a model_repository" in refused("--model", str(tiny_onnx), "--model-control-mode", "poll")
    assert "load_models is for model_control_mode explicit" in refused("--model-repository", str(tmp_path),
                                                                       "--load-model", "m")
    assert "one replica only" in refused("--model-repository", str(tmp_path), "--model-control-mode", "explicit",
                                         "--ray")
    # each new flag with a wrong type, a value out of range, or nothing: one line saying which and why
    for flags, said in ((("--repository-poll-secs", "abc"), "repository_poll_secs: Input should be a valid number"),
                        (("--repository-poll-secs", "0"), "greater than or equal to 0.1 (got '0')"),
                        (("--model-control-mode", "sometimes"), "'none', 'explicit' or 'poll' (got 'sometimes')"),
                        (("--api-key", ""), "--api-key is empty"), (("--admin-key", " "), "--admin-key is empty"),
                        (("--load-model", ""), "--load-model is empty")):
        error = refused("--model-repository", str(tmp_path), *flags)
        assert said in error and error.count("\n") == 1, error
    for name in [k for k in os.environ if k.startswith("VITSERVE_")]:
        del os.environ[name]
    settings = Settings(model_repository=tmp_path, model_control_mode="explicit", load_models="a, b")
    assert settings.load_models == ["a", "b"] and settings.startup_models == ["a", "b"]
    assert Settings(model_repository=tmp_path, model_control_mode="explicit", load_models="*").startup_models is None


def test_serve_rejects_invalid_flags(tiny_onnx, private_environ, capsys):
    from vitserve.cli import main
    assert main(["serve", "--model", str(tiny_onnx), "--max-batch-size", "0"]) == 2
    assert "max_batch_size" in capsys.readouterr().err


def _listening_socket(free_below: bool = False):
    """A socket listening on a port of the system's choosing (with `free_below`, one whose port - 1 is free)."""
    import socket

    from vitserve.service.cli import port_is_free
    while True:
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        if not free_below or port_is_free("127.0.0.1", taken.getsockname()[1] - 1):
            return taken
        taken.close()


def test_serve_refuses_an_http_port_in_use_in_one_line_before_loading(tiny_onnx, private_environ, capsys,
                                                                       monkeypatch):
    import vitserve.service.cli
    from vitserve.cli import main
    started = []
    monkeypatch.setattr(vitserve.service.cli, "_engines", lambda settings: started.append(settings))
    with _listening_socket() as taken:
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(tiny_onnx), "--port", str(port), "--grpc-port", "0"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (f"vitserve serve: the HTTP port 127.0.0.1:{port} is in use: stop what holds it, or choose "
                     f"another with --port (VITSERVE_PORT; make serve PORT=N)")
    assert started == []  # no engine, no model loaded


def test_the_grpc_port_follows_the_http_port_unless_given():
    from vitserve.service.cli import derive_grpc_port
    cases = [({"VITSERVE_PORT": "8080"}, "8081"),  # two servers on --port 8000 and 8080: gRPC on 8001 and 8081
             ({"VITSERVE_PORT": "8080", "VITSERVE_GRPC_PORT": "9001"}, "9001"),
             ({"VITSERVE_PORT": "8080", "VITSERVE_GRPC_PORT": "0"}, "0"),  # no gRPC stays no gRPC
             ({"VITSERVE_PORT": "8080", "VITSERVE_GRPC_PORT": " "}, "8081"),  # empty means unset (settings.py)
             ({"VITSERVE_PORT": "0"}, None), ({"VITSERVE_PORT": "65535"}, None), ({}, None)]  # None: the default
    for environ, grpc in cases:
        derived = derive_grpc_port(environ)
        assert (environ.get("VITSERVE_GRPC_PORT"), derived) == (grpc, grpc == "8081"), environ


def test_serve_on_another_port_takes_the_next_for_grpc_and_says_which_is_in_use(tiny_onnx, private_environ,
                                                                                 capsys, monkeypatch):
    import uvicorn

    from vitserve.cli import main
    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.append(Settings()))  # what the workers build
    with _listening_socket(free_below=True) as taken:
        grpc = taken.getsockname()[1]
        assert main(["serve", "--model", str(tiny_onnx), "--engine", "inline", "--port", str(grpc - 1)]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (f"vitserve serve: the gRPC port 127.0.0.1:{grpc} (--port + 1) is in use: stop what holds it, "
                     f"or choose another with --grpc-port (VITSERVE_GRPC_PORT; 0: no gRPC)")
    assert main(["serve", "--model", str(tiny_onnx), "--engine", "inline", "--port", str(grpc - 1)]) == 0
    assert (calls[0].port, calls[0].grpc_port) == (grpc - 1, grpc)


def test_serve_ray_without_ray_installed_says_how_to_get_it(tiny_onnx, private_environ, capsys, monkeypatch):
    import sys

    from vitserve.cli import main
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: importing it raises ImportError
    monkeypatch.delitem(sys.modules, "vitserve.service.ray_serve", raising=False)
    assert main(["serve", "--ray", "--model", str(tiny_onnx)]) == 2
    assert "Ray Serve is not installed" in capsys.readouterr().err


def test_serve_ray_hands_the_settings_to_ray_and_refuses_bad_replica_counts(tiny_onnx, private_environ, capsys,
                                                                           monkeypatch):
    pytest.importorskip("ray.serve")
    import vitserve.service.ray_serve
    from vitserve.cli import main
    handed = []
    monkeypatch.setattr(vitserve.service.ray_serve, "run_on_ray", lambda settings: handed.append(settings) or 0)
    assert main(["serve", "--ray", "--model", str(tiny_onnx), "--ray-replicas", "3", "--ray-max-replicas", "5"]) == 0
    assert (handed[0].ray_replicas, handed[0].ray_max_replicas, handed[0].model_path) == (3, 5, tiny_onnx)
    assert "VITSERVE_RAY" not in os.environ  # --ray chooses the command; it is not a setting
    assert main(["serve", "--ray", "--model", str(tiny_onnx), "--ray-replicas", "3", "--ray-max-replicas", "2"]) == 2
    assert "ray_max_replicas 2 is below ray_replicas 3" in capsys.readouterr().err


def test_a_provider_named_but_not_in_this_build_is_a_warning_the_default_is_not(tiny_onnx, caplog):
    """The default providers mean the best this build has: a CPU-only build starts without a word about CUDA."""
    with caplog.at_level("WARNING", logger="vitserve.runtime"):
        model = OnnxModel.load(Settings(model_path=tiny_onnx, providers="cuda,cpu"))
    assert model.provider == "CPUExecutionProvider"  # this build has no CUDA provider
    assert "CUDAExecutionProvider requested but not in this onnxruntime build" in caplog.text
    caplog.clear()
    with caplog.at_level("DEBUG", logger="vitserve.runtime"):
        model = OnnxModel.load(Settings(model_path=tiny_onnx))
    assert model.provider == "CPUExecutionProvider"
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    # the line that says where it runs (the served version's INFO line repeats it under the repository's name)
    assert "on CPUExecutionProvider" in caplog.text


def test_a_provider_in_the_build_that_fails_to_start_is_a_warning(tiny_onnx, caplog):
    class Session:  # what ORT does when CUDA is in the build but cannot start: falls back to the CPU
        def get_providers(self):
            return ["CPUExecutionProvider"]

    from vitserve.service.engine import onnx_runtime as runtime
    chain = [("CUDAExecutionProvider", {}), ("CPUExecutionProvider", {})]
    with caplog.at_level("WARNING", logger="vitserve.runtime"):
        runtime.warn_on_fallback(runtime.OnnxModel(Session(), None), chain)
    assert "CUDAExecutionProvider is in this onnxruntime build but the model runs on CPUExecutionProvider" in \
        caplog.text


def test_an_engine_runs_a_light_model_on_one_thread_and_a_heavy_one_on_every_core(tiny_onnx, monkeypatch):
    from vitserve.service.engine import serving_plan
    ort = {"model_path": tiny_onnx, "providers": ["cpu"], "runtime": "onnxruntime"}
    light = load_engine_model(Settings(**ort))
    assert light.session.get_session_options().intra_op_num_threads == 1  # the tiny model is light
    monkeypatch.setattr(serving_plan, "LIGHT_MODEL_MULTIPLY_ADDS", 1.0)  # every model heavy
    heavy = load_engine_model(Settings(**ort))
    assert heavy.session.get_session_options().intra_op_num_threads == 0  # ORT's default: every core
    chosen = load_engine_model(Settings(**ort, intra_op_threads=2))
    assert chosen.session.get_session_options().intra_op_num_threads == 2  # a count given is kept


@pytest.mark.slow
def test_a_two_worker_start_logs_each_fact_once(tmp_path):
    """What `vitserve serve` says at start, at the default log level, for the shipped int8 file with two workers:
    gRPC named once (in the first line, not once per worker), and the plan named by the file's precision."""
    from service_fixtures import REPO, free_port, uvicorn_server

    grpc_port = free_port()
    with uvicorn_server(REPO / "models/vit-fmnist/model-int8.onnx", "--log-level", "info", "--runtime", "auto",
                        "--grpc-port", str(grpc_port), workers=2) as (_, process):
        pass
    lines = process.stdout.read().decode().splitlines()
    assert sum("gRPC" in line for line in lines) == 1, lines
    assert any(f"gRPC on port {grpc_port}: 2 HTTP worker(s)" in line for line in lines), lines
    from vitserve.service.engine.openvino_runtime import computes_int8
    planned = [line for line in lines if "multiply-adds an image" in line]  # each worker's load, on its plan
    why = "an int8 file on a CPU with int8 dot-product units" if computes_int8() else \
        "the file's own precision (int8) on ONNX Runtime"
    assert planned and all(f"declared: {why}" in line for line in planned), planned
