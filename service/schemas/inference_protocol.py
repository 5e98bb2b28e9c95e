"""The Open Inference Protocol's inference request and response, as plain data: no HTTP, no model calls.

`parse_infer_request` turns a body (JSON, or JSON followed by binary tensors) into an `ParsedInferRequest`: the one
input (`pixel_values` as a float32 array, or `image` as encoded images), the outputs asked for and how
(JSON or binary, classification), and the request's own parameters. The `relevance` output is sent only when
named (it runs the model's costlier relevance path); `parameters.target` (a class index or label) chooses the
class it explains for every image of the request, the top-1 of each by default. `encode_response` turns the model's
outputs back into a body. Every refusal is an `InvalidParameter` (400 on /v2) or `PayloadTooLarge` (413)
that names the field; the limits are those of `service.schemas.v2` plus the `ProtocolLimits` given.

Extensions: binary tensors (`binary_data_size` on inputs, `binary_data` on outputs, `binary_data_output` on
the request), classification (`classification` on an output: BYTES `"value:index:label"`, best first, as
Triton writes them; tests/service/data/triton holds Triton's own answers), and Triton's `timeout` request
parameter (microseconds), which can only shorten the server's own deadline.
"""
from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast, get_args

import numpy as np
from pydantic import ValidationError

from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES, RELEVANCE_NAME, normalize_pixels, requestable_outputs
from vitserve.service.ground.errors import InvalidParameter, PayloadTooLarge
from vitserve.service.schemas.binary_tensors import (
    BinaryFormatError,
    ElementTooLarge,
    join_body,
    pack_bytes,
    split_body,
    take_sections,
    tensor_bytes,
    unpack_bytes,
)
from vitserve.service.schemas.v1 import ResizePolicy
from vitserve.service.schemas.v2 import (
    DEEP_DATA_ERROR,
    IMAGE_INPUT_NAME,
    INPUT_DATATYPES,
    MAX_ABS_PIXEL_VALUE,
    MAX_DATA_DEPTH,
    MAX_DIM,
    MAX_ID_CHARS,
    MAX_OUTPUTS,
    MAX_PARAMETER_KEY_CHARS,
    MAX_PARAMETER_STRING_CHARS,
    MAX_PARAMETERS,
    MAX_SHAPE_RANK,
    InferRequest,
    flatten_deep_data,
)

RESIZE_POLICIES: tuple[ResizePolicy, ...] = get_args(ResizePolicy)
DEGRADE_POLICIES = ("load", "never")  # parameters.degrade: whether load may answer at a cheaper token budget
MAX_TOKENS = 1_000_000  # parameters.max_tokens: a budget of more tokens than any model has is the full budget
LABELLED_OUTPUT = OUTPUT_NAMES[0]  # logits: its classification strings carry the labels


@dataclass(frozen=True)
class ProtocolLimits:
    max_json_bytes: int  # the JSON header
    max_json_values: int  # JSON values in the header, counted before the parse
    max_batch: int  # items of one request
    max_image_bytes: int  # one encoded image
    channels: int  # pixel_values: the model's channels,
    patch_size: int  # its height and width multiples of the patch size,
    max_tokens: int  # and at most this many patches
    mean: tuple[float, ...] = ()  # UINT8 pixel_values are normalised with the model's own mean and std
    std: tuple[float, ...] = ()


def limits_for(settings, info) -> ProtocolLimits:
    """The limits of a request to the model `info` describes, under the server's `settings`
    (service.settings.Settings)."""
    return ProtocolLimits(max_json_bytes=settings.max_json_body_bytes, max_json_values=settings.max_json_values,
                          max_batch=settings.max_batch_files, max_image_bytes=settings.max_upload_bytes,
                          channels=info.channels, patch_size=info.patch_size, max_tokens=settings.max_native_tokens,
                          mean=tuple(info.mean), std=tuple(info.std))


@dataclass(frozen=True)
class OutputRequest:
    name: str
    binary: bool
    class_count: int = 0  # > 0: the classification extension's top classes instead of the tensor


