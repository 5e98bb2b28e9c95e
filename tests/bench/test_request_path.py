"""bench/request_path.py: one request's way through the service's code, traced on the tiny model. Every transport
(HTTP's infer lane for /v2 and /v1/classify, gRPC's ModelInfer) passes through the call pipeline and the use
cases, and none through another transport's rooms."""
from __future__ import annotations

import pytest

from vitserve.bench import request_path


@pytest.mark.slow
def test_every_transport_enters_the_one_pipeline(tiny_onnx):
    results = request_path.trace(tiny_onnx, runs=1)
    assert set(results) == set(request_path.KINDS)
    for kind, run in results.items():
        rooms = set(run["by_room"])
        assert {"service/usecases/pipeline.py", "service/usecases/inference.py", "service/engine/local.py"} <= rooms, kind
        assert run["stops"] == len(run["path"]) and run["rooms"] == len(rooms)
        assert run["path"][0].startswith(("service/app.py", "service/grpc/", "service/http/")), (kind, run["path"][0])
    grpc_rooms = set(results["grpc ModelInfer (tensor)"]["by_room"])
    assert not {room for room in grpc_rooms if room.startswith("service/http/")}  # no HTTP on gRPC's way
    assert "service/grpc/servicer.py" in grpc_rooms


def test_the_report_sets_before_beside_after():
    run = {"stops": 3, "rooms": 2, "visits": 2, "by_room": {"service/a.py": {"stops": 2, "visits": 1},
                                                         "service/b.py": {"stops": 1, "visits": 1}}, "path": []}
    results = {"before": dict.fromkeys(request_path.KINDS, run), "after": dict.fromkeys(request_path.KINDS, run)}
    text = request_path.report(results, "0" * 40, "abc")
    assert "| http /v2 infer (JSON tensor) | 3 / 2 / 2 | 3 / 2 / 2 |" in text
    assert "| `service/a.py` | 2 (1) | 2 (1) |" in text
