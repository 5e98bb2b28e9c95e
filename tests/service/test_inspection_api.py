"""GET /v1/models/{name}/inspect: the Figure 7 numbers `vitserve export` stored, served from the file's metadata,
for a single model and a repository's versions; a file without them, and bad names, answered as the API's errors."""
from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest

from service_fixtures import assert_error, serving, settings_for
from vitserve.artifact import INSPECTION_KEY

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def uninspected_onnx(tiny_onnx, tmp_path_factory):
    """The tiny model's file with its stored inspection taken out, as an older export."""
    proto = onnx.load(str(tiny_onnx))
    kept = [p for p in proto.metadata_props if p.key != INSPECTION_KEY]
    assert len(kept) == len(proto.metadata_props) - 1
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    out = tmp_path_factory.mktemp("old") / "model.onnx"
    onnx.save(proto, str(out))
    return out


def _check_figure_7(body: dict, name: str, version: str) -> None:
    assert (body["model_name"], body["model_version"], body["patch_size"], body["grid"]) == (name, version, 8, [4, 4])
    components = np.array(body["components"])
    assert components.shape == (28, 3, 8, 8)  # the top 28 of 32 filters, each C x P x P
    norms = np.linalg.norm(components.reshape(28, -1), axis=1)
    np.testing.assert_allclose(norms, 1, atol=1e-3)  # principal directions are unit vectors
    explained = np.array(body["explained_variance"])
    assert np.all(np.diff(explained) <= 1e-9) and 0 < explained.sum() <= 1 + 1e-6
    similarity = np.array(body["position_similarity"])
    assert similarity.shape == (4, 4, 4, 4)
    np.testing.assert_allclose([similarity[r, c, r, c] for r in range(4) for c in range(4)], 1, atol=1e-4)
    distances = np.array(body["mean_attention_distance_px"])
    assert distances.shape == (2, 2) and np.all((distances > 0) & (distances <= body["max_distance_px"]))
    assert body["images"] == 17 and "patch-embedding filters" in body["filters"]  # the export's photos


async def test_the_served_model_shows_what_it_learned(tiny_onnx):
    async with serving(settings_for(tiny_onnx)) as client:
        response = await client.get("/v1/models/tiny-vit/inspect")
        assert response.status_code == 200, response.text
        _check_figure_7(response.json(), "tiny-vit", "7")
        again = await client.get("/v1/models/tiny-vit/inspect", params={"version": "7"})
        assert again.json() == response.json()
        assert_error(await client.get("/v1/models/tiny-vit/inspect", params={"version": "8"}), 404,
                     "model_not_found")
        assert_error(await client.get("/v1/models/other/inspect"), 404, "model_not_found")
        assert_error(await client.get("/v1/models/" + "a" * 65 + "/inspect"), 422, "invalid_parameter")
        assert_error(await client.get("/v1/models/tiny-vit/inspect", params={"version": "9" * 21}), 422,
                     "invalid_parameter")
        assert (await client.get("/v1/models/%2e%2e/inspect")).status_code in (400, 404)


async def test_a_file_exported_without_it_is_a_404_that_says_how_to_get_it(uninspected_onnx):
    async with serving(settings_for(uninspected_onnx)) as client:
        response = await client.get("/v1/models/tiny-vit/inspect")
        assert_error(response, 404, "inspection_not_stored")
        assert "export it again" in response.json()["error"]["message"]
        assert (await client.post("/v1/classify", files={"file": ("x.png", b"not an image")})).status_code == 400


async def test_each_repository_version_answers_from_its_own_file(tmp_path, tiny_onnx, uninspected_onnx):
    root = tmp_path / "repo"
    for version, source in (("1", tiny_onnx), ("2", uninspected_onnx)):
        (root / "tiny" / version).mkdir(parents=True)
        shutil.copyfile(source, root / "tiny" / version / "model.onnx")
    (root / "tiny" / "config.json").write_text('{"version_policy": {"all": {}}}')
    async with serving(settings_for(tmp_path / "unused.onnx", model_repository=root)) as client:
        newest = await client.get("/v1/models/tiny/inspect")
        assert_error(newest, 404, "inspection_not_stored")
        first = await client.get("/v1/models/tiny/inspect", params={"version": "1"})
        assert first.status_code == 200, first.text
        _check_figure_7(first.json(), "tiny", "1")
        escape = await client.get("/v1/models/..%2f..%2fetc/inspect")  # decoded, no route has that shape
        assert escape.status_code == 404 and "passwd" not in escape.text