@dataclass
class ParsedInferRequest:
    """One parsed inference request: exactly one of `pixels` and `images` is set."""

    id: str | None
    outputs: list[OutputRequest]
    pixels: np.ndarray | None = None  # (B, C, H, W) float32, as sent (the model's geometry is checked later)
    images: list[bytes] | None = None  # B encoded images
    resize: ResizePolicy = "fit"
    timeout_s: float | None = None
    target: int | str | None = None  # parameters.target: the class the relevance output explains
    max_tokens: int | None = None  # parameters.max_tokens: the token budget asked for (docs/token-budgets.md)
    degrade: bool = True  # parameters.degrade "never": refused under load rather than answered cheaper
    extra: dict = field(default_factory=dict)  # request parameters the server does not use

    @property
    def explains(self) -> bool:
        """Whether the relevance output is asked for (then the images run on the relevance path)."""
        return any(output.name == RELEVANCE_NAME for output in self.outputs)

    @property
    def batch(self) -> int:
        if self.images is not None:
            return len(self.images)
        assert self.pixels is not None, "a call carries its images or its pixels"
        return len(self.pixels)


def parse_infer_request(body: bytes, header_length: str | None, limits: ProtocolLimits) -> ParsedInferRequest:
    """A body and its `Inference-Header-Content-Length` header (None: all JSON) -> the request it holds."""
    try:
        header, binary = split_body(body, header_length)
    except BinaryFormatError as e:
        raise InvalidParameter(str(e)) from None
    if len(header) > limits.max_json_bytes:
        raise PayloadTooLarge(f"the JSON inference header is {len(header)} bytes; the limit is {limits.max_json_bytes}")
    return parsed_from_json(parse_header(header, limits.max_json_values), binary, limits)


def parsed_from_json(request: InferRequest, binary: memoryview, limits: ProtocolLimits) -> ParsedInferRequest:
    """A validated /v2 JSON request and the bytes of its binary sections (empty when none) -> the call it makes."""
    tensor = request.inputs[0]
    size = _parameter(tensor.parameters, "binary_data_size", int, "inputs.0")
    if size is not None and size < 0:
        raise InvalidParameter(f"inputs.0.parameters.binary_data_size must be at least 0, got {size}")
    try:
        (section,) = take_sections(binary, [size or 0])
    except BinaryFormatError as e:
        raise InvalidParameter(str(e)) from None
    if size is not None and tensor.data is not None:
        raise InvalidParameter("inputs.0 has both `data` and parameters.binary_data_size; send one")
    if size is None and tensor.data is None:
        raise InvalidParameter("inputs.0 has no `data` and no parameters.binary_data_size")
    outputs = None if request.outputs is None else [(o.name, o.parameters) for o in request.outputs]
    return build_infer_request(request.id, request.parameters, tensor, section if size is not None else None, outputs,
                               limits)


@dataclass(frozen=True)
class TensorInput:
    """The request's one input as a transport without JSON carries it: its values are in a binary section."""

    name: str
    datatype: str
    shape: list[int]
    data: None = None


def checked_infer_request(id: str, parameters: dict, tensor: TensorInput, tensor_parameters: dict, section: memoryview,
                 outputs: list[tuple[str, dict]] | None, limits: ProtocolLimits) -> ParsedInferRequest:
    """The call a request makes that no JSON parser has checked (gRPC's ModelInfer, read from its protobuf): the
    same limits as /v2's `InferRequest` (service.schemas.v2), then the same call."""
    if len(id) > MAX_ID_CHARS:
        raise InvalidParameter(f"id: at most {MAX_ID_CHARS} characters, got {len(id)}")
    _check_parameters(parameters, "parameters")
    _check_parameters(tensor_parameters, "inputs.0.parameters")
    if tensor.name not in (INPUT_NAME, IMAGE_INPUT_NAME):
        raise InvalidParameter(f"inputs.0.name: must be {INPUT_NAME!r} or {IMAGE_INPUT_NAME!r}, got "
                               f"{tensor.name[:40]!r}")
    if tensor.datatype not in INPUT_DATATYPES:
        raise InvalidParameter(f"inputs.0.datatype: must be one of {', '.join(INPUT_DATATYPES)}, got "
                               f"{tensor.datatype[:20]!r}")
    if not 1 <= len(tensor.shape) <= MAX_SHAPE_RANK or not all(1 <= d <= MAX_DIM for d in tensor.shape):
        raise InvalidParameter(f"inputs.0.shape: 1 to {MAX_SHAPE_RANK} dimensions of 1 to {MAX_DIM}, got "
                               f"{tensor.shape[:8]}")
    if outputs is not None:
        if len(outputs) > MAX_OUTPUTS:
            raise InvalidParameter(f"outputs: at most {MAX_OUTPUTS}, got {len(outputs)}")
        for i, (name, output_parameters) in enumerate(outputs):
            if name not in requestable_outputs():
                raise InvalidParameter(f"outputs.{i}.name: must be one of {', '.join(requestable_outputs())}, got "
                                       f"{name[:40]!r}")
            _check_parameters(output_parameters, f"outputs.{i}.parameters")
    return build_infer_request(id or None, parameters, tensor, section, outputs, limits)


