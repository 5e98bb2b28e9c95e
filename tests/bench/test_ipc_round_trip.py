"""The IPC round-trip bench (bench/ipc_round_trip.py) measures both transports between two real processes."""
from __future__ import annotations

import argparse
import asyncio

from vitserve.bench import ipc_round_trip


def test_both_transports_echo_between_processes_and_the_report_has_a_row_per_transport_and_gap(tmp_path):
    args = argparse.Namespace(rounds=2, count=20, gaps_ms=[0.0, 1.0])
    results = asyncio.run(ipc_round_trip._run(args, tmp_path))
    assert set(results) == {"ZeroMQ (pyzmq asyncio, ipc)", "asyncio Unix stream"}
    for by_gap in results.values():
        assert {gap: len(values) for gap, values in by_gap.items()} == {"0.0": 40, "1.0": 40}
        assert all(value > 0 for values in by_gap.values() for value in values)
    text = ipc_round_trip.markdown(results, args, "python -m vitserve.bench.ipc_round_trip", "m")
    assert text.count("\n| ") == 1 + 4  # the header, then one row per transport and gap
    assert "| asyncio Unix stream | 1.0 ms |" in text


def test_bad_flags_are_one_line_errors(capsys):
    import pytest

    for flags, message in ((["--gaps-ms", "x"], "expected milliseconds"), (["--gaps-ms", "nan"], "from 0 to 1000 ms"),
                           (["--count", "0"], "at least 1, got 0"), (["--rounds", "two"], "expected an integer")):
        with pytest.raises(SystemExit):
            ipc_round_trip.main(flags)
        assert message in capsys.readouterr().err
