"""Embeddings and the out-of-distribution score, served: POST /v1/embed, the `embedding` and `ood_score`
outputs on /v2 and gRPC, `ood` in /v1 answers with its histogram, and what a file exported without them gets."""
from __future__ import annotations

import base64

import numpy as np
import onnx
import pytest

from vitserve.artifact import ModelInfo
from service_fixtures import classify, image_bytes, patterned_png, samples, serving, settings_for, value

pytestmark = pytest.mark.anyio



@pytest.fixture(scope="module")
def ood_onnx(tiny_checkpoint, tmp_path_factory, labelled_folder_writer):
    """The tiny model exported with a labelled set: it has the embedding and the OOD score."""
    from vitserve.export.onnx_export import export_onnx

    root = labelled_folder_writer(tmp_path_factory.mktemp("labelled"), 40, seed=2)
    out = tmp_path_factory.mktemp("ood") / "model.onnx"
    export_onnx(tiny_checkpoint, out, verify=False, eval_dir=root, inspection_images=0)
    return out


@pytest.fixture(scope="module")
def bare_onnx(tiny_onnx, tmp_path_factory):
    """A file whose metadata names no embedding (as files exported before embeddings existed): the server asks for none."""
    proto = onnx.load(str(tiny_onnx))
    props = {p.key: p.value for p in proto.metadata_props if p.key not in ("vitserve.embedding_size", "vitserve.ood")}
    del proto.metadata_props[:]
    onnx.helper.set_model_props(proto, props)
    out = tmp_path_factory.mktemp("bare") / "model.onnx"
    onnx.save(proto, str(out))
    return out


def info_of(path) -> ModelInfo:
    return ModelInfo.from_metadata({p.key: p.value for p in onnx.load(str(path)).metadata_props})


async def v2_outputs(client, image: bytes, *names: str) -> dict:
    body = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(image).decode()]}],
            "outputs": [{"name": n} for n in names]}
    answer = await client.post("/v2/models/tiny-vit/infer", json=body)
    assert answer.status_code == 200, answer.text
    return {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in answer.json()["outputs"]}


