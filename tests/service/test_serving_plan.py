"""How a file is served is a plan made once (service/engine/serving_plan.py): from the settings, a tuning record of
this file on this machine (`vitserve tune`, service/engine/tuning.py), or declared facts; never from a stopwatch at
load. The same file, machine and settings load the same way and answer with the same bits."""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from service_fixtures import serving, settings_for

from vitserve.service.engine import cuda_graphs, runtime, serving_plan, tuning
from vitserve.service.engine.onnx_runtime import read_artifact
from vitserve.service.engine.serving_plan import PlanKey, cpu_flags, declared_runtime, multiply_adds, plan_key
from vitserve.service.ground.errors import ModelLoadError

AUTO = {"runtime": "auto", "maps_free": "auto"}


@pytest.fixture
def tuning_dir(tmp_path) -> Path:
    return tmp_path / "tuning"


@pytest.fixture
def quiet(monkeypatch):
    """The machine counts as idle: a measurement may run (tests share two cores with whatever else runs)."""
    monkeypatch.setattr(tuning, "others_busy_share", lambda: 0.0)


@pytest.fixture
def untimed(monkeypatch):
    """A load that times anything fails."""
    def timed(*args, **kwargs):
        raise AssertionError("timed at load")
    for name in ("call_times_ms", "median_ms"):
        monkeypatch.setattr(cuda_graphs, name, timed)
        monkeypatch.setattr(tuning, name, timed)


def outputs(model) -> list[np.ndarray]:
    pixels = np.random.default_rng(0).normal(size=(4, model.info.channels, *model.info.image_size))
    return list(model.run(pixels.astype(np.float32)))


def test_a_load_times_nothing_and_two_loads_answer_with_the_same_bits(tiny_onnx, tuning_dir, untimed):
    settings = settings_for(tiny_onnx, tuning_dir=tuning_dir, **AUTO)
    first, second = runtime.load_model(settings), runtime.load_model(settings)
    plan = first.capabilities.plan
    assert plan is not None and plan == second.capabilities.plan and plan.source == "declared"
    assert plan.key == plan_key(tiny_onnx, settings).digest and len(plan.key) == 24
    for a, b in zip(outputs(first), outputs(second)):
        np.testing.assert_array_equal(a, b)
    assert [name for name, _ in first.capabilities.load_stages][:3] == ["read", "plan", "sessions"]


def test_a_recorded_plan_is_read_by_every_later_load_with_the_same_key(tiny_onnx, tuning_dir, quiet, caplog):
    settings = settings_for(tiny_onnx, tuning_dir=tuning_dir, **AUTO)
    path, choice = tuning.tune(settings, "vitserve tune (test)")
    record = json.loads(path.read_text())
    assert path.parent == tuning_dir and record["key"]["file_sha256"] == serving_plan.file_sha256(tiny_onnx)
    assert set(choice) == {"runtime", "precision_hint", "maps_free", "light"}
    assert record["measured"]["chosen"] in record["measured"]["ms_per_image_at_1_plus_max_batch"]
    with caplog.at_level(logging.INFO, logger="vitserve.runtime"):
        models = [runtime.load_model(settings) for _ in range(2)]
    plans = [model.capabilities.plan for model in models]
    assert plans[0] == plans[1] and plans[0] is not None and plans[0].source == "recorded"
    assert (plans[0].runtime, plans[0].precision_hint) == (choice["runtime"], choice["precision_hint"])
    assert "vitserve tune (test)" in plans[0].why and plans[0].measured == record["measured"]
    assert "recorded: measured" in caplog.text
    for a, b in zip(outputs(models[0]), outputs(models[1])):
        np.testing.assert_array_equal(a, b)


def test_a_record_of_another_file_machine_or_setting_is_not_read(tiny_onnx, tuning_dir, quiet, tmp_path):
    settings = settings_for(tiny_onnx, tuning_dir=tuning_dir, **AUTO)
    tuning.tune(settings, "test")
    key = plan_key(tiny_onnx, settings)
    assert serving_plan.read_record(settings, key) is not None
    other_file = tmp_path / "other.onnx"
    other_file.write_bytes(tiny_onnx.read_bytes() + b"\0")  # a byte more: another file
    for other in (plan_key(other_file, settings), replace(key, cpu="another CPU"), replace(key, cores=key.cores + 1),
                  plan_key(tiny_onnx, settings.model_copy(update={"max_batch_size": 8}))):
        assert other.digest != key.digest and serving_plan.read_record(settings, other) is None
    # a record whose name is right but whose key is not (copied over by hand) is ignored, not trusted
    serving_plan.record_path(settings, replace(key, cpu="another CPU")).write_text(
        serving_plan.record_path(settings, key).read_text())
    assert serving_plan.read_record(settings, replace(key, cpu="another CPU")) is None


