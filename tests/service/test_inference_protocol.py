"""The Open Inference Protocol's pure parts: the binary framing, request parsing, response encoding, the
classification strings, content decoding, statistics and the model configuration; checked against the
answers of the real Triton server captured in tests/service/data/triton (capture.py there reruns it)."""
from __future__ import annotations

import base64
import gzip
import json
import struct
import time
import zlib
from pathlib import Path
from typing import get_args

import numpy as np
import pytest

from vitserve.service.schemas.binary_tensors import (HEADER_LENGTH, BinaryFormatError, join_body, pack_bytes, split_body,
                                    take_sections, tensor_bytes, unpack_bytes)
from vitserve.service.ground.errors import InvalidParameter, PayloadTooLarge, UnsupportedMediaType
from vitserve.service.schemas.inference_protocol import ProtocolLimits, classify, encode_response, parse_infer_request
from vitserve.service.schemas.model_config import model_metadata, triton_config
from vitserve.service.schemas import v2
from vitserve.service.schemas.v2 import MAX_DATA_DEPTH
from vitserve.service.http.routes.uploads import decode_content
from vitserve.service.ground.settings import Settings
from vitserve.service.ground.metrics import ServiceMetrics
from vitserve.service.schemas.paths import INFERENCE as INFERENCE_ENDPOINTS
from vitserve.service.schemas.paths import is_protocol_path, model_in_protocol_path
from vitserve.service.schemas.statistics import triton_statistics
from vitserve.artifact import (EMBEDDING_NAME, INPUT_NAME, OOD_SCORE_NAME, OUTPUT_NAMES, RELEVANCE_NAME, ModelInfo,
                              requestable_outputs)

TRITON = json.loads((Path(__file__).parent / "data/triton/responses.json").read_text())
EXCHANGES = {e["name"]: e for e in TRITON["exchanges"]}
LIMITS = ProtocolLimits(max_json_bytes=1 << 20, max_json_values=1 << 16, max_batch=4, max_image_bytes=1000,
                        channels=1, patch_size=4, max_tokens=64)
PIXELS = np.linspace(-2, 2, 2 * 1 * 8 * 12, dtype=np.float32).reshape(2, 1, 8, 12)


def triton_json(name: str) -> dict:
    body = EXCHANGES[name]["body"]
    return body.get("json") or body["json_header"]


def request(inputs: list, **fields) -> dict:
    return {"inputs": inputs, **fields}


def pixel_input(**fields) -> dict:
    return {"name": "pixel_values", "datatype": "FP32", "shape": list(PIXELS.shape), **fields}


def binary_request(header: dict, *sections: bytes) -> tuple[bytes, str]:
    text = json.dumps(header).encode()
    return text + b"".join(sections), str(len(text))


# --- the framing ---

def test_bytes_elements_round_trip_and_their_framing_is_checked():
    elements = [b"", b"\x00\xff" * 3, "e\u0301".encode()]
    packed = pack_bytes(elements)
    assert packed[:4] == struct.pack("<I", 0) and len(packed) == 12 + 6 + 3
    assert unpack_bytes(packed, 3, max_element_bytes=6) == elements
    for bad, count, where in [(packed[:-1], 3, "declares 3 bytes"), (packed + b"x", 3, "1 bytes left"),
                              (packed[:2], 3, "cut off"), (pack_bytes([b"x" * 7]), 1, "limit is 6")]:
        with pytest.raises(BinaryFormatError, match=where):
            unpack_bytes(bad, count, max_element_bytes=6)


def test_a_body_splits_at_the_header_length_and_the_sections_must_use_it_exactly():
    body, length = binary_request({"a": 1}, b"0123", b"456")
    header, binary = split_body(body, length)
    assert json.loads(header) == {"a": 1}
    assert [bytes(s) for s in take_sections(binary, [4, 3])] == [b"0123", b"456"]
    for sizes in ([4, 2], [4, 4]):
        with pytest.raises(BinaryFormatError, match="binary_data_size"):
            take_sections(binary, sizes)
    for bad in ("-1", "1e3", "abc", str(len(body) + 1)):
        with pytest.raises(BinaryFormatError):
            split_body(body, bad)
    assert split_body(b'{"x": 1}', None)[0] == b'{"x": 1}'