def _check_parameters(parameters: dict, where: str) -> None:
    """`Parameters`' limits (service.schemas.v2): how many, key length, and each value a boolean, a finite
    number or a short string."""
    if len(parameters) > MAX_PARAMETERS:
        raise InvalidParameter(f"{where}: at most {MAX_PARAMETERS} entries, got {len(parameters)}")
    for key, value in parameters.items():
        if len(key) > MAX_PARAMETER_KEY_CHARS:
            raise InvalidParameter(f"{where}: a key is at most {MAX_PARAMETER_KEY_CHARS} characters, got "
                                   f"{key[:29]!r}...")
        fits = (type(value) in (bool, int) or (type(value) is float and math.isfinite(value))
                or (type(value) is str and len(value) <= MAX_PARAMETER_STRING_CHARS))
        if not fits:
            raise InvalidParameter(f"{where}.{_dotted((key,))}: a parameter must be a boolean, a finite number or a "
                                   f"string of at most {MAX_PARAMETER_STRING_CHARS} characters")


def build_infer_request(id: str | None, parameters: dict | None, tensor, section: memoryview | None,
               outputs: Sequence[tuple[str, dict | None]] | None, limits: ProtocolLimits) -> ParsedInferRequest:
    """Checked parts -> the call: `tensor` has the input's name, datatype, shape and JSON `data`; `section` its
    values when they came as bytes (None: in `data`); `outputs` (name, parameters) as named, None for all."""
    call = ParsedInferRequest(id=id, outputs=requested_outputs(parameters, outputs))
    _read_request_parameters(parameters or {}, call)
    if call.target is not None and not call.explains:
        raise InvalidParameter("parameters.target names the class the relevance output explains: request the "
                               "relevance output")
    if tensor.name == IMAGE_INPUT_NAME:
        call.images = _images(tensor, section, limits)
    else:
        if "resize" in (parameters or {}):
            raise InvalidParameter("parameters.resize applies to the `image` input, not to pixel_values")
        call.pixels = _pixels(tensor, section, limits)
    return call


def parse_header(header: bytes, max_values: int) -> InferRequest:
    """The JSON header as an `InferRequest` (every field within the limits in `service.schemas.v2`), or
    InvalidParameter naming what is wrong; PayloadTooLarge, before any parsing, past `max_values` JSON values.

    The values are counted by their separating commas first, and the arrays by their opening brackets: the parse
    costs about 80 bytes and 0.25 us per value, so a body of short numbers ("0,0,0,...": 8M values in 16 MiB)
    would take 640 MiB and 2 s of the event loop, and one of nested lists ("[[[[0]]]],...", which any depth
    of `data` may be) as much per list."""
    if not header or header.isspace():
        raise InvalidParameter("empty body: send an inference request as JSON")
    text = np.frombuffer(header, np.uint8)
    values = int(np.count_nonzero(text == ord(","))) + int(np.count_nonzero(text == ord("[")))  # 1 ms per 10 MB
    if values >= max_values:  # refused before the parse, which costs per value
        raise PayloadTooLarge(f"request body holds up to {values + 1} JSON values and arrays; the limit is "
                              f"{max_values}")
    try:
        return InferRequest.model_validate_json(header)
    except ValidationError as e:
        raise InvalidParameter(validation_problems(e)) from None


def requested_outputs(parameters: dict | None,
                      named: Sequence[tuple[str, dict | None]] | None) -> list[OutputRequest]:
    """What to send back: the outputs named (in their order), or all; binary per output, or for every output
    with the request's `binary_data_output` (an output's own `binary_data` wins)."""
    all_binary = _parameter(parameters, "binary_data_output", bool) or False
    named = named if named is not None else [(name, None) for name in OUTPUT_NAMES]
    if len({name for name, _ in named}) != len(named):
        raise InvalidParameter("outputs: an output is named more than once")
    chosen = []
    for i, (name, output_parameters) in enumerate(named):
        where = f"outputs.{i}"
        binary = _parameter(output_parameters, "binary_data", bool, where)
        count = _parameter(output_parameters, "classification", int, where) or 0
        if count < 0:
            raise InvalidParameter(f"{where}.parameters.classification must be at least 0, got {count}")
        chosen.append(OutputRequest(name, all_binary if binary is None else binary, count))
    return chosen


