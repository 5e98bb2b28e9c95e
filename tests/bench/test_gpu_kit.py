"""The GPU kit (bench/gpu.py) on a machine without a GPU: it exports, verifies and measures what it can, says what it
skipped and why, and writes its report; on a GPU the same code runs the CUDA steps."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from vitserve.bench.gpu import CPU, CUDA, main

pytest.importorskip("onnxruntime")


@pytest.mark.slow
def test_without_a_gpu_the_kit_checks_itself_and_says_what_it_skipped(tiny_checkpoint, tiny_onnx, tmp_path):
    import onnxruntime as ort
    if CUDA in ort.get_available_providers():
        pytest.skip("this machine has the CUDA provider: the kit's real run is `make bench-gpu`")
    from vitserve.export.onnx_export import export_onnx

    out, work = tmp_path / "gpu.md", tmp_path / "work"
    # the kit makes each file once, and uses a file already in its folder: the session's fp32 export stands in for
    # one, and the fp16 file is made here from the session's traces (half a minute each less than the kit's
    # `vitserve export` in a child process, whose failure the test below covers)
    work.mkdir()
    shutil.copy(tiny_onnx, work / "default-fp32.onnx")
    export_onnx(tiny_checkpoint, work / "default-fp16.onnx", precision="fp16", verify=False)
    code = main(["--checkpoint", str(tiny_checkpoint), "--work", str(work), "--out", str(out),
                 "--duration-s", "0.3", "--no-install"])
    steps = {s["name"]: s for s in json.loads(out.with_suffix(".json").read_text())["steps"]}
    assert code == 0, {n: s["detail"] for n, s in steps.items() if s["status"] == "failed"}
    assert steps["vit-s16: every step"]["status"] == "skipped" and steps["vit-b16: every step"]["status"] == "skipped"
    for precision in ("fp32", "fp16"):
        assert steps[f"default {precision}: export"]["status"] == "ran"
        verified = steps[f"default {precision}: verify on {CPU}"]["result"]
        assert verified["top1_agreement"] == 1.0 and verified["max_rollout_diff"] < 1e-2
    measured = steps[f"default fp32: raw and served on {CPU}"]["result"]
    assert [r["batch_size"] for r in measured["raw"]] == [1, 8] and all(r["images_per_s"] > 0 for r in measured["raw"])
    assert {r["concurrency"] for r in measured["served"]} == {1, 8}
    assert steps["default fp32: TensorRT"]["status"] == "skipped"
    assert "skipped" in out.read_text() and "no GPU" in out.read_text()


@pytest.mark.slow
def test_the_kit_exports_in_a_child_process_and_says_why_it_failed(tiny_checkpoint, tmp_path):
    """The kit's own export: `vitserve export` in a child process (on a GPU machine, torch stays out of the process
    that measures), written under a temporary name so that a failed export never leaves a file the kit would reuse.
    (Its success is `vitserve export`'s, tested in tests/export; this one fails fast.)"""
    from vitserve.bench.gpu import export_file

    with pytest.raises(RuntimeError, match=r"vitserve\.cli export .* exited 1: .*no-such-checkpoint"):
        export_file("default", "fp16", tmp_path / "work", tmp_path / "no-such-checkpoint")
    assert not list((tmp_path / "work").iterdir())
    made = tmp_path / "work" / "default-fp32.onnx"
    made.write_bytes(b"made earlier")
    assert export_file("default", "fp32", tmp_path / "work", tmp_path / "no-such-checkpoint") == made  # made once


@pytest.mark.slow
def test_a_preset_is_exported_with_its_overrides_and_without_the_relevance_path_the_kit_does_not_use(tmp_path):
    pytest.importorskip("torch")
    from vitserve.bench.gpu import export_file
    from vitserve.onnx_header import read_model_info

    made = export_file("vit-fmnist-random", "fp32", tmp_path, overrides="depth=1", fast_only=True)
    assert made.name == "vit-fmnist-random-depth1-fast-fp32.onnx"
    info = read_model_info(made)
    assert int(info.architecture["depth"]) == 1 and not info.explains_classes


def test_a_provider_counts_only_when_a_session_really_starts_on_it():
    """onnxruntime-gpu lists CUDA and TensorRT on a machine without their libraries or a GPU and then runs on the CPU
    with a warning: the kit probes with a one-node session, so that its CPU run is not taken for a GPU run."""
    import onnxruntime as ort

    from vitserve.bench.gpu import TENSORRT, environment, loads
    assert loads(CPU)
    env = environment()
    assert env["built_in"] == ort.get_available_providers()
    assert CPU in env["providers"] and set(env["providers"]) <= set(env["built_in"])
    if not env["gpus"]:  # no GPU: nothing but the CPU may count, whatever the build lists
        assert not loads(CUDA) and not loads(TENSORRT) and not {CUDA, TENSORRT} & set(env["providers"])


def test_onnxruntime_gpu_installs_from_a_folder_of_wheels_on_a_machine_without_a_network(tmp_path):
    from vitserve.bench.gpu import pip_install
    python = tmp_path / "bin" / "python"
    assert pip_install(python, "") == [str(python), "-m", "pip", "install", "--quiet", "onnxruntime-gpu"]
    offline = pip_install(python, "/mnt/wheels")
    assert offline[-1] == "onnxruntime-gpu" and offline[offline.index("--find-links") + 1] == "/mnt/wheels"
    assert "--no-index" in offline  # nothing fetched from PyPI


def test_served_variants_name_each_settings_overlay_and_refuse_what_is_not_a_setting():
    from vitserve.bench.gpu import main, served_variants

    assert served_variants("") == [("", {})]
    assert served_variants("kit:; greedy:VITSERVE_DISPATCH_WHEN_IDLE=false,VITSERVE_MAX_QUEUE_DELAY_MS=0") == [
        ("kit", {}), ("greedy", {"VITSERVE_DISPATCH_WHEN_IDLE": "false", "VITSERVE_MAX_QUEUE_DELAY_MS": "0"})]
    for wrong in ("x:PATH=/tmp", "x:VITSERVE_MAX_BATCH_SIZE", ":VITSERVE_MAX_BATCH_SIZE=8"):
        with pytest.raises(ValueError):
            served_variants(wrong)
    from vitserve.bench.gpu import served_schedule

    assert [(r, name) for r, name, _ in served_schedule("a:;b:VITSERVE_X=1", 3)] == [
        (1, "a"), (1, "b"), (2, "b"), (2, "a"), (3, "a"), (3, "b")]
    with pytest.raises(SystemExit) as exit_:  # before any export starts
        main(["--served-variants", "x:PATH=/tmp"])
    assert exit_.value.code == 2
    with pytest.raises(SystemExit) as exit_:
        main(["--served-rounds", "0"])
    assert exit_.value.code == 2


def test_a_served_level_reports_the_servers_own_account_of_its_batches():
    from vitserve.bench.servers import server_stages

    before = {"vitserve_batches_total": 10, "vitserve_images_total": 100, "vitserve_batch_seconds_total": 1.0,
              "vitserve_queue_wait_seconds_sum": 0.5, "vitserve_queue_wait_seconds_count": 100}
    after = {"vitserve_batches_total": 30, "vitserve_images_total": 1380, "vitserve_batch_seconds_total": 1.5,
             "vitserve_batch_stack_seconds_total": 0.04, "vitserve_queue_wait_seconds_sum": 3.06,
             "vitserve_queue_wait_seconds_count": 1380}
    assert server_stages(before, after, 2.0) == {"mean_batch": 64.0, "runner_busy": 0.25, "call_ms": 25.0,
                                                 "stack_ms": 2.0, "queue_wait_ms": 2.0}
    assert server_stages(after, after, 2.0) == {}  # no batch ran: nothing to say


@pytest.mark.parametrize("override,why", [("depth=two", "FIELD=INTEGER"), ("depht=2", "unexpected keyword")])
def test_a_mistyped_preset_override_is_a_one_line_error(override, why, tmp_path, capsys):
    pytest.importorskip("torch")
    from vitserve.export.presets import main

    with pytest.raises(SystemExit) as exit_:
        main(["vit-fmnist-random", str(tmp_path / "x.onnx"), "--override", override])
    assert exit_.value.code == 2 and why in capsys.readouterr().err
    assert not (tmp_path / "x.onnx").exists()


def test_the_first_calls_step_times_each_graph_padded_and_not_at_sizes_the_load_did_not_run(tiny_onnx):
    """It runs on the CPU as on a GPU (where the padding applies): three calls per graph, per size, per model."""
    from vitserve.bench.gpu import first_calls

    result = first_calls(tiny_onnx, sizes=(3,), largest=4)
    assert set(result["warmed_up"]) == {"step 0", "step 8"}
    assert all(text.startswith("[1, 4] in ") for text in result["warmed_up"].values())
    (row,) = result["rows"]
    timed = {key: value for key, value in row.items() if key != "batch_size"}
    assert row["batch_size"] == 3 and {"rollout_step0_ms", "rollout_step8_ms"} <= set(timed)
    assert all(len(value.split(" / ")) == 3 for value in timed.values())


def test_a_mistyped_gpu_step_is_a_one_line_error_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--gpu-steps", "graphs,first-call"])
    assert exit_.value.code == 2
    assert "--gpu-steps: no step first-call (the steps: graphs, fused, first-calls, served)" in capsys.readouterr().err


def test_a_served_level_says_how_its_clients_and_cpu_fell_on_the_http_workers():
    """The connections are counted from the kernel's table for each process (here this one, holding both ends);
    the cores from each process's CPU over the level."""
    import socket

    from vitserve.bench.gpu_served import CpuSnapshot, connections_on, worker_split

    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        accepted = [listener.accept()[0] for _ in clients]
        try:
            # the clients' ends are on ephemeral ports: only the accepted ends count, and a pid without any is left out
            assert connections_on([os.getpid(), 2 ** 22 + 1], port) == {os.getpid(): 3}
        finally:
            for s in clients + accepted:
                s.close()
    # 10 the engine, 11 and 12 the workers, 13 gone by the end: its zero counts for nothing
    before = CpuSnapshot({10: 1.0, 11: 2.0, 12: 5.0, 13: 3.0}, {10: 0.5, 11: 1.0, 12: 4.0, 13: 1.0})
    after = CpuSnapshot({10: 2.5, 11: 3.6, 12: 7.0, 13: 0.0}, {10: 1.7, 11: 1.2, 12: 5.8, 13: 0.0})
    assert worker_split(before, after, {11: 24, 12: 8}, 2.0) == {
        "worker_clients": "24/8", "busiest_worker_cores": 1.0, "busiest_worker_loop_cores": 0.9,
        "other_cores": 0.75, "busiest_other_loop_cores": 0.6}
    assert worker_split(before, after, {}, 2.0) == {}  # no worker held a client: nothing to say


def test_a_cpu_snapshot_reads_a_process_and_its_main_thread_apart():
    """A thread of this process spins for 0.2 s of its own CPU while the main thread waits for it: the process's
    seconds grow by that, the main thread's (where an HTTP worker's or the engine's event loop runs) do not."""
    import threading
    import time

    from vitserve.bench.gpu_served import cpu_snapshot

    def spin() -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.2:
            pass

    pid = os.getpid()
    before = cpu_snapshot([pid])
    spinner = threading.Thread(target=spin)
    spinner.start()
    spinner.join()
    after = cpu_snapshot([pid])
    assert after.process_s[pid] - before.process_s[pid] >= 0.15  # /proc counts in clock ticks (10 ms)
    assert after.loop_s[pid] - before.loop_s[pid] < 0.1