def test_join_body_frames_binary_outputs_with_the_header_length():
    body, headers = join_body({"k": "v"}, [b"\x01\x02"])
    assert headers[HEADER_LENGTH] == str(len(body) - 2) and headers["Content-Type"] == "application/octet-stream"
    assert json.loads(body[:int(headers[HEADER_LENGTH])]) == {"k": "v"}
    assert join_body({"k": "v"}, [])[1] == {"Content-Type": "application/json"}


def test_a_json_header_reads_back_as_the_same_values_compactly():
    """Every float32 output, from 1e-30 to 1e30, reads back as the same double a client's parser makes of it."""
    values = (np.random.default_rng(0).normal(size=4000) * 10.0 ** np.arange(-30, 30, 0.015)).astype(np.float32)
    header = {"id": "caf\u00e9", "outputs": [{"name": "logits", "shape": [1, 4000], "data": values.tolist()}]}
    body, _ = join_body(header, [])
    assert json.loads(body) == header and b" " not in body
    assert np.array_equal(np.asarray(json.loads(body)["outputs"][0]["data"], np.float32), values)


# --- requests ---

def test_json_and_binary_pixel_tensors_parse_to_the_same_array():
    as_json = parse_infer_request(json.dumps(request([pixel_input(data=PIXELS.ravel().tolist())])).encode(), None,
                                  LIMITS)
    body, length = binary_request(request([pixel_input(parameters={"binary_data_size": PIXELS.nbytes})]),
                                  tensor_bytes(PIXELS, "FP32"))
    as_binary = parse_infer_request(body, length, LIMITS)
    np.testing.assert_array_equal(as_json.pixels, PIXELS)
    np.testing.assert_array_equal(as_binary.pixels, PIXELS)
    assert as_binary.pixels.dtype == np.float32 and as_binary.pixels.shape == PIXELS.shape
    assert [(o.name, o.binary, o.class_count) for o in as_json.outputs] == [("logits", False, 0), ("rollout", False, 0)]


UINT8_LIMITS = ProtocolLimits(**{**LIMITS.__dict__, "mean": (0.25,), "std": (0.5,)})
RAW = np.arange(2 * 1 * 8 * 12, dtype=np.uint8).reshape(2, 1, 8, 12) * 2  # 0..382 wraps: every value a byte


def test_uint8_pixels_json_and_binary_are_normalised_with_the_model_s_mean_and_std():
    from vitserve.artifact import normalize_pixels

    uint8 = {"datatype": "UINT8", "shape": list(RAW.shape)}
    as_json = parse_infer_request(json.dumps(request([pixel_input(**uint8, data=RAW.ravel().tolist())])).encode(),
                                  None, UINT8_LIMITS)
    body, length = binary_request(request([pixel_input(**uint8, parameters={"binary_data_size": RAW.size})]),
                                  RAW.tobytes())
    as_binary = parse_infer_request(body, length, UINT8_LIMITS)
    expected = normalize_pixels(RAW, [0.25], [0.5])  # the reference the image path is tested equal to
    assert as_json.pixels.dtype == as_binary.pixels.dtype == np.float32
    np.testing.assert_array_equal(as_json.pixels, expected)
    np.testing.assert_array_equal(as_binary.pixels, expected)
    assert as_binary.pixels[0, 0, 0, 1] == np.float32((2 / 255 - 0.25) / 0.5)


@pytest.mark.parametrize("data, message", [([256] + [0] * 191, "value 0 .* is 256"), ([0] * 191 + [-1], "value 191"),
                                           ([0.5] + [0] * 191, "not a UINT8 pixel"), ([0] * 10, "needs 192")])
def test_uint8_json_values_must_be_whole_bytes_and_as_many_as_the_shape(data, message):
    body = json.dumps(request([pixel_input(datatype="UINT8", shape=list(RAW.shape), data=data)])).encode()
    with pytest.raises(InvalidParameter, match=message):
        parse_infer_request(body, None, UINT8_LIMITS)


