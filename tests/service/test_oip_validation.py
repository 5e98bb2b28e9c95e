"""The Open Inference Protocol's infer route against bad input: every malformed or out-of-limit request gets
4xx with a message naming the problem (never 500, never an echo of what was sent), the body is capped as it
streams in, and a good request right after is served."""
from __future__ import annotations

import json

import numpy as np
import pytest

from vitserve.service.schemas.binary_tensors import BINARY_MEDIA_TYPE, HEADER_LENGTH

from vitserve.service.schemas.v2 import (MAX_ABS_PIXEL_VALUE, MAX_DATA_DEPTH, MAX_DIM, MAX_ID_CHARS, MAX_OUTPUTS,
                                      MAX_PARAMETER_STRING_CHARS, MAX_PARAMETERS)
from vitserve.service.ground.settings import Settings
from service_fixtures import serving, settings_for

MAX_JSON_VALUES = Settings.model_fields["max_json_values"].default
pytestmark = pytest.mark.anyio
INFER = "/v2/models/tiny-vit/infer"
BODY_LIMIT = 64 * 1024  # the tests' max_json_body_bytes: a good request below is about 15 KB
SHAPE = [1, 3, 16, 16]  # the tiny model: 3 channels, 8-pixel patches
PIXELS = np.random.default_rng(0).normal(size=SHAPE).astype(np.float32).round(2)
VALUES = PIXELS.ravel().tolist()


@pytest.fixture
def settings(tiny_onnx):
    return settings_for(tiny_onnx, max_json_body_bytes=BODY_LIMIT)


def tensor(**changes) -> dict:
    return {"name": "pixel_values", "shape": SHAPE, "datatype": "FP32", "data": VALUES, **changes}


def body(**changes) -> bytes:
    """A request with `changes` to the tensor (its keys) or to the request; Python's json writes NaN and
    Infinity as the bare tokens NaN, Infinity and -Infinity."""
    request = {"id": "r1", "inputs": [tensor()]}
    for key, value in changes.items():
        (request["inputs"][0] if key in request["inputs"][0] else request)[key] = value
    return json.dumps(request).encode()


def with_value(value) -> bytes:
    """The good tensor with its sixth value replaced."""
    return body(data=VALUES[:5] + [value] + VALUES[6:])


def with_token(token: bytes) -> bytes:
    """The good tensor with its sixth value replaced by raw JSON text."""
    return with_value(1234.5).replace(b"1234.5", token)


def nested(values: list) -> list:
    return np.array(values, dtype=object).reshape(SHAPE).tolist()


def deeper(values: list, depth: int) -> list:
    """`values` in `depth` lists: flat inside `depth - 1` lists of one element each."""
    for _ in range(depth - 1):
        values = [values]
    return values


def assert_error(response, status: int, code: str, *names: str) -> None:
    """The Open Inference Protocol's error: `{"error": "<message>", "code": ...}`, the message naming `names`."""
    assert response.status_code == status, response.text
    error = response.json()
    assert set(error) == {"error", "code"} and error["code"] == code and isinstance(error["error"], str)
    for name in names:
        assert name.lower() in error["error"].lower(), error["error"]
    assert len(response.content) < 2000  # the message names the problem; it never carries the input back