def _read_request_parameters(parameters: dict, call: ParsedInferRequest) -> None:
    resize = _parameter(parameters, "resize", str)
    if resize is not None and resize not in RESIZE_POLICIES:
        raise InvalidParameter(f"parameters.resize must be one of {', '.join(RESIZE_POLICIES)}, got {resize[:32]!r}")
    call.resize = cast(ResizePolicy, resize or "fit")
    timeout_us = _parameter(parameters, "timeout", int)
    if timeout_us is not None:  # 0 is no timeout, as in Triton (TRITONSERVER_InferenceRequestSetTimeoutMicroseconds)
        if timeout_us < 0:
            raise InvalidParameter(f"parameters.timeout is in microseconds and must be at least 0, got {timeout_us}")
        call.timeout_s = timeout_us / 1e6 if timeout_us else None
    target = parameters.get("target")
    if target is not None and type(target) not in (int, str):
        raise InvalidParameter(f"parameters.target must be a class index or label, got {target!r:.40}")
    call.target = target
    call.max_tokens = _parameter(parameters, "max_tokens", int)
    if call.max_tokens is not None and not 1 <= call.max_tokens <= MAX_TOKENS:
        raise InvalidParameter(f"parameters.max_tokens must be from 1 to {MAX_TOKENS}, got {call.max_tokens}")
    degrade = _parameter(parameters, "degrade", str)
    if degrade is not None and degrade not in DEGRADE_POLICIES:
        raise InvalidParameter(f"parameters.degrade must be one of {', '.join(DEGRADE_POLICIES)}, "
                               f"got {degrade[:32]!r}")
    call.degrade = degrade != "never"
    known = {"resize", "timeout", "binary_data_output", "target", "max_tokens", "degrade"}
    call.extra = {k: v for k, v in parameters.items() if k not in known}  # e.g. priority: accepted, not used


def _parameter(parameters: dict | None, key: str, kind: type, where: str = ""):
    """`parameters[key]` if present, checked to be of `kind` (a bool is not an int here); `where` names what the
    parameters belong to (a tensor, `inputs.0`; none for the request's own)."""
    if not parameters or key not in parameters:
        return None
    value = parameters[key]
    if type(value) is not kind:
        place = f"{where}.parameters.{key}" if where else f"parameters.{key}"
        raise InvalidParameter(f"{place} must be {_KIND_NAMES[kind]}, got {value!r:.40}")
    return value


_KIND_NAMES = {bool: "a boolean", int: "an integer", str: "a string"}


def _pixels(tensor, section: memoryview | None, limits: ProtocolLimits) -> np.ndarray:
    """`pixel_values` as (B, C, H, W) float32 from JSON data or its binary section: the shape checked against the
    model before the values are read. FP32: normalised pixels, checked for range (before the count: a value out of
    range is the clearer message). UINT8: raw 0-255 pixels, normalised here with the model's mean and std (a
    client that has pixels sends a quarter of FP32's bytes and no codec)."""
    if tensor.datatype not in ("FP32", "UINT8"):
        raise InvalidParameter(f"inputs.0 ({INPUT_NAME}) must have datatype FP32 (normalised) or UINT8 (raw "
                               f"pixels), got {tensor.datatype}")
    _check_geometry(tensor.shape, limits)
    count, raw = int(np.prod(tensor.shape)), tensor.datatype == "UINT8"
    if section is not None:
        width = 1 if raw else 4
        if len(section) != count * width:
            # the binary section (HTTP's binary_data_size, gRPC's raw_input_contents): named for both transports
            raise InvalidParameter(f"inputs.0 has {len(section)} bytes of binary data; shape {tensor.shape} of "
                                   f"{tensor.datatype} needs {count * width}")
        values = np.frombuffer(section, dtype=np.uint8 if raw else "<f4")
    else:
        values = _json_numbers(tensor.data)
        _check_uint8_range(values) if raw else _check_pixel_range(values)
        if values.size != count:
            raise InvalidParameter(f"inputs.0.data has {values.size} values; shape {tensor.shape} needs {count}")
    if raw:
        return normalize_pixels(values.astype(np.uint8).reshape(tensor.shape), list(limits.mean), list(limits.std))
    if section is not None:
        _check_pixel_range(values)
    return values.astype(np.float32).reshape(tensor.shape)


