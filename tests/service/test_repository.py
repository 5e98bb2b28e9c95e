"""The model repository: the layout on disk and what it refuses, version policies, the registry's load / swap /
unload in an in-process app (routing, keys, a corrupt version, metrics of unloaded versions, poll mode), and a
real `vitserve serve --model-repository` driven by tritonclient, unmodified, with a swap under load."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from vitserve.service.ground.errors import InvalidModelName, ModelNotFound, RepositoryError
from vitserve.service.ground.model_names import MAX_NAME_CHARS, MAX_VERSION_CHARS, check_model_name, check_name_lengths
from vitserve.service.http.routes.classify import ClassifyQuery
from vitserve.service.http.routes.embed import EmbedQuery
from vitserve.service.repository.layout import ModelRepository, VersionPolicy
from service_fixtures import (PATIENCE_S, assert_error, classify, image_bytes, samples, scrape, serving,
                              settings_for, uvicorn_server, value, wait_until)

pytestmark = pytest.mark.anyio
ADMIN = "s3cret-admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


def make_repository(root: Path, model_file: Path, layout: dict[str, list[int]]) -> Path:
    """`root/<name>/<version>/model.onnx` for each name and version (copies of `model_file`)."""
    for name, versions in layout.items():
        for version in versions:
            folder = root / name / str(version)
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(model_file, folder / "model.onnx")
    return root


@pytest.fixture
def repository(tmp_path, tiny_onnx) -> Path:
    return make_repository(tmp_path / "repo", tiny_onnx, {"small": [1, 2], "large": [3]})


# --- the layout ---


def test_the_layout_lists_models_and_versions_and_says_why_a_version_is_not_usable(tmp_path, tiny_onnx):
    root = make_repository(tmp_path / "repo", tiny_onnx, {"a": [1, 2]})
    (root / "a" / "3").mkdir()  # empty
    (root / "a" / "4").mkdir()
    (root / "a" / "4" / "weights.bin").write_bytes(b"\0" * 10)  # no model.onnx
    outside = tmp_path / "outside"
    make_repository(outside, tiny_onnx, {"x": [1]})
    os.symlink(outside / "x" / "1", root / "a" / "5")  # a version pointing out of the repository
    (root / "a" / "notes").mkdir()  # not a version: ignored, as Triton does
    os.symlink(outside / "x", root / "escape")  # a model pointing out of the repository
    (root / ".hidden").mkdir()
    repository = ModelRepository(root)
    assert repository.names() == ["a"]  # "escape" is a folder outside
    entry = repository.entry("a")
    assert sorted(entry.versions) == ["1", "2"] and entry.wanted() == ["2"]
    assert entry.problems == {"3": "version 3 has no model.onnx (the folder is empty)",
                              "4": "version 4 has no model.onnx (it holds weights.bin)",
                              "5": "version 5 points outside the repository"}
    with pytest.raises(ModelNotFound):
        repository.entry("escape")  # never read
    for bad in ("..", "../repo", "a/1", "", ".hidden", "a" * 65, "é"):
        with pytest.raises(InvalidModelName):
            repository.entry(bad)


def test_one_version_file_is_found_without_reading_the_rest(tmp_path, tiny_onnx):
    root = make_repository(tmp_path / "repo", tiny_onnx, {"a": [1, 2]})
    (root / "a" / "config.json").write_text("not json")  # a model whose config is broken still has its files
    repository = ModelRepository(root)
    found = repository.version_file("a", "2")
    assert found.path == (root / "a" / "2" / "model.onnx").resolve() and found.size == tiny_onnx.stat().st_size
    assert repository.version_file("a", "3") is None and repository.version_file("a", "../1") is None
    assert repository.version_file("b", "1") is None
    with pytest.raises(InvalidModelName):
        repository.version_file("..", "1")


def test_version_policies_choose_as_triton_does():
    versions = ["1", "2", "10", "3"]
    assert VersionPolicy().choose(versions) == ["10"]
    assert VersionPolicy.model_validate({"latest": {"num_versions": 2}}).choose(versions) == ["10", "3"]
    assert VersionPolicy.model_validate({"all": {}}).choose(versions) == ["10", "3", "2", "1"]
    assert VersionPolicy.model_validate({"specific": {"versions": [1, 3, 7]}}).choose(versions) == ["3", "1"]
    with pytest.raises(ValueError, match="one of latest, all or specific"):
        VersionPolicy.model_validate({"all": {}, "latest": {"num_versions": 1}})


def test_a_bad_config_is_the_models_problem_and_names_what_is_wrong(tmp_path, tiny_onnx):
    root = make_repository(tmp_path / "repo", tiny_onnx, {"a": [1], "b": [1]})
    (root / "a" / "config.json").write_text('{"max_batch_size": 0}')
    (root / "b" / "config.json").write_text('{"version_policy": {"newest": {}}}')
    (root / "c").mkdir()
    (root / "c" / "config.json").write_text('{"cpu_priority": "realtime"}')  # raising priority is not offered
    assert "max_batch_size" in ModelRepository(root).entry("a").problems[""]
    assert "cpu_priority" in ModelRepository(root).entry("c").problems[""]
    assert "newest" in ModelRepository(root).entry("b").problems[""]
    # a config.json linked out of the repository is not read, and a value is never quoted back
    outside = tmp_path / "secret.json"
    outside.write_text('{"secret_api_token": "TOPSECRET"}')
    (root / "d").mkdir()
    (root / "d" / "config.json").symlink_to(outside)
    assert ModelRepository(root).entry("d").problems[""] == "config.json points outside the repository"
    (root / "e").mkdir()
    (root / "e" / "config.json").write_text('{"secret_api_token": "TOPSECRET"}')
    assert "secret_api_token" in ModelRepository(root).entry("e").problems[""]
    assert "TOPSECRET" not in ModelRepository(root).entry("e").problems[""]
    # a FIFO would block the engine's loop until something wrote to it; deep JSON would exhaust the parser's stack
    (root / "f").mkdir()
    os.mkfifo(root / "f" / "config.json")
    assert ModelRepository(root).entry("f").problems[""] == "config.json is not a regular file"
    (root / "g").mkdir()
    (root / "g" / "config.json").write_text('{"a":' * 10_000 + "1" + "}" * 10_000)  # within the size limit
    assert ModelRepository(root).entry("g").problems[""] == "config.json: its JSON nests too deep"
    with pytest.raises(RepositoryError):
        ModelRepository(root / "a" / "1" / "model.onnx")  # a file is no repository
    assert check_model_name("vit-b16_v2.onnx") == "vit-b16_v2.onnx"


def test_one_name_limit_holds_for_the_repository_and_every_front_end():
    longest, version = "a" * MAX_NAME_CHARS, "9" * MAX_VERSION_CHARS
    assert check_model_name(longest) == longest
    with pytest.raises(InvalidModelName, match=f"1-{MAX_NAME_CHARS} letters"):
        check_model_name(longest + "a")
    check_name_lengths(longest, version)  # gRPC's names
    for name, too_long in ((longest + "a", version), (longest, version + "9")):
        with pytest.raises(InvalidModelName, match=f"at most {MAX_NAME_CHARS} characters, versions at most "
                                                   f"{MAX_VERSION_CHARS}"):
            check_name_lengths(name, too_long)
    for query in (ClassifyQuery, EmbedQuery):  # /v1's parameters
        properties = query.model_json_schema()["properties"]
        limits = [next(a["maxLength"] for a in properties[field]["anyOf"] if "maxLength" in a)
                  for field in ("model", "version")]
        assert limits == [MAX_NAME_CHARS, MAX_VERSION_CHARS], query


# --- an in-process server of a repository ---


def repo_settings(root: Path, **overrides):
    return settings_for(root / "unused.onnx", model_repository=root, **overrides)


async def test_several_models_and_versions_are_routed_by_name_and_version(repository):
    async with serving(repo_settings(repository)) as client:
        listed = (await client.get("/v1/models")).json()["models"]
        assert [(m["name"], m["version"], m["state"]) for m in listed] == [
            ("large", "3", "READY"), ("small", "2", "READY")]  # latest 1 of small
        for model, version in (("small", "2"), ("large", "3")):
            answer = await classify(client, image_bytes("PNG"), model=model)
            assert answer.status_code == 200 and answer.json()["model"] == {"name": model, "version": version}
        assert_error(await classify(client, image_bytes("PNG")), 422, "invalid_parameter")  # two models: name one
        assert_error(await classify(client, image_bytes("PNG"), model="nope"), 404, "model_not_found")
        assert_error(await classify(client, image_bytes("PNG"), model="small", version="1"), 404, "model_not_found")
        assert_error(await classify(client, image_bytes("PNG"), model="../small"), 404, "model_not_found")
        body = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1, 3, 32, 32],
                            "data": [0.0] * 3072}]}
        answer = await client.post("/v2/models/large/versions/3/infer", json=body)
        assert answer.status_code == 200 and answer.json()["model_name"] == "large"
        assert (await client.get("/v2/models/small")).json()["versions"] == ["2"]
        assert_error(await client.get("/v2/models/small/versions/9"), 404, "model_not_found")
        assert_error(await client.get("/v2/models/small/versions/x"), 404, "model_not_found")
        assert (await client.get("/v1/model", params={"model": "large"})).json()["name"] == "large"
        # the default control mode: the index is served (as Triton does), load and unload are not
        assert [(m["name"], m["version"], m["state"]) for m in (await client.post("/v2/repository/index")).json()] \
            == [("large", "3", "READY"), ("small", "2", "READY")]
        assert_error(await client.post("/v2/repository/models/small/load"), 403, "repository_control_disabled")


@pytest.mark.slow
async def test_the_repository_api_needs_the_admin_key(repository):
    settings = repo_settings(repository, model_control_mode="explicit", admin_key=ADMIN)
    async with serving(settings) as client:
        assert (await client.get("/v1/models")).json()["models"] == [
            {"name": "large", "version": "", "state": "UNAVAILABLE", "reason": "not loaded"},
            {"name": "small", "version": "", "state": "UNAVAILABLE", "reason": "not loaded"}]
        missing = await client.post("/v2/repository/models/small/load")
        assert_error(missing, 401, "unauthorized")
        assert missing.headers["www-authenticate"].startswith("Bearer")
        assert_error(await client.post("/v2/repository/models/small/load",
                                       headers={"Authorization": "Bearer wrong"}), 403, "forbidden")
        assert_error(await client.post("/v2/repository/models/small/load",
                                       headers={"Authorization": f"Basic {ADMIN}"}), 401, "unauthorized")
        assert (await client.post("/v2/repository/models/small/load", headers=AUTH)).status_code == 200
        index = (await client.post("/v2/repository/index", headers=AUTH)).json()
        assert index == [{"name": "large"}, {"name": "small", "version": "2", "state": "READY", "reason": ""}]
        assert (await classify(client, image_bytes("PNG"))).json()["model"]["version"] == "2"  # the only model
        assert_error(await client.post("/v2/repository/models/nope/load", headers=AUTH), 404, "model_not_found")
        assert_error(await client.post("/v2/repository/models/a..b/load", headers=AUTH), 400, "invalid_model_name")
        assert_error(await client.post("/v2/repository/models/small/load", headers=AUTH,
                                       json={"parameters": {"config": "{}"}}), 400, "invalid_parameter")
        assert_error(await client.post("/v2/repository/index", headers=AUTH, content=b"[1"), 400,
                     "invalid_parameter")
        deep = b'{"a":' * 5000 + b"1" + b"}" * 5000  # deeper than the JSON parser recurses: a 400, not a 500
        for path in ("/v2/repository/index", "/v2/repository/models/small/load", "/v2/repository/models/small/unload"):
            assert_error(await client.post(path, headers=AUTH, content=deep), 400, "invalid_parameter")
        assert (await client.post("/v2/repository/models/small/unload", headers=AUTH)).status_code == 200
        assert_error(await classify(client, image_bytes("PNG"), model="small"), 503, "model_unavailable")
        ready = (await client.post("/v2/repository/index", headers=AUTH, json={"ready": True})).json()
        assert ready == []


@pytest.mark.slow
async def test_a_corrupt_new_version_fails_its_load_and_the_old_one_keeps_serving(repository):
    settings = repo_settings(repository, model_control_mode="explicit", load_models=["small"], admin_key=ADMIN)
    async with serving(settings) as client:
        (repository / "small" / "5").mkdir()
        (repository / "small" / "5" / "model.onnx").write_bytes(b"this is not ONNX" * 100)
        failed = await client.post("/v2/repository/models/small/load", headers=AUTH)
        assert_error(failed, 400, "model_load_failed")
        assert "version 5" in failed.json()["error"] and "what was serving still is" in failed.json()["error"]
        index = (await client.post("/v2/repository/index", headers=AUTH)).json()
        assert {(e["version"], e["state"]) for e in index if e["name"] == "small"} == {("5", "UNAVAILABLE"),
                                                                                   ("2", "READY")}
        assert next(e for e in index if e.get("version") == "5")["reason"]
        assert 'vitserve_model_load_failures_total{model="small"} 1.0' in (await client.get("/metrics")).text
        answer = await classify(client, image_bytes("PNG"), model="small")
        assert answer.status_code == 200 and answer.json()["model"]["version"] == "2"


@pytest.mark.slow
async def test_a_new_version_folder_without_model_onnx_fails_its_load_by_name(repository, tiny_onnx):
    """`cp mine.onnx repo/small/5/` (not .../5/model.onnx): the load says so, instead of serving 2 in silence."""
    settings = repo_settings(repository, model_control_mode="explicit", load_models=["small"], admin_key=ADMIN)
    async with serving(settings) as client:
        (repository / "small" / "5").mkdir()
        (repository / "small" / "5" / "mine.onnx").write_bytes(tiny_onnx.read_bytes())
        failed = await client.post("/v2/repository/models/small/load", headers=AUTH)
        assert_error(failed, 400, "model_load_failed")
        assert "version 5 has no model.onnx (it holds mine.onnx); nothing changed" in failed.json()["error"]
        answer = await classify(client, image_bytes("PNG"), model="small")
        assert answer.status_code == 200 and answer.json()["model"]["version"] == "2"
        (repository / "small" / "5" / "mine.onnx").rename(repository / "small" / "5" / "model.onnx")
        assert (await client.post("/v2/repository/models/small/load", headers=AUTH)).status_code == 200
        assert (await classify(client, image_bytes("PNG"), model="small")).json()["model"]["version"] == "5"


@pytest.mark.slow
async def test_a_new_version_takes_over_and_the_old_ones_series_stop(repository, tiny_onnx):
    settings = repo_settings(repository, model_control_mode="explicit", load_models=["small"], admin_key=ADMIN)
    async with serving(settings) as client:
        assert (await classify(client, image_bytes("PNG"), model="small")).status_code == 200
        series = scrape_app(await client.get("/metrics"))
        assert any('version="2"' in line for line in series)
        make_repository(repository, tiny_onnx, {"small": [4]})
        assert (await client.post("/v2/repository/models/small/load", headers=AUTH)).status_code == 200
        assert (await classify(client, image_bytes("PNG"), model="small")).json()["model"]["version"] == "4"
        series = scrape_app(await client.get("/metrics"))
        assert not any('model="small",version="2"' in line or 'name="small",version="2"' in line for line in series)
        assert any('model="small",version="4"' in line for line in series)
        stats = (await client.get("/v2/models/small/stats")).json()["model_stats"]
        assert [(s["name"], s["version"], s["inference_count"]) for s in stats] == [("small", "4", 1)]


def scrape_app(response) -> list[str]:
    return [line for line in response.text.splitlines() if line and not line.startswith("#")]


@pytest.mark.slow
async def test_an_unpinned_request_in_flight_on_a_retired_version_finishes_on_a_ready_one(repository, tiny_onnx):
    """Unload of the routed version races a request: the request still gets a ready version's answer."""
    settings = repo_settings(repository, model_control_mode="explicit", load_models=["small"], admin_key=ADMIN)
    async with serving(settings) as client:
        engine = client.app.state.service.engine
        handle = engine.route("small")
        make_repository(repository, tiny_onnx, {"small": [4]})
        await engine.load("small")  # version 2 retired, 4 ready
        pixels = np.zeros((3, 32, 32), np.float32)
        result = await engine.submit(handle, pixels, PATIENCE_S)  # routed to 2 before the swap
        assert result.version == "4"
        pinned = engine.route("small", "4")
        await engine.unload("small")
        with pytest.raises(Exception, match="unloaded|no longer served"):
            await engine.submit(pinned, pixels, PATIENCE_S)


