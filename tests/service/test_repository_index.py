"""The repository index in every control mode: Triton serves `POST /v2/repository/index` and
gRPC's RepositoryIndex in none, explicit and poll modes (only load and unload depend on the mode); the admin key
guards it when one is set."""
from __future__ import annotations

import grpc
import pytest

from service_fixtures import assert_error, free_port, serving, settings_for, until
from test_repository import make_repository

pytestmark = pytest.mark.anyio
ADMIN = "index-admin-key"
READY_INDEX = [{"name": "large", "version": "3", "state": "READY", "reason": ""},
               {"name": "small", "version": "2", "state": "READY", "reason": ""}]


@pytest.fixture
def repository(tmp_path, tiny_onnx):
    return make_repository(tmp_path / "repo", tiny_onnx, {"small": [1, 2], "large": [3]})


def mode_settings(root, mode: str, **overrides):
    extra = {"load_models": ["*"]} if mode == "explicit" else {}
    return settings_for(root / "unused.onnx", model_repository=root, model_control_mode=mode, **extra, **overrides)


@pytest.mark.parametrize("mode", ["none", "explicit", "poll"])
async def test_the_index_is_served_in_every_mode_and_load_only_in_explicit(repository, mode):
    async with serving(mode_settings(repository, mode)) as client:
        index = await client.post("/v2/repository/index")
        assert index.status_code == 200, index.text
        assert index.json() == READY_INDEX
        assert (await client.post("/v2/repository/index", json={"ready": True})).json() == READY_INDEX
        load = await client.post("/v2/repository/models/small/load")
        if mode == "explicit":
            assert load.status_code == 200, load.text
        else:
            assert_error(load, 403, "repository_control_disabled")


@pytest.mark.parametrize("mode", ["none", "explicit", "poll"])
async def test_the_index_needs_the_admin_key_when_one_is_set(repository, mode):
    async with serving(mode_settings(repository, mode, admin_key=ADMIN)) as client:
        assert_error(await client.post("/v2/repository/index"), 401, "unauthorized")
        assert_error(await client.post("/v2/repository/index", headers={"Authorization": "Bearer wrong"}), 403,
                     "forbidden")
        answer = await client.post("/v2/repository/index", headers={"Authorization": f"Bearer {ADMIN}"})
        assert answer.status_code == 200 and answer.json() == READY_INDEX


async def test_without_an_admin_key_the_index_needs_the_api_key_when_one_is_set(repository):
    async with serving(mode_settings(repository, "none", api_key="api")) as client:
        assert_error(await client.post("/v2/repository/index"), 401, "unauthorized")
        answer = await client.post("/v2/repository/index", headers={"Authorization": "Bearer api"})
        assert answer.status_code == 200 and answer.json() == READY_INDEX


@pytest.mark.parametrize("mode", ["none", "explicit", "poll"])
@pytest.mark.parametrize("admin_key", [None, ADMIN], ids=["no-key", "admin-key"])
async def test_grpc_repository_index_in_every_mode(repository, mode, admin_key):
    from vitserve.service.app import create_app
    from vitserve.service.grpc.generated import grpc_service_pb2 as pb
    from vitserve.service.grpc.generated import grpc_service_pb2_grpc as pb_grpc
    port = free_port()
    app = create_app(mode_settings(repository, mode, admin_key=admin_key, grpc_port=port), serve_grpc=True)
    async with app.router.lifespan_context(app):
        await until(lambda: app.state.service.ready, "warm-up finished")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            calls = pb_grpc.GRPCInferenceServiceStub(channel)
            key = (("authorization", f"Bearer {ADMIN}"),) if admin_key else ()
            if admin_key:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await calls.RepositoryIndex(pb.RepositoryIndexRequest())
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            answer = await calls.RepositoryIndex(pb.RepositoryIndexRequest(ready=True), metadata=key)
            assert [(m.name, m.version, m.state) for m in answer.models] == [("large", "3", "READY"),
                                                                             ("small", "2", "READY")]
            if mode != "explicit":
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await calls.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="small"), metadata=key)
                assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
