"""`vitserve bench` flags onto BenchConfig: one set of defaults, under build/; --quick; presets."""
from __future__ import annotations

from pathlib import Path

import pytest

from vitserve.bench.cli import config_from_args
from vitserve.bench.config import BenchConfig, with_server_defaults
from vitserve.bench.presets import PRESETS, resolve_model
from vitserve.cli import build_parser


def _config(*flags: str) -> BenchConfig:
    return config_from_args(build_parser().parse_args(["bench", *flags]))


def test_a_default_run_writes_under_build_not_over_committed_docs():
    cfg = _config()
    assert cfg == BenchConfig()  # no flag: exactly the dataclass's defaults, nothing else decides
    assert cfg.out == Path("build/bench/bench.md")
    for path in (cfg.out, cfg.log_dir, cfg.cache_dir):
        assert path.parts[0] == "build" and "docs" not in path.parts
    assert _config("--out", "docs/results/bench.md").out == Path("docs/results/bench.md")  # `make bench` asks for it


def test_flags_win_over_quick_and_quick_over_the_defaults():
    cfg = _config("--quick", "--duration", "2", "--concurrency", "1,2,3", "--inputs", "png", "--max-batch-size", "4",
                  "--time-limit", "60", "--log-dir", "/tmp/logs")
    assert (cfg.batch_sizes, cfg.warmup_s, cfg.raw_duration_s, cfg.pairs) == ([1, 8], 0.5, 0.5, 5)  # --quick
    assert (cfg.duration_s, cfg.concurrency, cfg.inputs, cfg.max_batch_size) == (2.0, [1, 2, 3], ["png"], 4)
    assert (cfg.time_limit_s, cfg.log_dir, cfg.bare) == (60.0, Path("/tmp/logs"), "auto")
    full = _config("--pairs", "0")
    assert (full.batch_sizes, full.duration_s, full.pairs) == ([1, 8, 32], 5.0, 0)
    with pytest.raises(SystemExit, match=r"unknown --inputs \['gif'\]"):
        _config("--inputs", "png,gif")


def test_unset_batching_knobs_take_the_servers_defaults():
    from vitserve.service.ground.settings import Settings

    server = Settings()
    filled = with_server_defaults(BenchConfig())
    assert (filled.max_batch_size, filled.max_queue_delay_ms) == (server.max_batch_size, server.max_queue_delay_ms)
    given = with_server_defaults(BenchConfig(max_batch_size=3, max_queue_delay_ms=0.0))
    assert (given.max_batch_size, given.max_queue_delay_ms) == (3, 0.0)


def test_resolve_model_takes_a_file_or_a_cached_preset(tmp_path):
    artifact = tmp_path / "m.onnx"
    artifact.write_bytes(b"x")
    assert resolve_model(str(artifact), tmp_path) == artifact
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "vit-s16.onnx").write_bytes(b"x")
    assert resolve_model("vit-s16", tmp_path / "cache") == tmp_path / "cache" / "vit-s16.onnx"
    with pytest.raises(SystemExit, match="no model file"):
        resolve_model(str(tmp_path / "absent.onnx"), tmp_path)


def test_bench_presets_are_ones_export_can_make():
    from vitserve.export.presets import PRESETS as EXPORTABLE

    assert set(PRESETS) <= set(EXPORTABLE)