def test_a_broken_record_is_ignored_with_a_warning(tiny_onnx, tuning_dir, caplog):
    settings = settings_for(tiny_onnx, tuning_dir=tuning_dir, **AUTO)
    path = serving_plan.record_path(settings, plan_key(tiny_onnx, settings))
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="vitserve.runtime"):
        plan = runtime.load_model(settings).capabilities.plan
    assert plan is not None and plan.source == "declared" and "ignored" in caplog.text


def test_tuning_off_reads_no_record(tiny_onnx, tuning_dir, quiet):
    settings = settings_for(tiny_onnx, tuning_dir=tuning_dir, **AUTO)
    tuning.tune(settings, "test")
    plan = runtime.load_model(settings.model_copy(update={"tuning": "off"})).capabilities.plan
    assert plan is not None and plan.source == "declared" and plan.key == ""


def test_write_when_idle_records_on_an_idle_machine_only(tiny_onnx, tuning_dir, monkeypatch, caplog):
    settings = settings_for(tiny_onnx, tuning_dir=tuning_dir, tuning="write-when-idle", **AUTO)
    monkeypatch.setattr(tuning, "others_busy_share", lambda: 0.9)
    with caplog.at_level(logging.INFO, logger="vitserve.runtime"):
        plan = runtime.load_model(settings).capabilities.plan
    assert plan is not None and plan.source == "declared" and not list(tuning_dir.glob("*.json"))  # no record
    assert "the machine is busy" in caplog.text
    monkeypatch.setattr(tuning, "others_busy_share", lambda: 0.0)
    plan = runtime.load_model(settings).capabilities.plan
    assert plan is not None and plan.source == "recorded" and "first idle load" in plan.why
    assert len(list(tuning_dir.glob("*.json"))) == 1


def test_tune_refuses_a_busy_machine(tiny_onnx, tuning_dir, monkeypatch):
    monkeypatch.setattr(tuning, "others_busy_share", lambda: 0.5)
    with pytest.raises(ModelLoadError, match="the machine is busy"):
        tuning.tune(settings_for(tiny_onnx, tuning_dir=tuning_dir, **AUTO))
    assert not tuning_dir.exists()


