"""Latency percentiles, CPU accounting, and the machine facts (vitserve/machine.py) they are built on."""
from __future__ import annotations

import math
import os
import re
import time

import pytest

from vitserve.bench.measure import CpuSnapshot, latency_summary
from vitserve.machine import cpu_model_name, load_average, machine_busy_seconds, process_cpu_seconds


def test_latency_summary_in_milliseconds():
    s = latency_summary([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert s["p50_ms"] == pytest.approx(50.5) and s["p90_ms"] == pytest.approx(90.1)
    assert s["p99_ms"] == pytest.approx(99.01) and s["mean_ms"] == pytest.approx(50.5)
    assert all(math.isnan(v) for v in latency_summary([]).values())


def test_cpu_usage_splits_the_machine_into_server_client_and_other():
    before = CpuSnapshot(wall=10.0, server=1.0, client=2.0, machine=100.0)
    after = CpuSnapshot(wall=12.0, server=2.5, client=2.5, machine=103.0)  # 2 s: 1.5 + 0.5 of 3 busy seconds
    assert before.usage(after) == {"server_cores": 0.75, "client_cores": 0.25, "other_cores": 0.5}
    # a machine counter that lags the per-process ones never reports negative other work
    assert before.usage(CpuSnapshot(12.0, 2.5, 2.5, 101.0))["other_cores"] == 0.0


def test_process_cpu_seconds_agrees_with_the_interpreter():
    end = time.process_time() + 0.2
    while time.process_time() < end:  # burn some CPU so that both clocks have something to count
        pass
    own, reference = process_cpu_seconds(os.getpid()), time.process_time()
    assert own == pytest.approx(reference, abs=0.1)  # /proc counts in clock ticks (10 ms)
    assert machine_busy_seconds() >= own
    assert process_cpu_seconds(None) == 0.0
    assert process_cpu_seconds(2**22 + 1) == 0.0  # beyond the largest pid_max: no such process


def test_machine_facts_from_proc_files(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n\n"
                       "processor\t: 1\nmodel name\t: AMD EPYC 7B13\n")
    assert cpu_model_name(cpuinfo) == "AMD EPYC 7B13"
    assert cpu_model_name(tmp_path / "absent") == "unknown CPU"
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal: all but idle and iowait are busy
    stat.write_text("cpu  100 20 30 5000 70 4 6 10 0 0\ncpu0 50 10 15 2500 35 2 3 5 0 0\n")
    assert machine_busy_seconds(stat) == pytest.approx(170 / os.sysconf("SC_CLK_TCK"))
    assert machine_busy_seconds(tmp_path / "absent") == 0.0
    assert re.fullmatch(r"\d+\.\d\d / \d+\.\d\d / \d+\.\d\d", load_average())