def test_a_binary_uint8_tensor_must_have_one_byte_per_value():
    header = request([pixel_input(datatype="UINT8", shape=list(RAW.shape),
                                  parameters={"binary_data_size": RAW.size * 4})])
    body, length = binary_request(header, RAW.astype(np.float32).tobytes())
    with pytest.raises(InvalidParameter, match="of UINT8 needs 192"):
        parse_infer_request(body, length, UINT8_LIMITS)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 1e5])
def test_a_binary_tensor_holds_only_normalised_pixels(value):
    pixels = PIXELS.copy()
    pixels.flat[7] = value
    body, length = binary_request(request([pixel_input(parameters={"binary_data_size": pixels.nbytes})]),
                                  tensor_bytes(pixels, "FP32"))
    with pytest.raises(InvalidParameter, match="value 7"):
        parse_infer_request(body, length, LIMITS)


def test_the_names_a_request_may_use_are_the_model_file_s():
    # the schema spells its Literals out for the type checker; the model file's contract names them
    assert get_args(v2.InputName) == (INPUT_NAME, v2.IMAGE_INPUT_NAME)
    # the outputs are the artifact's own list, read where a request is checked, and the OpenAPI document's enum
    assert requestable_outputs() == (*OUTPUT_NAMES, RELEVANCE_NAME, EMBEDDING_NAME, OOD_SCORE_NAME)
    schema = v2.RequestedOutput.model_json_schema()["properties"]["name"]
    assert schema["enum"] == list(requestable_outputs()) and schema["maxLength"] == v2.MAX_OUTPUT_NAME_CHARS
    assert v2.INPUT_DATATYPES == ("FP32", "UINT8", "BYTES")


@pytest.mark.parametrize("header, sections, message", [
    (request([pixel_input(parameters={"binary_data_size": PIXELS.nbytes - 4})]), [tensor_bytes(PIXELS, "FP32")[:-4]],
     "needs 768"),
    (request([pixel_input(parameters={"binary_data_size": PIXELS.nbytes})]), [tensor_bytes(PIXELS, "FP32")[:-4]],
     "declare 768 bytes"),
    (request([pixel_input(parameters={"binary_data_size": PIXELS.nbytes}, data=[0.0])]),
     [tensor_bytes(PIXELS, "FP32")], "both"),
    (request([pixel_input()]), [], "no `data`"),
    (request([pixel_input(parameters={"binary_data_size": "384"})]), [], "must be an integer"),
    (request([pixel_input(data=[0.0])], parameters={"binary_data_output": 1}), [],
     "^parameters.binary_data_output must be a boolean"),
    (request([pixel_input(data=[0.0])], parameters={"timeout": "1"}), [], "^parameters.timeout must be an integer"),
    (request([pixel_input(data=[0.0])], outputs=[{"name": "logits"}, {"name": "logits"}]), [], "more than once"),
    (request([pixel_input(data=[0.0])], outputs=[{"name": "logits", "parameters": {"classification": -1}}]), [],
     "at least 0"),
    (request([pixel_input(data=[0.0])], parameters={"timeout": -1}), [], "microseconds"),
    (request([pixel_input(data=[0.0])], parameters={"resize": "native"}), [], "applies to the `image` input"),
    (request([pixel_input(shape=[2, 3, 8, 12], data=[0.0])]), [], "1 channels"),
    (request([pixel_input(shape=[5, 1, 8, 12], data=[0.0])]), [], "at most 4 images"),
])
def test_a_bad_request_is_refused_naming_its_problem(header, sections, message):
    body, length = binary_request(header, *sections)
    with pytest.raises(InvalidParameter, match=message):
        parse_infer_request(body, length if sections or "binary_data_size" in json.dumps(header) else None, LIMITS)