def test_vitserve_tune_prints_the_choice_and_where_it_is_recorded(tiny_onnx, tuning_dir, quiet, private_environ,
                                                                  capsys):
    from vitserve.cli import main
    assert main(["tune", "--model", str(tiny_onnx), "--tuning-dir", str(tuning_dir), "--providers", "cpu",
                 "--max-batch-size", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{tiny_onnx}: ") and "maps-free graph" in out[0]
    assert any(line.strip().startswith("onnxruntime/fp32") and "ms per image" in line for line in out)
    assert out[-1].startswith(f"recorded in {tuning_dir}")
    assert main(["tune", "--model", str(tiny_onnx), "--max-batch-size", "0"]) == 2
    assert "max_batch_size" in capsys.readouterr().err


def test_a_record_changes_nothing_a_setting_names(tiny_onnx, tuning_dir, quiet):
    settings = settings_for(tiny_onnx, tuning_dir=tuning_dir, **AUTO)
    tuning.tune(settings, "test")
    for maps_free in ("on", "off"):
        plan = runtime.load_model(settings.model_copy(update={"maps_free": maps_free})).capabilities.plan
        assert plan is not None and plan.maps_free is (maps_free == "on")


def test_the_declared_runtime_follows_the_machines_units_and_the_files_precision(tiny_model):
    settings = settings_for(Path("x.onnx"), runtime="auto")
    fp32, int8 = tiny_model.info, replace(tiny_model.info, precision="int8")
    assert declared_runtime(settings, fp32, on_gpu=True, bf16_runtime="openvino")[:2] == ("onnxruntime", "auto")
    assert declared_runtime(settings, fp32, on_gpu=False, bf16_runtime="openvino")[:2] == ("openvino", "bf16")
    assert declared_runtime(settings, fp32, on_gpu=False, bf16_runtime=None)[:2] == ("onnxruntime", "auto")
    assert declared_runtime(settings, int8, on_gpu=False, bf16_runtime="openvino")[:2] == ("onnxruntime", "auto")
    # an int8 file where a runtime runs its layers as integer products (OpenVINO on VNNI), the rest in float32
    assert declared_runtime(settings, int8, False, "openvino", int8_runtime="openvino")[:2] == ("openvino", "fp32")
    assert declared_runtime(settings, fp32, False, None, int8_runtime="openvino")[:2] == ("onnxruntime", "auto")
    fp32_asked = settings.model_copy(update={"precision_hint": "fp32"})
    assert declared_runtime(fp32_asked, fp32, on_gpu=False, bf16_runtime="openvino")[:2] == ("onnxruntime", "auto")


def test_light_is_decided_from_the_models_size(tiny_onnx, monkeypatch):
    info, paths = read_artifact(tiny_onnx)
    macs = multiply_adds(info, paths.fast)
    weights = sum(int(np.prod(t.dims)) for t in paths.fast.graph.initializer)
    tokens = (info.image_size[0] // info.patch_size) * (info.image_size[1] // info.patch_size) + 1
    assert weights * tokens <= macs < weights * tokens * 1.5
    settings = settings_for(tiny_onnx, runtime="auto")
    assert serving_plan.serving_plan(settings, info, paths.fast, False, None, None).light
    assert not serving_plan.serving_plan(settings, info, paths.fast, True, None, None).light  # a GPU
    monkeypatch.setattr(serving_plan, "LIGHT_MODEL_MULTIPLY_ADDS", macs)
    assert not serving_plan.serving_plan(settings, info, paths.fast, False, None, None).light


def test_the_key_names_the_cpus_deciding_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor : 0\nflags : fpu sse avx2 fma avx512f avx512_bf16 amx_tile amx_bf16 ht\n")
    assert cpu_flags(cpuinfo) == ("amx_bf16", "amx_tile", "avx2", "avx512_bf16", "avx512f", "fma")
    assert cpu_flags(tmp_path / "missing") == ()
    key = PlanKey("ab" * 32, "CPU", ("avx2",), 2, ("onnxruntime 1",), (("runtime", "auto"),))
    assert key.as_json()["flags"] == ["avx2"] and key.digest == replace(key).digest


@pytest.mark.anyio
async def test_the_card_v2_config_and_log_say_how_the_version_is_served_and_what_its_load_took(tiny_onnx, tuning_dir,
                                                                                             caplog):
    settings = settings_for(tiny_onnx, tuning_dir=tuning_dir, **AUTO)
    with caplog.at_level(logging.INFO, logger="vitserve"):
        async with serving(settings) as client:
            card = (await client.get("/v1/model")).json()
            config = (await client.get(f"/v2/models/{card['name']}/config")).json()
    plan = card["serving"]
    assert plan["source"] == "declared" and plan["key"] == plan_key(tiny_onnx, settings).digest
    assert plan["provider"] == card["provider"] and plan["runtime"] in ("onnxruntime", "openvino")
    stages = plan["load_stages_s"]
    assert list(stages)[:3] == ["read", "plan", "sessions"] and list(stages)[-1] == "warm-up"
    assert sum(stages.values()) <= plan["ready_s"] + 0.01
    parameters = config["parameters"]
    assert parameters["plan_source"] == {"string_value": "declared"}
    assert parameters["plan_key"] == {"string_value": plan["key"]}
    assert parameters["plan_maps_free"] == {"string_value": "true"}
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready: ")]
    assert len(ready) == 1 and "(read " in ready[0] and ", warm-up " in ready[0], ready


def test_tune_names_a_missing_file_before_it_looks_at_the_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "others_busy_share", lambda: 0.9)  # busy too: the file is what is wrong first
    with pytest.raises(ModelLoadError, match="not found"):
        tuning.tune(settings_for(tmp_path / "absent.onnx", tuning_dir=tmp_path / "tuning"))
