"""What the reliability modes share: the server's process tree from /proc, servers from other checkouts,
alternated rounds, and the `--mode` flags onto ReliabilityConfig (the default mode untouched)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vitserve.bench.cli import config_from_args, reliability_config_from_args
from vitserve.bench.config import BenchConfig
from vitserve.bench.reliability import (ReliabilityConfig, ServerUnderTest, alternated, parse_cpu_list, process_tree, sample_tree,
                               servers_under_test)
from vitserve.cli import build_parser


def test_the_process_tree_counts_children_memory_and_descriptors():
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, "
                               "'-c', 'import time; time.sleep(60)']); time.sleep(60)"])
    try:
        for _ in range(200):  # the child starts
            if len(process_tree(parent.pid)) == 2:
                break
            time.sleep(0.05)
        tree = process_tree(parent.pid)
        sample = sample_tree(parent.pid)
        assert tree[0] == parent.pid and len(tree) == 2
        assert sample.processes == 2 and sample.rss_mb > 2 and sample.fds >= 6 and sample.threads >= 2
    finally:
        for pid in process_tree(parent.pid)[1:]:  # the child this test started
            os.kill(pid, signal.SIGTERM)
        parent.kill()
        parent.wait()
    assert process_tree(parent.pid) == [] and sample_tree(parent.pid).processes == 0


def test_a_checkout_serves_its_own_code(tmp_path):
    model = tmp_path / "m.onnx"
    here = ServerUnderTest()
    assert here.argv(model, 9000, ["--max-queue-size", "8"]) == [
        sys.executable, "-m", "vitserve.cli", "serve", "--model", str(model), "--host", "127.0.0.1", "--port", "9000",
        "--max-queue-size", "8"]
    assert "PYTHONPATH" not in here.env({}) and here.env({"max_queue_size": "8"}) == {
        "VITSERVE_LOG_LEVEL": "warning", "VITSERVE_GRPC_PORT": "0", "VITSERVE_MAX_QUEUE_SIZE": "8"}
    other = ServerUnderTest(tmp_path)
    assert other.argv(model, 9000, [])[:4] == [sys.executable, "-P", "-m", "vitserve.cli"]  # -P: cwd not first
    assert other.env({})["PYTHONPATH"].split(":")[0] == str(tmp_path.resolve())
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text("")
    assert other.python == str(tmp_path.resolve() / ".venv" / "bin" / "python")
    assert other.slug == "-".join(tmp_path.resolve().parts[1:]) and here.slug == "this-code"


def test_cores_are_given_as_taskset_lists_and_pin_the_server_through_taskset(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    assert parse_cpu_list(str(allowed[0])) == (allowed[0],)
    assert parse_cpu_list(f"{allowed[0]}-{allowed[-1]}") == tuple(range(allowed[0], allowed[-1] + 1))
    for bad in ("x", "", "1-", "-1", "1-0", "0,,1"):
        with pytest.raises(ValueError, match="expected cores like"):
            parse_cpu_list(bad)
    with pytest.raises(ValueError, match="may run on"):  # a core this process cannot use
        parse_cpu_list(str(max(allowed) + 1))
    cfg = ReliabilityConfig(server_cpus=(allowed[0],), log_dir=tmp_path)
    server = ServerUnderTest().start(tmp_path / "m.onnx", 9000, cfg, {}, "pinned")  # not entered: not started
    assert server.argv[:3] == ["taskset", "--cpu-list", str(allowed[0])] and server.argv[3] == sys.executable
    assert reliability_config_from_args(_args("--mode", "overload", "--server-cpus", str(allowed[0]))).server_cpus \
        == (allowed[0],)


def test_servers_under_test_are_this_code_or_up_to_two_checkouts(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        (d / "service").mkdir(parents=True)
    assert servers_under_test(ReliabilityConfig()) == [ServerUnderTest()]
    assert servers_under_test(ReliabilityConfig(checkouts=[a, b])) == [ServerUnderTest(a), ServerUnderTest(b)]
    with pytest.raises(SystemExit, match="at most two"):
        servers_under_test(ReliabilityConfig(checkouts=[a, b, a]))
    with pytest.raises(SystemExit, match="not a vitserve checkout"):
        servers_under_test(ReliabilityConfig(checkouts=[tmp_path]))


def test_rounds_alternate_which_server_goes_first():
    assert alternated(["A", "B"], 3) == [(0, "A"), (0, "B"), (1, "B"), (1, "A"), (2, "A"), (2, "B")]
    assert alternated(["A"], 2) == [(0, "A"), (1, "A")]


def _args(*flags: str):
    return build_parser().parse_args(["bench", *flags])


def test_mode_flags_land_on_reliability_config_and_the_default_mode_is_unchanged():
    cfg = reliability_config_from_args(_args(
        "--mode", "overload", "--checkout", "/tmp/a", "--checkout", "/tmp/b", "--rate", "100", "--rounds", "3",
        "--serve-flags", "--max-queue-size 64", "--saturation-clients", "8,16", "--hol-oip-shape", "4x32x32",
        "--model", "vit-s16", "--out", "/tmp/o.md"))
    assert (cfg.mode, cfg.checkouts, cfg.rate, cfg.rounds) == ("overload", [Path("/tmp/a"), Path("/tmp/b")], 100.0, 3)
    assert (cfg.server_args, cfg.saturation_clients, cfg.hol_oip_shape) == (["--max-queue-size", "64"], [8, 16],
                                                                            (4, 32, 32))
    assert (cfg.model, cfg.report_path) == ("vit-s16", Path("/tmp/o.md"))
    soak = reliability_config_from_args(_args("--mode", "soak"))
    assert soak == ReliabilityConfig(mode="soak") and soak.report_path == Path("build/bench/soak.md")
    assert _args().mode == "throughput" and config_from_args(_args()) == BenchConfig()


def test_flags_of_one_mode_are_refused_in_the_other():
    with pytest.raises(SystemExit, match="does not use concurrency, quick"):
        reliability_config_from_args(_args("--mode", "hol", "--concurrency", "4", "--quick"))
    with pytest.raises(SystemExit, match="checkouts belong to --mode"):
        config_from_args(_args("--checkout", "/tmp/a"))
    with pytest.raises(SystemExit):
        _args("--hol-oip-shape", "32x128")