async def test_embed_gives_the_graph_s_embedding_raw_or_normalised(ood_onnx):
    info, image = info_of(ood_onnx), patterned_png()
    assert info.embedding_size == 32 and info.ood["threshold"] > 0
    async with serving(settings_for(ood_onnx)) as client:
        raw = (await client.post("/v1/embed", content=image, headers={"content-type": "image/png"})).json()
        unit = (await client.post("/v1/embed", params={"normalize": "true"}, content=image,
                                  headers={"content-type": "image/png"})).json()
        outputs = await v2_outputs(client, image, "embedding", "ood_score")
        card = (await client.get("/v1/model")).json()
    (one,), (normalised,) = raw["results"], unit["results"]
    vector = np.array(one["embedding"])
    assert vector.shape == (32,) and one["norm"] == pytest.approx(np.linalg.norm(vector))
    np.testing.assert_allclose(vector, outputs["embedding"][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(normalised["embedding"], vector / np.linalg.norm(vector), rtol=1e-5, atol=1e-7)
    assert one["ood"]["score"] == pytest.approx(float(outputs["ood_score"][0]), rel=1e-4)
    assert one["ood"]["outside"] == (one["ood"]["score"] > one["ood"]["threshold"])
    assert card["embedding_size"] == 32 and card["ood"]["threshold"] == info.ood["threshold"]


def test_the_ood_score_after_the_if_reaches_both_split_paths_as_in_the_whole_file(ood_onnx):
    import onnxruntime as ort

    from vitserve.artifact import INPUT_NAME, TARGET_NAME
    from vitserve.service.engine.onnx_runtime import OnnxModel

    model, info = OnnxModel.load(settings_for(ood_onnx)), info_of(ood_onnx)
    whole = ort.InferenceSession(str(ood_onnx), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(5).standard_normal((3, 3, 32, 48)).astype(np.float32)
    for ran, names, feeds in ((model.run(x), info.output_names(), {INPUT_NAME: x}),
                              (model.explain(x, np.array([-1, 0, 2])), info.output_names(relevance=True),
                               {INPUT_NAME: x, TARGET_NAME: np.array([-1, 0, 2], np.int64)})):
        assert names[-2:] == ("embedding", "ood_score") and len(ran) == len(names)
        for mine, theirs in zip(ran, whole.run(list(names), feeds)):
            assert mine.shape == theirs.shape and np.array_equal(mine, theirs)


async def test_embed_takes_several_files_and_answers_each_in_order(ood_onnx):
    files = [("file", ("a.png", patterned_png(), "image/png")), ("file", ("b.txt", b"not an image", "image/png")),
             ("file", ("c.png", image_bytes("PNG", size=(20, 40)), "image/png"))]
    async with serving(settings_for(ood_onnx)) as client:
        answer = await client.post("/v1/embed", files=files)
    assert answer.status_code == 200, answer.text
    first, bad, third = answer.json()["results"]
    assert len(first["embedding"]) == len(third["embedding"]) == 32
    assert bad == {"error": {"code": "invalid_image", "message": bad["error"]["message"]}}


async def test_embed_reads_a_multipart_body_whatever_the_case_of_its_media_type(ood_onnx):
    """`Multipart/Form-Data` is multipart (media types are case-insensitive): every file is embedded, not the first."""
    import httpx

    files = [("file", ("a.png", patterned_png(), "image/png")), ("file", ("c.png", image_bytes("PNG"), "image/png"))]
    encoded = httpx.Request("POST", "http://x", files=files)
    body, content_type = encoded.read(), encoded.headers["content-type"]
    async with serving(settings_for(ood_onnx)) as client:
        answer = await client.post("/v1/embed", content=body,
                                   headers={"content-type": content_type.replace("multipart/form-data",
                                                                                 "Multipart/Form-Data")})
        repeated = await client.post("/v1/embed?model=tiny-vit&model=other", files=files)
    assert answer.status_code == 200, answer.text
    assert [len(r["embedding"]) for r in answer.json()["results"]] == [32, 32]
    assert repeated.status_code == 422
    assert repeated.json()["error"] == {"code": "invalid_parameter",
                                        "message": "query parameters given more than once: model"}


async def test_classify_answers_the_ood_score_and_observes_its_histogram(ood_onnx):
    image = patterned_png()
    async with serving(settings_for(ood_onnx)) as client:
        answers = [(await classify(client, image, rollout="none")).json() for _ in range(3)]
        outputs = await v2_outputs(client, image, "ood_score")
        metrics = (await client.get("/metrics")).text
    ood = answers[0]["ood"]
    assert ood["score"] == pytest.approx(float(outputs["ood_score"][0]), rel=1e-4)
    assert all(a["ood"] == ood for a in answers)
    parsed = samples(metrics)
    assert value(parsed, "vitserve_ood_score_ratio_count", model="tiny-vit", version="7") == 3


async def test_a_file_without_them_answers_without_them_and_refuses_to_embed(bare_onnx):
    image = patterned_png()
    async with serving(settings_for(bare_onnx)) as client:
        answer = (await classify(client, image, rollout="none")).json()
        embed = await client.post("/v1/embed", content=image, headers={"content-type": "image/png"})
        body = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                            "data": [base64.b64encode(image).decode()]}], "outputs": [{"name": "embedding"}]}
        v2 = await client.post("/v2/models/tiny-vit/infer", json=body)
        card = (await client.get("/v1/model")).json()
    assert answer["ood"] is None and answer["predictions"]
    assert embed.status_code == 422 and "no embedding output" in embed.json()["error"]["message"]
    assert v2.status_code == 400 and "'embedding'" in v2.json()["error"]
    assert (card["embedding_size"], card["ood"]) == (0, None)