def test_outputs_are_binary_by_request_or_by_output_and_an_outputs_own_choice_wins():
    body = request([pixel_input(data=PIXELS.ravel().tolist())], parameters={"binary_data_output": True},
                   outputs=[{"name": "rollout", "parameters": {"binary_data": False}},
                            {"name": "logits", "parameters": {"classification": 2}}])
    call = parse_infer_request(json.dumps(body).encode(), None, LIMITS)
    assert [(o.name, o.binary, o.class_count) for o in call.outputs] == [("rollout", False, 0), ("logits", True, 2)]
    call = parse_infer_request(json.dumps({**body, "parameters": {"timeout": 250_000, "priority": 3}}).encode(), None,
                               LIMITS)
    assert call.timeout_s == 0.25 and call.extra == {"priority": 3}


def test_images_come_binary_or_as_base64_json_strings():
    images = [b"\x89PNG first", b"GIF89a second"]
    header = request([{"name": "image", "datatype": "BYTES", "shape": [2, 1],
                       "parameters": {"binary_data_size": len(pack_bytes(images))}}], parameters={"resize": "native"})
    call = parse_infer_request(*binary_request(header, pack_bytes(images)), LIMITS)
    assert call.images == images and call.resize == "native" and call.batch == 2
    as_json = request([{"name": "image", "datatype": "BYTES", "shape": [2],
                        "data": [base64.b64encode(i).decode() for i in images]}])
    assert parse_infer_request(json.dumps(as_json).encode(), None, LIMITS).images == images


def test_bytes_data_nested_deeper_than_its_shape_is_read_as_triton_reads_it():
    """The issue's case: a BYTES [1, 1] input nested 3 levels deep (it was "Input should be a valid number");
    and [2, 1] nested 5 deep, row-major. Nested past the limit, 400 naming the depth."""
    images = [b"\x89PNG first", b"GIF89a second"]
    encoded = [base64.b64encode(i).decode() for i in images]
    for shape, data, expected in (([1, 1], [[[encoded[0]]]], images[:1]),
                                  ([2, 1], [[[[[encoded[0]], [encoded[1]]]]]], images)):
        body = request([{"name": "image", "datatype": "BYTES", "shape": shape, "data": data}])
        assert parse_infer_request(json.dumps(body).encode(), None, LIMITS).images == expected
    too_deep = encoded[:1]
    for _ in range(MAX_DATA_DEPTH):
        too_deep = [too_deep]
    body = request([{"name": "image", "datatype": "BYTES", "shape": [1, 1], "data": too_deep}])
    with pytest.raises(InvalidParameter, match=f"inputs.0.data: lists nest deeper than {MAX_DATA_DEPTH} levels"):
        parse_infer_request(json.dumps(body).encode(), None, LIMITS)


def test_nested_lists_count_against_the_values_limit_before_the_parse():
    """A list costs the parse as a value does: '[' counts with the commas, so deep nesting is bounded as a body
    of short values is (413 before any parsing)."""
    lists = MAX_DATA_DEPTH - 1
    element = "[" * lists + "0" + "]" * lists
    count = LIMITS.max_json_values // lists + 1  # a few more lists than the limit, in far fewer values
    text = '{"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [%d, 3, 16, 16], "data": [%s]}]}' % (
        count, ",".join([element] * count))
    assert text.count(",") < LIMITS.max_json_values < text.count("[")
    with pytest.raises(PayloadTooLarge, match="JSON values and arrays"):
        parse_infer_request(text.encode(), None, LIMITS)


@pytest.mark.parametrize("tensor, error, message", [
    ({"shape": [2], "data": ["not base64!"]}, InvalidParameter, "must hold 2"),
    ({"shape": [1], "data": ["not base64!"]}, InvalidParameter, "not base64"),
    ({"shape": [1], "data": [base64.b64encode(b"x" * 1001).decode()]}, PayloadTooLarge, "over 1000 bytes"),
    ({"shape": [5], "data": ["AA=="] * 5}, PayloadTooLarge, "limit is 4"),
    ({"shape": [1, 2], "data": ["AA==", "AA=="]}, InvalidParameter, r"\[batch, 1\]"),
    ({"shape": [1], "datatype": "FP32", "data": [1.0]}, InvalidParameter, "BYTES"),
])
def test_a_bad_image_tensor_is_refused(tensor, error, message):
    body = request([{"name": "image", "datatype": "BYTES", **tensor}])
    with pytest.raises(error, match=message):
        parse_infer_request(json.dumps(body).encode(), None, LIMITS)


