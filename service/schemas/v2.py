"""The Open Inference Protocol's (KServe v2) bodies, as /v2 over HTTP and gRPC send them: the inference request with
the limits it is held to while its JSON is parsed, the response, and a model's metadata. Parsing a request into a
call and encoding its answer are service/schemas/inference_protocol.py's."""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, GetPydanticSchema
from pydantic_core import PydanticCustomError

from vitserve.artifact import requestable_outputs

# The protocol's second input: encoded images (JPEG, PNG, ...), one BYTES element per batch item, decoded and
# preprocessed by the server as /v1/classify does. It is not in the ONNX model: the service adds it.
IMAGE_INPUT_NAME = "image"


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


# Limits of an inference request, checked while its JSON is parsed and before any work; the body as a whole is
# capped by `Settings.max_json_body_bytes` and `Settings.max_json_values` (413), which also bound the length of `data`.
# Each limit is far above what a real client sends, and a value past one gets 422 naming the field.
MAX_ID_CHARS = 256  # the id is echoed back in the answer: a correlation key, not a payload
MAX_PARAMETERS = 16  # entries per `parameters` object; the protocol's own (priority, timeout, binary_data...) are few
MAX_PARAMETER_KEY_CHARS = 64
MAX_PARAMETER_STRING_CHARS = 256
MAX_INPUTS = 1  # one of pixel_values (the model's own input) or image
# The values a request may name, spelled out because a type checker reads a Literal only from literals; the
# names are the artifact's (INPUT_NAME, OUTPUT_NAMES, ...), and tests/service/test_inference_protocol.py holds them
InputName = Literal["pixel_values", "image"]  # the model's own input, IMAGE_INPUT_NAME
InputDatatype = Literal["FP32", "UINT8", "BYTES"]
INPUT_DATATYPES: tuple[str, ...] = get_args(InputDatatype)
MAX_OUTPUTS = 16  # more than any model returns; naming one output twice is refused
MAX_OUTPUT_NAME_CHARS = 64


def _requestable(name: str) -> str:
    """An output a request may name: the artifact declares them (vitserve/artifact.py `requestable_outputs`)."""
    if name not in requestable_outputs():
        raise PydanticCustomError("literal_error", "Input should be one of {expected}",
                                  {"expected": ", ".join(requestable_outputs())})
    return name


# Every output a request may name: the fast path's, the relevance path's, and the file's optional ones
RequestableOutput = Annotated[str, Field(max_length=MAX_OUTPUT_NAME_CHARS,
                                         json_schema_extra={"enum": list(requestable_outputs())}),
                              AfterValidator(_requestable)]
MAX_SHAPE_RANK = 4  # pixel_values is (batch, channels, height, width); image is (batch,) or (batch, 1)
MAX_DIM = 2**15  # larger than any image side; four such dims multiply within int64
# Normalised pixels ((x/255 - mean) / std) lie within a few units of zero; a value past this is no image, and near
# float32's limit it overflows the model's arithmetic (3e38 made the logits infinite: a client's mistake, then a
# 500). The route checks it in numpy.
MAX_ABS_PIXEL_VALUE = 1e4

# Parsed strictly (`_StrictRequest`): a string ("1.0"), a boolean or null where a number belongs is an error, never
# converted; JSON integers are numbers. NaN and Infinity (tokens Python's json writes) are refused here.
Float = Annotated[float, Field(allow_inf_nan=False)]
Dim = Annotated[int, Field(ge=1, le=MAX_DIM)]


def _one_error(message: str) -> GetPydanticSchema:
    """A union that fails with one message of ours instead of one error per alternative."""
    return GetPydanticSchema(lambda source, handler: {**handler(source), "custom_error_type": "union_type",
                                                      "custom_error_message": message})


ParameterValue = Annotated[bool | int | Float | Annotated[str, Field(max_length=MAX_PARAMETER_STRING_CHARS)],
                           _one_error(f"a parameter must be a boolean, a finite number or a string of at most "
                                      f"{MAX_PARAMETER_STRING_CHARS} characters")]
Parameters = Annotated[dict[Annotated[str, Field(max_length=MAX_PARAMETER_KEY_CHARS)], ParameterValue],
                       Field(max_length=MAX_PARAMETERS, description="protocol parameters: booleans, numbers, strings")]


_Item = TypeVar("_Item")
# A list that stops at its first bad element, so a bad tensor costs one error, not one per value
_Rows = Annotated[list[_Item], Field(fail_fast=True)]