async def assert_serves_good_request(client, tiny_model) -> None:
    """A good request, sent with no Content-Type (as tritonclient does), is answered with the model's outputs."""
    logits, rollout, *_ = tiny_model.run(PIXELS)
    response = await client.post(INFER, content=body())
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["id"] == "r1" and [o["name"] for o in answer["outputs"]] == ["logits", "rollout"]
    out = {o["name"]: o for o in answer["outputs"]}
    assert out["logits"]["shape"] == [1, 3] and out["rollout"]["shape"] == [1, 2, 2]
    np.testing.assert_allclose(out["logits"]["data"], logits.ravel(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["rollout"]["data"], rollout.ravel(), rtol=1e-5, atol=1e-6)


BAD_REQUESTS = [
    # the body as a whole
    pytest.param(b"", ("empty",), id="empty-body"),
    pytest.param(b"   \n", ("empty",), id="blank-body"),
    pytest.param(b'{"inputs": [', ("body", "invalid json"), id="truncated-json"),
    pytest.param(b"{'inputs': []}", ("body", "invalid json"), id="malformed-json"),
    pytest.param(b"[1, 2, 3]", ("body", "object"), id="array-not-object"),
    pytest.param(b'"pixel_values"', ("body", "object"), id="string-not-object"),
    pytest.param(b"[" * 5000 + b"]" * 5000, ("body", "invalid json"), id="nesting-past-json-recursion-limit"),
    # the request's fields
    pytest.param(body(id="x" * (MAX_ID_CHARS + 1)), ("id", f"at most {MAX_ID_CHARS} characters"), id="id-too-long"),
    pytest.param(body(id=12), ("id", "valid string"), id="id-not-string"),
    pytest.param(json.dumps({"id": "r1"}).encode(), ("inputs", "field required"), id="missing-inputs"),
    pytest.param(body(inputs=[]), ("inputs", "at least 1"), id="no-inputs"),
    pytest.param(body(inputs=[tensor(), tensor()]), ("inputs", "at most 1"), id="two-inputs"),
    pytest.param(body(inputs="nope"), ("inputs", "valid array"), id="inputs-not-list"),
    pytest.param(body(outputs=[{"name": "attention"}]), ("outputs.0.name", "logits", "rollout"),
                 id="unknown-output"),
    pytest.param(body(outputs=[{"name": "logits"}] * (MAX_OUTPUTS + 1)), ("outputs", f"at most {MAX_OUTPUTS}"),
                 id="too-many-outputs"),
    pytest.param(body(parameters={f"p{i}": i for i in range(MAX_PARAMETERS + 1)}),
                 ("parameters", f"at most {MAX_PARAMETERS}"), id="too-many-parameters"),
    pytest.param(body(parameters={"p": "x" * (MAX_PARAMETER_STRING_CHARS + 1)}),
                 ("parameters.p", f"at most {MAX_PARAMETER_STRING_CHARS} characters"), id="parameter-too-long"),
    pytest.param(body(parameters={"p": {"nested": [1, 2]}}), ("parameters.p", "boolean, a finite number"),
                 id="parameter-not-scalar"),
    pytest.param(body(parameters={"k" * 5000: 1}), ("parameters.kkk", "at most 64 characters"),
                 id="parameter-key-too-long"),
    # the tensor's name, datatype and shape
    pytest.param(body(name="pixels"), ("inputs.0.name", "pixel_values", "image"), id="unknown-input-name"),
    pytest.param(body(name="image"), ("inputs.0", "image", "BYTES"), id="image-input-as-fp32"),
    pytest.param(body(datatype="FLOAT"), ("inputs.0.datatype", "FP32"), id="unknown-datatype"),
    pytest.param(body(datatype="INT8"), ("inputs.0.datatype", "FP32"), id="wrong-datatype"),
    pytest.param(body(shape=[1, 3, -16, 16]), ("inputs.0.shape.2", "greater than or equal to 1"), id="negative-dim"),
    pytest.param(body(shape=[0, 3, 16, 16]), ("inputs.0.shape.0", "greater than or equal to 1"), id="zero-dim"),
    pytest.param(body(shape=[1, 3, 16, 10**12]), ("inputs.0.shape.3", f"less than or equal to {MAX_DIM}"),
                 id="huge-dim"),
    pytest.param(body(shape=[1, 3, "16", 16]), ("inputs.0.shape.2", "valid integer"), id="dim-as-string"),
    pytest.param(body(shape=[1.0, 3, 16, 16]), ("inputs.0.shape.0", "valid integer"), id="dim-as-float"),
    pytest.param(body(shape=[3, 16, 16]), ("inputs.0.shape", "[batch, channels, height, width]"), id="rank-3"),
    pytest.param(body(shape=[1, 1, 3, 16, 16]), ("inputs.0.shape", "at most 4"), id="rank-5"),
    pytest.param(body(shape=[1, 1, 16, 16]), ("inputs.0.shape", "3 channels"), id="wrong-channels"),
    pytest.param(body(shape=[1, 3, 16, 12]), ("inputs.0.shape", "multiples of 8"), id="not-patch-multiple"),
    pytest.param(body(shape=[33, 3, 16, 16]), ("inputs.0.shape", "at most 32 images"), id="batch-over-limit"),
    # the tensor's values
    pytest.param(with_value(float("nan")), ("inputs.0.data.5", "finite number"), id="NaN"),
    pytest.param(with_value(float("inf")), ("inputs.0.data.5", "finite number"), id="Infinity"),
    pytest.param(with_value(float("-inf")), ("inputs.0.data.5", "finite number"), id="-Infinity"),
    pytest.param(with_value(None), ("inputs.0.data.5", "valid number"), id="null"),
    pytest.param(with_value(1e300), ("inputs.0.data", "value 5", "1e+300", "normalised pixels"), id="1e300"),
    pytest.param(with_value(1e39), ("inputs.0.data", "value 5", "normalised pixels"), id="1e39"),
    pytest.param(with_value(-3.5e38), ("inputs.0.data", "value 5", "normalised pixels"), id="-3.5e38"),
    pytest.param(with_value(3e38), ("inputs.0.data", "value 5", "normalised pixels"), id="3e38-overflows-the-model"),
    pytest.param(with_value(2e4), ("inputs.0.data", "value 5", "at most 10000"), id="2e4"),
    pytest.param(with_value("1.0"), ("inputs.0.data.5", "valid number"), id="number-as-string"),
    pytest.param(with_value(True), ("inputs.0.data.5", "valid number"), id="boolean"),
    pytest.param(with_token(b"9" * 5000), ("body", "number out of range"), id="5000-digit-integer"),
    pytest.param(with_token(b"1e400"), ("inputs.0.data.5", "finite number"), id="1e400"),
    pytest.param(body(data="0.5"), ("inputs.0.data", "valid array"), id="data-not-list"),
    pytest.param(body(data=VALUES[:-1]), ("inputs.0.data", "767 values", "needs 768"), id="one-value-short"),
    pytest.param(body(data=VALUES + [0.5]), ("inputs.0.data", "769 values", "needs 768"), id="one-value-over"),
    pytest.param(body(data=[]), ("inputs.0.data", "0 values"), id="no-values"),
    # nested any way (as Triton reads it), the count is what decides; past MAX_DATA_DEPTH lists, the depth
    pytest.param(body(data=[[[[[0.5]]]]]), ("inputs.0.data", "1 values", "needs 768"), id="nested-past-rank"),
    pytest.param(body(data=deeper(VALUES, MAX_DATA_DEPTH + 1)), ("inputs.0.data", f"deeper than {MAX_DATA_DEPTH}"),
                 id="nested-past-the-depth-limit"),
    pytest.param(body(data=deeper(VALUES, 150)), ("inputs.0.data", f"deeper than {MAX_DATA_DEPTH}"),
                 id="nested-150-deep"),
    pytest.param(body(data=deeper(VALUES, 400)), ("body", "invalid json", f"at most {MAX_DATA_DEPTH} lists"),
                 id="nested-past-the-json-parsers-limit"),
    pytest.param(body(data=deeper(VALUES[:5] + [True] + VALUES[6:], 6)), ("inputs.0.data", "element 5", "bool",
                                                                          "finite numbers"), id="boolean-nested-deep"),
    pytest.param(body(data=deeper(VALUES[:5] + ["x"] + VALUES[6:], 6)), ("inputs.0.data", "element 5", "str"),
                 id="string-nested-deep"),
    pytest.param(body(data=deeper(VALUES, 6)[:-1]), ("inputs.0.data", "0 values", "needs 768"), id="deep-and-empty"),
    pytest.param(body(data=nested(VALUES[:5] + ["x"] + VALUES[6:])), ("inputs.0.data.0.0.0.5", "valid number"),
                 id="string-in-nested"),
]


@pytest.mark.parametrize("content, names", BAD_REQUESTS)
async def test_bad_request_is_400_naming_the_problem(settings, tiny_model, content, names):
    async with serving(settings, tiny_model) as client:
        response = await client.post(INFER, content=content, headers={"content-type": "application/json"})
        assert_error(response, 400, "invalid_parameter", *names)
        await assert_serves_good_request(client, tiny_model)


async def test_only_the_first_few_problems_are_listed(settings, tiny_model):
    """Every field wrong at once: three problems and a count of the rest; a tensor of strings costs one error."""
    content = body(id="x" * 300, parameters=[], shape=[0], datatype="INT8", name="x", data=[True] * 10_000)
    async with serving(settings, tiny_model) as client:
        response = await client.post(INFER, content=content)
        assert_error(response, 400, "invalid_parameter", "id:", "parameters:", "inputs.0.name:", "(and 3 more)")
        await assert_serves_good_request(client, tiny_model)


async def test_body_over_the_limit_with_content_length_is_refused_unread(settings, tiny_model):
    chunks_read = 0

    async def chunks():
        nonlocal chunks_read
        for _ in range(64):
            chunks_read += 1
            yield b" " * 16 * 1024

    async with serving(settings, tiny_model) as client:
        response = await client.post(INFER, content=chunks(), headers={"content-length": str(64 * 16 * 1024)})
        assert_error(response, 413, "payload_too_large", str(64 * 16 * 1024), f"limit is {BODY_LIMIT}")
        assert chunks_read == 0
        await assert_serves_good_request(client, tiny_model)


async def test_a_binary_body_has_its_own_limit_and_its_json_header_the_json_limit(tiny_onnx, tiny_model):
    """With Inference-Header-Content-Length the body may hold max_binary_body_bytes; its JSON part, and a body
    without the header, max_json_body_bytes."""
    pixels = np.zeros((2, 3, 16, 16), np.float32).tobytes()  # 6 KB
    header = json.dumps({"inputs": [{"name": "pixel_values", "shape": [2, 3, 16, 16], "datatype": "FP32",
                                     "parameters": {"binary_data_size": len(pixels)}}]}).encode()
    settings = settings_for(tiny_onnx, max_json_body_bytes=len(header) + 10, max_binary_body_bytes=8 * 1024)
    framed = {HEADER_LENGTH: str(len(header))}
    async with serving(settings, tiny_model) as client:
        assert (await client.post(INFER, content=header + pixels, headers=framed)).status_code == 200
        assert_error(await client.post(INFER, content=header + pixels + b"\0" * 4096, headers=framed), 413,
                     "payload_too_large", "the limit is 8192")
        assert_error(await client.post(INFER, content=header + pixels), 413, "payload_too_large")
        long_header = header.replace(b'"inputs"', b'"id": "' + b"i" * 20 + b'", "inputs"')
        assert_error(await client.post(INFER, content=long_header + pixels,
                                       headers={HEADER_LENGTH: str(len(long_header))}), 413, "payload_too_large",
                     "JSON inference header")


async def test_chunked_body_over_the_limit_is_cut_off_as_it_streams(settings, tiny_model):
    """No Content-Length (chunked): reading stops at the limit; the rest of a 1 MiB body is never pulled."""
    chunks_read = 0

    async def chunks():
        nonlocal chunks_read
        yield b'{"id": "'
        for _ in range(64):
            chunks_read += 1
            yield b"x" * 16 * 1024

    async with serving(settings, tiny_model) as client:
        response = await client.post(INFER, content=chunks())
        assert_error(response, 413, "payload_too_large", f"limit of {BODY_LIMIT} bytes")
        assert chunks_read == BODY_LIMIT // (16 * 1024)
        await assert_serves_good_request(client, tiny_model)


async def test_values_past_the_limit_are_refused_before_parsing(tiny_onnx, tiny_model):
    """A body of short numbers holds many values per byte: past MAX_JSON_VALUES (counted by commas) it is refused
    before the parse, even when it is not JSON at all; just under the limit it is parsed (and its count checked)."""
    under = body(data=[0] * (MAX_JSON_VALUES - 16))
    async with serving(settings_for(tiny_onnx), tiny_model) as client:  # the default 16 MiB body limit
        assert_error(await client.post(INFER, content=body(data=[0] * MAX_JSON_VALUES)), 413, "payload_too_large",
                     f"limit is {MAX_JSON_VALUES}")
        assert_error(await client.post(INFER, content=b"," * MAX_JSON_VALUES), 413, "payload_too_large", "values")
        assert_error(await client.post(INFER, content=under), 400, "invalid_parameter",
                     f"{MAX_JSON_VALUES - 16} values", "needs 768")
        await assert_serves_good_request(client, tiny_model)


async def test_body_at_the_limit_is_read(settings, tiny_model):
    content = body()
    content = content[:-1] + b" " * (BODY_LIMIT - len(content)) + b"}"  # JSON allows whitespace before the brace
    async with serving(settings, tiny_model) as client:
        response = await client.post(INFER, content=content, headers={"content-type": "application/json"})
        assert response.status_code == 200, response.text
        assert_error(await client.post(INFER, content=content + b" "), 413, "payload_too_large")


async def test_what_the_protocol_allows_is_accepted(settings, tiny_model):
    """Nested data (fully or partly), integers, parameters within the limits, an id at its longest, any
    Content-Type (the JSON is read whatever the header says)."""
    logits, *_ = tiny_model.run(PIXELS)
    integers = np.arange(768).reshape(SHAPE) % 5 - 2
    int_logits, _, *_ = tiny_model.run(integers.astype(np.float32))
    longest_id = "i" * MAX_ID_CHARS
    parameters = {"binary_data_output": False, "priority": 1, "timeout": 2_500_000, "tag": "t" * MAX_PARAMETER_STRING_CHARS}
    async with serving(settings, tiny_model) as client:
        answers = [await client.post(INFER, content=content, headers={"content-type": "text/plain"}) for content in (
            body(data=PIXELS.tolist()), body(data=PIXELS.reshape(3, 256).tolist()),
            body(id=longest_id, parameters=parameters, outputs=[{"name": "logits", "parameters": {"binary_data": False}}]),
            body(data=integers.ravel().tolist()))]
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    for answer in answers[:3]:
        np.testing.assert_allclose(answer.json()["outputs"][0]["data"], logits.ravel(), rtol=1e-5, atol=1e-5)
    assert answers[2].json()["id"] == longest_id and [o["name"] for o in answers[2].json()["outputs"]] == ["logits"]
    np.testing.assert_allclose(answers[3].json()["outputs"][0]["data"], int_logits.ravel(), rtol=1e-5, atol=1e-5)


async def test_data_nested_any_way_within_the_depth_limit_is_read_in_row_major_order(settings, tiny_model):
    """Triton reads `data` flat, nested as the shape, nested deeper, or unevenly: any nesting whose values count
    as the shape says. Each gives the flat request's answer; one list deeper than the limit is 400."""
    logits, *_ = tiny_model.run(PIXELS)
    ragged = [VALUES[:400], [VALUES[400:500], [VALUES[500:]]]]  # lists of different lengths and depths
    per_value = np.array(VALUES, dtype=object).reshape(*SHAPE, 1).tolist()  # [1, 3, 16, 16, 1]: one list more
    shapes = {"flat": VALUES, "as-the-shape": nested(VALUES), "one-level-deeper": per_value,
              "at-the-limit": deeper(VALUES, MAX_DATA_DEPTH), "ragged": ragged,
              "a-list-among-numbers": VALUES[:5] + [[VALUES[5]]] + VALUES[6:]}
    async with serving(settings, tiny_model) as client:
        for name, data in shapes.items():
            answer = await client.post(INFER, content=body(data=data))
            assert answer.status_code == 200, (name, answer.text)
            np.testing.assert_allclose(answer.json()["outputs"][0]["data"], logits.ravel(), rtol=1e-5, atol=1e-5,
                                       err_msg=name)
        past = await client.post(INFER, content=body(data=deeper(VALUES, MAX_DATA_DEPTH + 1)))
        assert_error(past, 400, "invalid_parameter", "inputs.0.data", f"nest deeper than {MAX_DATA_DEPTH} levels")


async def test_the_largest_pixel_value_is_within_range(settings, tiny_model):
    """The range check comes before the count check: at the bound the count is what is wrong, just past it the
    value is."""
    async with serving(settings, tiny_model) as client:
        at_max = await client.post(INFER, content=body(data=[MAX_ABS_PIXEL_VALUE, -MAX_ABS_PIXEL_VALUE]))
        past_max = await client.post(INFER, content=body(data=[MAX_ABS_PIXEL_VALUE * (1 + 1e-7), 0.0]))
    assert_error(at_max, 400, "invalid_parameter", "2 values", "needs 768")
    assert_error(past_max, 400, "invalid_parameter", "value 0", "normalised pixels")


async def test_openapi_documents_the_request_body(settings, tiny_model):
    async with serving(settings, tiny_model) as client:
        spec = (await client.get("/openapi.json")).json()
    infer = spec["paths"]["/v2/models/{name}/infer"]["post"]
    schema = infer["requestBody"]["content"]["application/json"]["schema"]
    assert infer["requestBody"]["required"] is True and "$ref" not in json.dumps(schema)
    assert set(schema["properties"]) == {"id", "parameters", "inputs", "outputs"} and schema["required"] == ["inputs"]
    assert schema["properties"]["id"]["anyOf"][0]["maxLength"] == MAX_ID_CHARS
    input_tensor = schema["properties"]["inputs"]["items"]
    assert input_tensor["properties"]["name"]["enum"] == ["pixel_values", "image"]
    assert input_tensor["properties"]["shape"]["items"]["maximum"] == MAX_DIM
    data, absent = input_tensor["properties"]["data"]["anyOf"]  # absent: the values are binary, after the JSON
    # numbers flat or nested 2-4 deep; strings flat or 2 deep; any deeper nesting (flattened by the server)
    assert len(data["anyOf"]) == 7 and absent == {"type": "null"}
    assert BINARY_MEDIA_TYPE in infer["requestBody"]["content"]
    assert {"200", "400", "404", "413", "429", "503", "504"} <= set(infer["responses"]) and "422" not in infer["responses"]