def test_the_json_header_has_its_own_limit():
    body, length = binary_request(request([pixel_input(parameters={"binary_data_size": PIXELS.nbytes})],
                                          id="x" * 200), tensor_bytes(PIXELS, "FP32"))
    small = ProtocolLimits(**{**LIMITS.__dict__, "max_json_bytes": 100})
    with pytest.raises(PayloadTooLarge, match="JSON inference header"):
        parse_infer_request(body, length, small)


# --- responses, against what Triton answers ---

def test_classification_strings_are_the_ones_triton_writes():
    """Triton's own logits and rollout for one request, classified here, give Triton's own strings."""
    outputs = {o["name"]: o for o in triton_json("infer_json_batch2")["outputs"]}
    logits = np.array(outputs["logits"]["data"], np.float32).reshape(outputs["logits"]["shape"])
    rollout = np.array(outputs["rollout"]["data"], np.float32).reshape(outputs["rollout"]["shape"])
    expected = triton_json("infer_classification_json")["outputs"][0]
    assert classify(logits, 3, None).ravel().tolist() == expected["data"] and expected["shape"] == [2, 3]
    on_rollout = triton_json("infer_classification_on_rollout")["outputs"][0]
    assert classify(rollout, on_rollout["shape"][1], None).ravel().tolist() == on_rollout["data"]
    clamped = triton_json("infer_classification_k_gt_classes")["outputs"][0]
    assert classify(logits, 20, None).shape == tuple(clamped["shape"]) == (2, 10)
    labels = [f"c{i}" for i in range(10)]
    assert classify(logits, 1, labels)[0, 0] == expected["data"][0] + ":c7"


def test_a_response_has_binary_and_json_outputs_in_the_order_asked_and_no_id_unless_sent():
    body = request([pixel_input(data=PIXELS.ravel().tolist())], id="",
                   outputs=[{"name": "rollout", "parameters": {"binary_data": True}},
                            {"name": "logits", "parameters": {"classification": 2, "binary_data": True}}])
    call = parse_infer_request(json.dumps(body).encode(), None, LIMITS)
    logits = np.array([[0.5, 2.0, -1.0], [3.0, 0.0, 1.0]], np.float32)
    rollout = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    payload, headers = encode_response(call, "m", "1", {"logits": logits, "rollout": rollout}, ["a", "b", "c"])
    header, binary = split_body(payload, headers[HEADER_LENGTH])
    answer = json.loads(header)
    assert list(answer) == list(triton_json("infer_binary_in_mixed_out")) == ["model_name", "model_version", "outputs"]
    first, second = answer["outputs"]
    assert (first["name"], first["datatype"], first["shape"]) == ("rollout", "FP32", [2, 2, 3])
    assert (second["name"], second["datatype"], second["shape"]) == ("logits", "BYTES", [2, 2])
    rollout_bytes, labels_bytes = take_sections(binary, [first["parameters"]["binary_data_size"],
                                                         second["parameters"]["binary_data_size"]])
    np.testing.assert_array_equal(np.frombuffer(rollout_bytes, "<f4").reshape(2, 2, 3), rollout)
    assert unpack_bytes(labels_bytes, 4, 100) == [b"2.000000:1:b", b"0.500000:0:a", b"3.000000:0:a", b"1.000000:2:c"]


def test_a_json_response_has_the_keys_triton_sends():
    call = parse_infer_request(json.dumps(request([pixel_input(data=PIXELS.ravel().tolist())], id="r")).encode(),
                               None, LIMITS)
    payload, headers = encode_response(call, "m", "1", {"logits": np.zeros((2, 3), np.float32),
                                                        "rollout": np.zeros((2, 2, 3), np.float32)}, ["a", "b", "c"])
    ours, triton = json.loads(payload), triton_json("infer_json_with_id")
    assert headers == {"Content-Type": "application/json"}
    assert list(ours) == list(triton) and [list(o) for o in ours["outputs"]] == [list(o) for o in triton["outputs"]]