def _check_uint8_range(values: np.ndarray) -> None:
    """JSON UINT8 values are whole numbers in 0-255 (binary ones are bytes: nothing to check)."""
    wrong = ~((values >= 0) & (values <= 255) & (values == np.floor(values)))  # NaN compares false: wrong too
    if wrong.any():
        i = int(wrong.argmax())
        raise InvalidParameter(f"inputs.0.data: value {i} (row-major) is {values[i]:g}, not a UINT8 pixel (a whole "
                               f"number from 0 to 255)")


def _check_geometry(shape: list[int], limits: ProtocolLimits) -> None:
    """(B, C, H, W) against the model: its channels, patch multiples, and the batch and token limits."""
    if len(shape) != 4:
        raise InvalidParameter(f"inputs.0.shape must be [batch, channels, height, width], got {shape}")
    batch, channels, height, width = shape
    p = limits.patch_size
    if channels != limits.channels or height % p or width % p:
        raise InvalidParameter(f"inputs.0.shape must have {limits.channels} channels and height/width multiples of "
                               f"{p}; got {shape}")
    if batch > limits.max_batch or (height // p) * (width // p) > limits.max_tokens:
        raise InvalidParameter(f"inputs.0.shape {shape}: at most {limits.max_batch} images of at most "
                               f"{limits.max_tokens} patches")


def _json_numbers(data: list) -> np.ndarray:
    """JSON `data` (flat or nested, row-major) as a flat float64 array."""
    if data and _first_leaf(data).__class__ is str:
        raise InvalidParameter("inputs.0.data: FP32 values must be numbers, not strings")
    try:
        return np.asarray(data, dtype=np.float64).ravel()
    except ValueError:  # nested lists of different lengths: read in row-major order, as Triton reads them
        return np.asarray(flatten_deep_data(data), dtype=np.float64)


def _check_pixel_range(values: np.ndarray) -> None:
    """Normalised pixels lie within a few units of zero; NaN, infinities and huge values are no image (and near
    float32's limit they overflow the model's arithmetic: a client's mistake, then a 500)."""
    outside = ~(np.abs(values) <= MAX_ABS_PIXEL_VALUE)  # NaN compares false: outside too
    if outside.any():
        i = int(outside.argmax())
        raise InvalidParameter(f"inputs.0.data: value {i} (row-major) is {values[i]:g}, outside the range of "
                               f"normalised pixels (finite, magnitude at most {MAX_ABS_PIXEL_VALUE:g})")


def _images(tensor, section: memoryview | None, limits: ProtocolLimits) -> list[bytes]:
    """`image`: B encoded images, shape [B] or [B, 1], from binary BYTES or base64 JSON strings."""
    if tensor.datatype != "BYTES":
        raise InvalidParameter(f"inputs.0 ({IMAGE_INPUT_NAME}) must have datatype BYTES, got {tensor.datatype}")
    if len(tensor.shape) > 2 or (len(tensor.shape) == 2 and tensor.shape[1] != 1):
        raise InvalidParameter(f"inputs.0.shape must be [batch] or [batch, 1] (one image per item), got "
                               f"{tensor.shape}")
    count = tensor.shape[0]
    if count > limits.max_batch:
        raise PayloadTooLarge(f"inputs.0 holds {count} images; the limit is {limits.max_batch} per request")
    if section is not None:
        try:
            return unpack_bytes(section, count, limits.max_image_bytes)
        except ElementTooLarge as e:
            raise PayloadTooLarge(f"inputs.0: {e}") from None
        except BinaryFormatError as e:
            raise InvalidParameter(f"inputs.0: {e}") from None
    strings = flatten_deep_data(tensor.data)  # flat already when nested deeper than [B, 1]: then a copy
    if len(strings) != count or not all(isinstance(s, str) for s in strings):
        raise InvalidParameter(f"inputs.0.data must hold {count} base64 strings (one image each) for shape "
                               f"{tensor.shape}")
    return [_base64_image(s, i, limits.max_image_bytes) for i, s in enumerate(strings)]


def _base64_image(text: str, index: int, max_bytes: int) -> bytes:
    too_large = PayloadTooLarge(f"inputs.0.data.{index}: the image is over {max_bytes} bytes")
    if len(text) > (max_bytes + 2) // 3 * 4:  # the encoding of max_bytes: refused before decoding
        raise too_large
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidParameter(f"inputs.0.data.{index}: not base64 (in JSON, BYTES images are base64 strings; "
                               f"or send them binary with parameters.binary_data_size)") from None
    if len(data) > max_bytes:
        raise too_large
    return data


def _first_leaf(data):
    while isinstance(data, list) and data:
        data = data[0]
    return data


def classify(values: np.ndarray, count: int, labels: list[str] | None) -> np.ndarray:
    """The classification extension, as Triton does it: (B, ...) output values, each item flattened ->
    (B, min(count, its size)) strings `"value:index:label"` (`"value:index"` without labels), highest value
    first (ties: lower index first), the value printed with six decimals (C's %f)."""
    flat = values.reshape(len(values), -1)  # (B, K)
    k = min(count, flat.shape[1])
    order = np.argsort(-flat, axis=1, kind="stable")[:, :k]  # (B, k)
    name = (lambda i: f":{labels[i]}") if labels else (lambda i: "")
    return np.array([[f"{row[i]:f}:{i}{name(i)}" for i in best] for row, best in zip(flat, order)],
                    dtype=object).reshape(len(values), k)


def output_arrays(call: ParsedInferRequest, tensors: dict[str, np.ndarray], labels: list[str]):
    """(requested output, array, datatype) for each output the call asked for, in its order: the model's FP32
    tensor, or its classification strings (BYTES)."""
    for wanted in call.outputs:
        array, datatype = tensors[wanted.name], "FP32"
        if wanted.class_count:
            named = labels if wanted.name == LABELLED_OUTPUT else None
            array, datatype = classify(array, wanted.class_count, named), "BYTES"
        yield wanted, array, datatype


def raw_bytes(array: np.ndarray, datatype: str) -> bytes:
    """A tensor's bytes as the binary extension and gRPC's raw contents carry them: little-endian FP32, or BYTES
    elements each after its 4-byte length."""
    return pack_bytes(array.ravel()) if datatype == "BYTES" else tensor_bytes(array, datatype)


def encode_response(call: ParsedInferRequest, model_name: str, model_version: str, tensors: dict[str, np.ndarray],
                    labels: list[str], parameters: dict | None = None) -> tuple[bytes, dict[str, str]]:
    """The response body and its framing headers: the requested outputs, each as JSON `data` or as binary bytes
    after the JSON (with `binary_data_size`); `id` only when the request had one; the response's `parameters`
    when given (the token budget used: `budget_parameters`)."""
    outputs, sections = [], []
    for wanted, array, datatype in output_arrays(call, tensors, labels):
        entry = {"name": wanted.name, "datatype": datatype, "shape": list(array.shape)}
        if wanted.binary:
            data = raw_bytes(array, datatype)
            entry["parameters"] = {"binary_data_size": len(data)}
            sections.append(data)
        else:
            entry["data"] = array.ravel().tolist()
        outputs.append(entry)
    header = {**({"id": call.id} if call.id else {}), "model_name": model_name, "model_version": model_version,
              **({"parameters": parameters} if parameters else {}), "outputs": outputs}
    return join_body(header, sections)


def validation_problems(error: ValidationError, shown: int = 3) -> str:
    """The first few problems as `where: what` (`body` for the document itself). A tensor's `data` is one of
    several list depths, and each depth that does not fit reports an error: only the one that got furthest into
    the data is kept (the others fail at its first element)."""
    places: dict[tuple, tuple[tuple, tuple, str]] = {}  # where -> (rank, index into data, message)
    for e in error.errors(include_url=False, include_input=False):
        loc = e["loc"]
        in_data = len(loc) > 3 and loc[0] == "inputs" and loc[2] == "data"  # then loc[3] names the list depth
        place, index = (loc[:3], loc[4:]) if in_data else (loc, ())
        # data nested past the union's depths: its own error (service.schemas.v2.flatten_deep_data) says more
        rank = (e["type"] == DEEP_DATA_ERROR, index)
        if place not in places or rank > places[place][0]:
            places[place] = (rank, index, _json_message(e["msg"]))
    lines = [f"{_dotted(place + index)}: {msg}" for place, (_, index, msg) in places.items()]
    return "; ".join(lines[:shown]) + (f" (and {len(lines) - shown} more)" if len(lines) > shown else "")


def _json_message(message: str) -> str:
    """The JSON parser's own message, and for a document it stopped reading at its depth limit, what ours is."""
    if "recursion limit exceeded" not in message:
        return message
    return f"{message} (a tensor's data may nest at most {MAX_DATA_DEPTH} lists deep)"


def _dotted(loc: tuple) -> str:
    """`inputs.0.data.5`; a part the client named (a parameter's key) is cut short, never echoed whole."""
    return ".".join(str(p) if len(str(p)) <= 32 else f"{str(p)[:29]}..." for p in loc) or "body"