@pytest.mark.slow
async def test_poll_mode_loads_a_version_once_its_file_is_complete_and_reports_a_bad_one_once(tmp_path, tiny_onnx):
    root = make_repository(tmp_path / "repo", tiny_onnx, {"m": [1]})
    settings = repo_settings(root, model_control_mode="poll", admin_key=ADMIN, repository_poll_secs=3600)
    async with serving(settings) as client:
        registry = client.app.state.service.engine.registry
        data = tiny_onnx.read_bytes()
        (root / "m" / "2").mkdir()
        partial = root / "m" / "2" / "model.onnx"
        partial.write_bytes(data[:len(data) // 2])  # still being copied
        await registry.poll_once()
        await registry.poll_once()  # unchanged for an interval, but broken: reported
        index = {e.version: e for e in registry.index()}
        assert index["2"].state == "UNAVAILABLE" and index["2"].reason and index["1"].state == "READY"
        generation = registry.generation
        await registry.poll_once()  # not tried again while the file is the same: nothing changes
        assert registry.generation == generation
        partial.write_bytes(data)  # the copy completes
        os.utime(partial, ns=(1, 1))  # a different age: changed
        await registry.poll_once()  # seen once: not loaded yet (it may still be growing)
        assert {e.version: e.state for e in registry.index()}["2"] == "UNAVAILABLE"
        await registry.poll_once()  # the same for a whole interval: loaded, and version 1 retired
        states = {e.version: e.state for e in registry.index()}
        assert states == {"2": "READY", "1": "UNAVAILABLE"}
        shutil.rmtree(root / "m")
        await registry.poll_once()
        assert all(e.state == "UNAVAILABLE" for e in registry.index())
        assert_error(await client.post("/v2/repository/models/m/load", headers=AUTH), 403,
                     "repository_control_disabled")  # poll mode: the files decide


def served_objects(registry, name: str) -> dict[str, object]:
    """Each ready version of `name` and the session object serving it (a reload replaces it)."""
    return {v: r.served for (n, v), r in registry.records.items() if n == name and r.state == "READY"}


async def config_of(client, name: str) -> dict:
    answer = await client.get(f"/v2/models/{name}/config")
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.slow
async def test_poll_mode_reloads_a_model_whose_config_json_changed_once_it_is_settled(tmp_path, tiny_onnx):
    """Triton reloads a model whose configuration changed: each version comes up anew with the new config.json
    (the old one serving meanwhile), once the file has stayed the same for an interval, as a model file must."""
    root = make_repository(tmp_path / "repo", tiny_onnx, {"m": [1, 2]})
    config = root / "m" / "config.json"
    config.write_text(json.dumps({"version_policy": {"all": {}}}))
    settings = repo_settings(root, model_control_mode="poll", repository_poll_secs=3600)
    async with serving(settings) as client:
        registry = client.app.state.service.engine.registry
        before = served_objects(registry, "m")
        assert set(before) == {"1", "2"}
        served = await config_of(client, "m")
        assert (served["max_batch_size"], served["version_policy"]) == (4, {"all": {}})  # the server's batch size
        assert served["default_model_filename"] == "model.onnx"  # the version's file, not the server's --model
        config.write_text(json.dumps({"version_policy": {"all": {}}, "max_batch_size": 2}))
        await registry.poll_once()  # seen once: it may still be being written
        assert served_objects(registry, "m") == before and (await config_of(client, "m"))["max_batch_size"] == 4
        await registry.poll_once()  # the same for a whole interval: every version loaded again with it
        after = served_objects(registry, "m")
        assert set(after) == {"1", "2"} and all(after[v] is not before[v] for v in after)
        for version in ("1", "2"):
            served = (await client.get(f"/v2/models/m/versions/{version}/config")).json()
            assert (served["max_batch_size"], served["version_policy"]) == (2, {"all": {}}), version
        assert {e.version: (e.state, e.reason) for e in registry.index()} == {"1": ("READY", ""), "2": ("READY", "")}
        generation = registry.generation
        await registry.poll_once()  # nothing changed since: nothing happens
        config.write_bytes(config.read_bytes())  # rewritten with the same bytes (a new age): the same config
        os.utime(config, ns=(1, 1))
        await registry.poll_once()
        await registry.poll_once()
        assert registry.generation == generation and served_objects(registry, "m") == after


@pytest.mark.slow
async def test_poll_mode_follows_a_config_json_removed_or_broken_and_says_why_a_version_went(tmp_path, tiny_onnx):
    root = make_repository(tmp_path / "repo", tiny_onnx, {"m": [1, 2, 3]})
    config = root / "m" / "config.json"
    config.write_text(json.dumps({"version_policy": {"all": {}}}))
    settings = repo_settings(root, model_control_mode="poll", repository_poll_secs=3600)
    async with serving(settings) as client:
        registry = client.app.state.service.engine.registry
        shutil.rmtree(root / "m" / "1")  # a version of an `all` model deleted: the index says its folder is gone
        await registry.poll_once()
        index = {e.version: (e.state, e.reason) for e in registry.index()}
        assert index["1"] == ("UNAVAILABLE", "version 1 is no longer in the repository (its folder is gone)")
        assert index["2"][0] == index["3"][0] == "READY"

        config.unlink()  # no config.json: the default policy, the latest one
        await registry.poll_once()
        assert {e.version: e.state for e in registry.index()}["2"] == "READY"  # seen once: nothing yet
        version_3 = served_objects(registry, "m")["3"]
        await registry.poll_once()
        index = {e.version: (e.state, e.reason) for e in registry.index()}
        assert index["2"] == ("UNAVAILABLE", "version 2 is no longer in the version policy")
        assert index["3"] == ("READY", "") and served_objects(registry, "m")["3"] is not version_3
        assert (await config_of(client, "m"))["version_policy"] == {"latest": {"num_versions": 1}}

        config.write_text('{"max_batch_size": ')  # broken: reported once settled, version 3 serves on
        await registry.poll_once()
        await registry.poll_once()
        index = {e.version: (e.state, e.reason) for e in registry.index()}
        assert index["3"][0] == "READY" and index["3"][1].startswith("reload failed: config.json: ")
        assert (await classify(client, image_bytes("PNG"), model="m")).json()["model"]["version"] == "3"
        generation = registry.generation
        await registry.poll_once()  # not tried again while the file is the same
        assert registry.generation == generation
        config.unlink()  # back to what version 3 was loaded with: nothing to reload, nothing wrong
        serving_3 = served_objects(registry, "m")["3"]
        await registry.poll_once()
        await registry.poll_once()
        assert {e.version: (e.state, e.reason) for e in registry.index()}["3"] == ("READY", "")
        assert served_objects(registry, "m")["3"] is serving_3 and "m" not in registry.model_problems


@pytest.mark.slow
async def test_an_explicit_load_applies_a_changed_config_json_and_reloads_nothing_unchanged(tmp_path, tiny_onnx):
    root = make_repository(tmp_path / "repo", tiny_onnx, {"m": [1]})
    settings = repo_settings(root, model_control_mode="explicit", admin_key=ADMIN, load_models=["m"])
    async with serving(settings) as client:
        registry = client.app.state.service.engine.registry
        first = served_objects(registry, "m")["1"]
        assert (await client.post("/v2/repository/models/m/load", headers=AUTH)).status_code == 200
        assert served_objects(registry, "m")["1"] is first  # nothing changed: nothing reloaded
        (root / "m" / "config.json").write_text(json.dumps({"max_batch_size": 2}))
        assert (await client.post("/v2/repository/models/m/load", headers=AUTH)).status_code == 200
        assert served_objects(registry, "m")["1"] is not first
        assert (await config_of(client, "m"))["max_batch_size"] == 2


@pytest.mark.slow
async def test_a_version_file_replaced_in_place_keeps_its_ready_gauge_at_1(tmp_path, tiny_onnx):
    # the new session takes the version's place, then the old one closes in the background: the gauge is the
    # version's (one for both), and must end saying the new one is ready, not that the old one closed
    root = make_repository(tmp_path / "repo", tiny_onnx, {"m": [1]})
    settings = repo_settings(root, model_control_mode="explicit", admin_key=ADMIN, load_models=["m"])
    async with serving(settings) as client:
        registry = client.app.state.service.engine.registry
        first = registry.records["m", "1"].served
        os.utime(root / "m" / "1" / "model.onnx", ns=(1, 1))  # the same name and version, another file
        assert (await client.post("/v2/repository/models/m/load", headers=AUTH)).status_code == 200
        assert registry.records["m", "1"].served is not first
        await asyncio.wait_for(asyncio.gather(*registry._background), PATIENCE_S)  # the old one's close
        assert first.model is None
        ready = samples((await client.get("/metrics")).text)
        assert value(ready, "vitserve_model_ready", model="m", version="1") == 1


async def test_an_api_key_guards_inference_but_not_health_or_metrics(tiny_onnx):
    async with serving(settings_for(tiny_onnx, api_key="k1")) as client:
        assert_error(await classify(client, image_bytes("PNG")), 401, "unauthorized")
        assert_error(await client.get("/v2/models/tiny-vit"), 401, "unauthorized")
        assert_error(await client.get("/v1/models"), 401, "unauthorized")
        answer = await client.post("/v1/classify", content=image_bytes("PNG"),
                                   headers={"content-type": "image/png", "Authorization": "Bearer k1"})
        assert answer.status_code == 200
        for path in ("/v2/health/ready", "/v2/health/live", "/v2", "/metrics"):
            assert (await client.get(path)).status_code == 200, path


# --- a real server, tritonclient unmodified ---


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory, tiny_onnx):
    root = make_repository(tmp_path_factory.mktemp("served") / "repo", tiny_onnx, {"small": [1], "large": [1]})
    (root / "small" / "config.json").write_text(json.dumps({"version_policy": {"all": {}}, "max_batch_size": 4}))
    with uvicorn_server(tiny_onnx, "--model-repository", str(root), "--model-control-mode", "explicit",
                        "--load-model", "small", "--admin-key", ADMIN, "--engine", "process", workers=2) as (url, _):
        yield url, root


@pytest.mark.slow
def test_tritonclient_drives_the_repository(explicit_server, tiny_onnx):
    import tritonclient.http as triton
    from tritonclient.utils import InferenceServerException
    url, root = explicit_server
    client = triton.InferenceServerClient(url.removeprefix("http://"), network_timeout=PATIENCE_S)
    try:
        index = client.get_model_repository_index(headers=AUTH)
        assert {(m["name"], m.get("version"), m.get("state")) for m in index} == {
            ("large", None, None), ("small", "1", "READY")}
        client.load_model("large", headers=AUTH)
        make_repository(root, tiny_onnx, {"small": [2]})
        client.load_model("small", headers=AUTH)  # policy all: 1 and 2
        for model, version in (("small", "1"), ("small", "2"), ("large", "1")):
            assert client.is_model_ready(model, version)
            pixels = triton.InferInput("pixel_values", [2, 3, 32, 32], "FP32")
            pixels.set_data_from_numpy(np.zeros((2, 3, 32, 32), np.float32), binary_data=True)
            result = client.infer(model, [pixels], model_version=version)
            assert result.get_response()["model_version"] == version and result.as_numpy("logits").shape == (2, 3)
        assert client.get_model_config("small")["max_batch_size"] == 4
        # each model's own version policy (config.json), through the engine process, as Triton shows it
        assert client.get_model_config("small")["version_policy"] == {"all": {}}
        assert client.get_model_config("large")["version_policy"] == {"latest": {"num_versions": 1}}
        assert not client.is_model_ready("small", "9")
        with pytest.raises(InferenceServerException, match="no model named 'nope'"):
            client.infer("nope", [pixels])
        with pytest.raises(InferenceServerException):
            client.load_model("small")  # no key
        client.unload_model("large", headers=AUTH)
        assert not client.is_model_ready("large")
        with pytest.raises(InferenceServerException, match="no ready version"):
            client.infer("large", [pixels])
    finally:
        client.close()


@pytest.mark.slow
def test_a_swap_under_load_loses_no_request(explicit_server, tiny_onnx):
    """Clients hammer `small` while version 3 is loaded and the older ones retired (policy: all, then latest 1),
    twice: every answer is 200, from a version that was ready."""
    url, root = explicit_server
    answers: list[tuple[int, str]] = []
    stop = threading.Event()

    def client_loop():
        with httpx.Client(base_url=url, timeout=PATIENCE_S) as client:
            while not stop.is_set():
                reply = client.post("/v1/classify", params={"model": "small", "map": "none"},
                                    content=image_bytes("PNG"), headers={"content-type": "image/png"})
                answers.append((reply.status_code, reply.json().get("model", {}).get("version", reply.text)))

    threads = [threading.Thread(target=client_loop) for _ in range(8)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: len(answers) > 20, "requests answered before the swap")
        for version in (3, 4):
            make_repository(root, tiny_onnx, {"small": [version]})
            (root / "small" / "config.json").write_text(json.dumps({"version_policy": {"latest": {"num_versions": 1}}}))
            before = len(answers)
            reply = httpx.post(f"{url}/v2/repository/models/small/load", headers=AUTH, timeout=PATIENCE_S)
            assert reply.status_code == 200, reply.text
            wait_until(lambda: len(answers) > before + 20, "requests answered after the swap")
    finally:
        stop.set()
        for thread in threads:
            thread.join(PATIENCE_S)
    statuses = {status for status, _ in answers}
    assert statuses == {200}, [a for a in answers if a[0] != 200][:5]
    assert {v for _, v in answers} <= {"1", "2", "3", "4"} and answers[-1][1] == "4"
    metrics = scrape(url)
    assert not [k for k in metrics if ("model", "small") in k[1] and ("version", "2") in k[1]]


def test_a_retired_version_s_request_goes_to_the_newest_only_if_unpinned_and_its_image_fits():
    from dataclasses import replace

    from vitserve.service.ground.errors import ModelUnavailable, VersionRetired
    from vitserve.service.engine import ModelHandle
    from vitserve.service.engine.routing import RoutingTable, VersionView
    from vitserve.artifact import ModelInfo
    info = ModelInfo(name="m", version="1", labels=["a", "b"], patch_size=4, image_size=(8, 8), channels=1,
                     mean=[0.5], std=[0.25])
    table = RoutingTable({("m", "1"): VersionView("UNLOADING"), ("m", "2"): VersionView("READY", info=info)})
    old = ModelHandle("m", "1", info)
    assert table.reroute(old).version == "2"
    with pytest.raises(VersionRetired, match="was unloaded"):
        table.reroute(replace(old, pinned=True))
    with pytest.raises(VersionRetired, match="different input geometry"):
        table.reroute(replace(old, info=replace(info, image_size=(16, 16))))
    with pytest.raises(ModelUnavailable, match="no ready version"):
        RoutingTable({("m", "1"): VersionView("UNLOADING")}).reroute(old)
    several = RoutingTable({("m", "2"): VersionView("READY", info=info), ("m", "10"): VersionView("READY", info=info),
                            ("a", "1"): VersionView("READY", info=info), ("m", "3"): VersionView("LOADING")})
    assert several.ready_versions() == [("a", "1"), ("m", "10"), ("m", "2")]
    assert several.ready_versions("m") == [("m", "10"), ("m", "2")] and several.ready_versions("x") == []


def test_a_model_s_config_sets_its_own_limits_and_threads(tmp_path, tiny_onnx):
    from vitserve.service.ground.metrics import ServiceMetrics
    from vitserve.service.engine.registry import ModelRegistry
    root = make_repository(tmp_path / "repo", tiny_onnx, {"m": [1]})
    (root / "m" / "config.json").write_text(json.dumps({"max_batch_size": 3, "intra_op_threads": 2,
                                                        "max_queue_delay_ms": 1.5, "runtime": "openvino",
                                                        "precision_hint": "fp32"}))
    settings = repo_settings(root)
    registry = ModelRegistry(ModelRepository(root), settings, ServiceMetrics())
    entry = registry.source.entry("m")
    own = registry._settings_for(entry, entry.versions["1"].path)
    assert (own.max_batch_size, own.intra_op_threads, own.max_queue_delay_ms) == (3, 2, 1.5)
    assert (own.runtime, own.precision_hint) == ("openvino", "fp32") and settings.runtime != "openvino"
    assert own.warmup_batch_sizes == [1, 3] and own.model_path == entry.versions["1"].path
    assert settings.max_batch_size == 4  # the server's own are untouched


@pytest.mark.slow
async def test_a_version_unloaded_while_startup_warms_up_the_others_stays_unloaded(tmp_path, tiny_onnx):
    # warm-up works from the versions loading when it began; one unloaded meanwhile (the repository API, a poll)
    # has no session left to warm, and must neither stop the others' warm-up nor come back READY without a session
    from vitserve.service.ground.metrics import ServiceMetrics
    from vitserve.service.engine.registry import ModelRegistry
    root = make_repository(tmp_path / "repo", tiny_onnx, {"a": [1], "b": [1]})
    registry = ModelRegistry(ModelRepository(root), repo_settings(root, model_control_mode="explicit"),
                             ServiceMetrics())
    await registry.start()
    assert [(r.name, r.state) for r in registry.records.values()] == [("a", "LOADING"), ("b", "LOADING")]
    warming = asyncio.create_task(registry.warm_up_loading())
    await asyncio.sleep(0)  # it has taken its list and is warming "a" up
    await registry.unload("b")
    assert await warming is True
    states = {r.name: (r.state, r.served is not None) for r in registry.records.values()}
    assert states == {"a": ("READY", True), "b": ("UNAVAILABLE", False)}
    # a lock per model lives only while a call uses it: made-up names leave nothing behind
    for made_up in (f"nope-{i}" for i in range(50)):
        with pytest.raises(ModelNotFound):
            await registry.load(made_up)
        with pytest.raises(ModelNotFound):
            await registry.unload(made_up)
    assert registry._locks == {}
    await registry.close(1)


def _threads() -> dict[tuple[int, int], tuple[int, int]]:
    """This process's threads: (id, start time) -> (nice, scheduling policy), from /proc (stat fields 1, 22, 19
    and 41). The start time tells a new thread from an earlier one that had its id: ids wrap at pid_max (32768
    here), and the suite starts many processes."""
    threads = {}
    for stat in Path("/proc/self/task").glob("*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended while we looked
            continue
        threads[int(stat.parent.name), int(fields[19])] = (int(fields[16]), int(fields[38]))
    return threads


def _this_thread() -> tuple[int, int]:
    """The calling thread's (nice, scheduling policy)."""
    me = threading.get_native_id()
    return next(state for (tid, _), state in _threads().items() if tid == me)


@pytest.mark.parametrize("priority", ["low", "idle"])
async def test_a_lowered_model_loads_and_computes_on_lowered_threads_and_nothing_else_is_lowered(
        tmp_path, tiny_onnx, priority):
    from vitserve.service.ground.metrics import ServiceMetrics
    from vitserve.service.engine.onnx_runtime import OnnxModel
    from vitserve.service.engine.served_model import ServedModel
    from vitserve.service.engine.threads import LOW_NICE
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    lowered = (min(19, base + LOW_NICE), 0) if priority == "low" else (base, os.SCHED_IDLE)
    seen = {}

    class Recording(OnnxModel):
        def run(self, pixel_values):
            seen["run"] = _this_thread()
            return super().run(pixel_values)

    def loader(settings):
        seen["load"] = _this_thread()
        before = _threads()
        model = OnnxModel.load(settings)
        seen["started"] = {t: state for t, state in _threads().items() if t not in before}  # by the session
        return Recording(model.session, model.info)

    served = ServedModel("m", "1", settings_for(tiny_onnx, intra_op_threads=2), ServiceMetrics().for_model("m", "1"),
                         loader=loader, cpu_priority=priority)
    await served.load()
    await served.submit(np.zeros((served.info.channels, *served.info.image_size), np.float32), timeout_s=PATIENCE_S)
    await served.close(timeout_s=PATIENCE_S)
    assert seen["load"] == lowered and seen["run"] == lowered
    started = seen["started"]
    assert started and set(started.values()) == {lowered}  # ORT's intra-op thread was started lowered
    assert _this_thread() == (base, 0)  # the event loop's thread is untouched


def test_an_image_whose_outputs_are_not_finite_fails_alone_and_huge_finite_outputs_are_answered(tiny_onnx):
    from vitserve.service.engine.served_model import ServedModel
    from vitserve.service.ground.errors import InferenceError
    from vitserve.service.ground.metrics import ServiceMetrics

    class Scripted:  # a model whose outputs the test writes
        outputs: list[np.ndarray] = []

        def run(self, pixel_values):
            return self.outputs

    model = Scripted()
    served = ServedModel("m", "1", settings_for(tiny_onnx), ServiceMetrics().for_model("m", "1"), model=model)
    pixels = np.zeros((3, 1, 4, 4), np.float32)
    logits, maps = np.ones((3, 2), np.float32), np.ones((3, 2, 2), np.float32)
    for bad in (np.nan, np.inf, -np.inf):
        broken = maps.copy()
        broken[1, 0, 1] = bad
        model.outputs = [logits, broken]
        answers = served.run_batch(pixels)
        assert isinstance(answers[1], InferenceError) and "not finite" in str(answers[1])
        assert [a[0].tolist() for i, a in enumerate(answers) if i != 1] == [[1.0, 1.0]] * 2  # its batch-mates
    huge = np.full((3, 2), np.finfo(np.float32).max, np.float32)  # their float32 sum overflows; each is finite
    model.outputs = [huge, maps]
    answers = served.run_batch(pixels)
    assert [a[0].tolist() for a in answers] == [huge[0].tolist()] * 3 and all(a[1].shape == (2, 2) for a in answers)