# --- content decoding ---

@pytest.mark.parametrize("encoding, compress", [("gzip", gzip.compress), ("deflate", zlib.compress),
                                                ("deflate", lambda d: zlib.compress(d)[2:-4]),  # raw deflate
                                                ("identity", lambda d: d), ("GZip", gzip.compress)])
def test_gzip_and_deflate_bodies_are_decoded(encoding, compress):
    data = b'{"inputs": []}' * 100
    assert decode_content(compress(data), encoding, limit=len(data)) == data


def test_content_decoding_refuses_bombs_bad_data_and_unknown_codings():
    bomb = gzip.compress(b"\0" * 10_000_000)  # 10 KB that would inflate to 10 MB
    with pytest.raises(PayloadTooLarge, match="1000000 bytes"):
        decode_content(bomb, "gzip", limit=1_000_000)
    assert decode_content(gzip.compress(b"ab") + gzip.compress(b"cd"), "gzip", 10) == b"abcd"  # two members
    with pytest.raises(InvalidParameter, match="cut short"):
        decode_content(gzip.compress(b"x" * 1000)[:-20], "gzip", 10_000)
    with pytest.raises(InvalidParameter, match="not valid gzip"):
        decode_content(b"plain text", "gzip", 10_000)
    with pytest.raises(UnsupportedMediaType, match="br"):
        decode_content(b"...", "br", 10_000)


# --- statistics and configuration, shaped as Triton's ---

def shape_of(document):
    """Keys (recursively) and JSON types, values aside: the shape two servers' answers must share."""
    if isinstance(document, dict):
        return {key: shape_of(value) for key, value in document.items()}
    if isinstance(document, list):
        return [shape_of(document[0])] if document else []
    return type(document).__name__


def test_statistics_count_requests_images_and_batches_in_triton_s_shape():
    """The numbers the service reports to its metrics, read back as Triton's statistics."""
    metrics = ServiceMetrics()
    model, other = metrics.for_model("m", "1"), metrics.for_model("m", "2")
    metrics.request_started()
    metrics.request_done("/v2/models/{name}/infer", 200, 0.010, "m", "1")
    metrics.request_started()
    metrics.request_done("/v1/classify", 415, 0.002, "m", "1")
    metrics.request_started()
    metrics.request_done("/v1/model", 200, 0.5)  # not an inference request
    metrics.request_started()
    metrics.request_done("/v1/classify", 200, 0.7, "m", "2")  # another version's
    for _ in range(3):
        model.queue_wait(0.001)
        model.image_stages(0.0005, 0.0002)
    model.batch_done(2, 0.004, 0.0001)
    model.batch_done(1, 0.003, 0.0)
    other.batch_done(4, 0.1, 0.0)
    ours = triton_statistics(metrics.families(), "m", "1", INFERENCE_ENDPOINTS)
    s = ours["inference_stats"]
    assert (s["success"], s["fail"]) == ({"count": 1, "ns": 10_000_000}, {"count": 1, "ns": 2_000_000})
    assert s["queue"] == {"count": 3, "ns": 3_000_000} and s["compute_input"] == {"count": 3, "ns": 1_500_000}
    assert s["compute_infer"] == {"count": 3, "ns": 2 * 4_000_000 + 3_000_000}
    assert (ours["inference_count"], ours["execution_count"]) == (3, 2)
    assert [b["batch_size"] for b in ours["batch_stats"]] == [1, 2]
    assert ours["batch_stats"][1]["compute_infer"] == {"count": 1, "ns": 4_000_000}
    assert ours["batch_stats"][1]["compute_input"] == {"count": 1, "ns": 100_000}
    assert abs(ours["last_inference"] / 1000 - time.time()) < 60
    triton = triton_json("model_stats")["model_stats"][0]
    assert shape_of({**ours, "batch_stats": []}) == shape_of({**triton, "batch_stats": []})
    assert set(ours["batch_stats"][0]) <= set(triton["batch_stats"][0])  # compute_output is inside compute_infer