# Lists nested in a tensor's `data`, at most: Triton's own limit. The JSON parser stops any document at about 200
# levels, so no depth reaches Python's stack; the lists and values together are counted before the parse
# (`Settings.max_json_values`), so deep nesting cannot cost more than as many values would.
MAX_DATA_DEPTH = 100
DEEP_DATA_ERROR = "tensor_data"  # the type of `flatten_deep_data`'s errors: they name the problem best
_UNION_DEPTH = 4  # the deepest nesting `TensorData`'s list alternatives take


def flatten_deep_data(data: list) -> list:
    """`data` nested deeper (or more unevenly) than the union's alternatives below, as Triton reads any nesting:
    its leaves in row-major order, all finite numbers or all strings, at most MAX_DATA_DEPTH lists deep. Walked
    with a stack of its own, never by recursion."""
    leaves, open_lists, deepest = [], [iter(data)], 1  # open_lists: one iterator per level being read
    while open_lists:
        for item in open_lists[-1]:
            if type(item) is not list:
                leaves.append(item)
                continue
            if len(open_lists) == MAX_DATA_DEPTH:
                raise PydanticCustomError(DEEP_DATA_ERROR, "lists nest deeper than {limit} levels",
                                          {"limit": MAX_DATA_DEPTH})
            open_lists.append(iter(item))
            deepest = max(deepest, len(open_lists))
            break
        else:  # this level is read to its end
            open_lists.pop()
    _check_leaves(leaves, deepest)
    return leaves


def _check_leaves(leaves: list, deepest: int) -> None:
    """All finite numbers, or all strings. Data within the union's depths has its own errors, which name the bad
    element's place: there this one only fails, for them to be reported."""
    strings = bool(leaves) and type(leaves[0]) is str
    for i, leaf in enumerate(leaves):
        if type(leaf) is str if strings else _finite_number(leaf):
            continue
        if deepest <= _UNION_DEPTH:
            raise ValueError("data the union's alternatives report on")
        raise PydanticCustomError(DEEP_DATA_ERROR, "element {index} (row-major) is {kind}: the values must all be "
                                  "{what}", {"index": i, "kind": type(leaf).__name__,
                                             "what": "strings (BYTES)" if strings else "finite numbers (FP32)"})


def _finite_number(value) -> bool:
    # a bool is no number here (strict), and an integer past float64's range is no pixel
    return (type(value) is float and math.isfinite(value)) or (type(value) is int and abs(value) < 2**1023)


# Tensor data, row-major, flat or nested (the v2 protocol allows both). Flat comes first: it is what clients send,
# and each alternative that does not fit fails at its first element. A union of list types validates natively: a
# flat 32x1x128x128 tensor parses as fast as `list[Any]` did (a recursive alias is slower). Data nested deeper
# than these, or unevenly, takes the last alternative, flattened in Python (rare: its cost per value is higher).
# BYTES elements in JSON are strings: an image, base64-encoded (JSON strings cannot carry raw bytes).
TensorData = Annotated[_Rows[Float] | _Rows[_Rows[Float]] | _Rows[_Rows[_Rows[Float]]]
                       | _Rows[_Rows[_Rows[_Rows[Float]]]] | _Rows[str] | _Rows[_Rows[str]]
                       | Annotated[list[Any], AfterValidator(flatten_deep_data)],
                       Field(union_mode="left_to_right", description="row-major values, flat or nested (at most "
                                                                     f"{MAX_DATA_DEPTH} lists deep); BYTES "
                                                                     "elements as base64 strings")]


class _StrictRequest(BaseModel):
    model_config = ConfigDict(strict=True)  # no coercion: "2" is not a dim, true is not 1.0


class InferInputTensor(_StrictRequest):
    name: InputName
    shape: Annotated[list[Dim], Field(min_length=1, max_length=MAX_SHAPE_RANK)]
    datatype: InputDatatype
    parameters: Parameters | None = None
    data: TensorData | None = Field(None, description="absent when `parameters.binary_data_size` says the values "
                                                      "follow the JSON (binary tensor extension)")


class RequestedOutput(_StrictRequest):
    name: RequestableOutput
    parameters: Parameters | None = None


class InferRequest(_StrictRequest):
    id: Annotated[str, Field(max_length=MAX_ID_CHARS)] | None = None
    parameters: Parameters | None = None
    inputs: Annotated[list[InferInputTensor], Field(min_length=1, max_length=MAX_INPUTS)]
    outputs: Annotated[list[RequestedOutput], Field(max_length=MAX_OUTPUTS)] | None = None


class InferOutputTensor(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict | None = Field(None, description="`binary_data_size` when the values follow the JSON")
    data: list[float] | list[str] | None = Field(None, description="absent for a binary output")


class InferResponse(BaseModel):
    """Sent as JSON, or with binary outputs as this JSON followed by their bytes (`Inference-Header-Content-Length`
    says where the JSON ends); `id` only when the request had one."""

    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[InferOutputTensor]