def test_the_compute_counts_agree_when_an_answer_was_never_encoded():
    """An image whose client left after its batch ran is counted by the engine (compute_infer) but never by the
    front end's stages: compute_input and compute_output are still counted per image run, at the front end's
    mean duration (perf_analyzer stops when the three counts differ)."""
    metrics = ServiceMetrics()
    model = metrics.for_model("m", "1")
    model.image_stages(0.002, 0.001)  # one image encoded...
    model.batch_done(2, 0.004, 0.0)  # ...of the two that ran
    s = triton_statistics(metrics.families(), "m", "1", INFERENCE_ENDPOINTS)["inference_stats"]
    assert s["compute_input"] == {"count": 2, "ns": 4_000_000} and s["compute_output"] == {"count": 2, "ns": 2_000_000}
    assert s["compute_infer"]["count"] == 2


def test_the_model_configuration_uses_triton_s_names_types_and_the_server_s_settings():
    info = ModelInfo(name="m", version="3", labels=["a", "b"], patch_size=4, image_size=(8, 12), channels=1,
                     mean=[0.5], std=[0.25])
    settings = Settings(max_batch_size=8, max_queue_delay_ms=2.5)
    ours, triton = triton_config(info, settings, "CPUExecutionProvider"), triton_json("model_config")
    assert ours["max_batch_size"] == 8 and ours["dynamic_batching"]["max_queue_delay_microseconds"] == 2500
    assert [(i["name"], i["data_type"], i["dims"]) for i in ours["input"]] == [
        ("pixel_values", "TYPE_FP32", [1, -1, -1]), ("image", "TYPE_STRING", [1])]
    assert [(o["name"], o["dims"]) for o in ours["output"]] == [("logits", [2]), ("rollout", [-1, -1])]
    assert (ours["instance_group"][0]["kind"], ours["instance_group"][0]["count"]) == ("KIND_CPU", 1)
    # a session in each of 3 HTTP workers: 3 instances
    inline = Settings(engine="inline", workers=3)
    assert triton_config(info, inline, "CPUExecutionProvider")["instance_group"][0]["count"] == 3
    # every field we send is one Triton sends, with the same JSON type (parameters are the model's own)
    for key, value in ours.items():
        assert key in triton, key
        if key not in ("parameters", "platform"):
            assert shape_of(value) == _restricted(shape_of(triton[key]), shape_of(value)), key
    images = triton_json("images_model_config")["input"][0]
    assert (images["data_type"], images["dims"]) == ("TYPE_STRING", [1])


def _restricted(full, part):
    """`full` cut down to the keys `part` has."""
    if isinstance(full, dict) and isinstance(part, dict):
        return {k: _restricted(full[k], part[k]) for k in part if k in full}
    if isinstance(full, list) and isinstance(part, list) and full and part:
        return [_restricted(full[0], part[0])]
    return full


def test_the_metadata_declares_the_batch_dimension_as_triton_does():
    info = ModelInfo(name="m", version="3", labels=["a", "b"], patch_size=4, image_size=(8, 12), channels=1,
                     mean=[0.5], std=[0.25])
    ours = model_metadata(info).model_dump()
    triton = triton_json("model_metadata")
    assert list(ours) == list(triton) and ours["inputs"][0]["shape"] == [-1, 1, -1, -1] == triton["inputs"][0]["shape"]
    assert ours["inputs"][1] == {"name": "image", "datatype": "BYTES", "shape": [-1, 1]}
    assert triton_json("images_model_metadata")["inputs"][0]["shape"] == [-1, 1]
    assert ours["outputs"] == [{**triton["outputs"][0], "shape": [-1, 2]}, triton["outputs"][1]]


def test_the_protocol_s_paths_are_told_apart_by_one_test():
    assert [is_protocol_path(p) for p in ("/v2", "/v2/", "/v2/models/m/infer", "/v2x", "/v1/classify", "/")] == \
        [True, True, True, False, False, False]
    assert [model_in_protocol_path(p) for p in ("/v2/models/m/infer", "/v2/models/m", "/v2/models/", "/v2/health/ready",
                                                "/v1/models/m/inspect")] == ["m", "m", None, None, None]
