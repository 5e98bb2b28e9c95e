"""Triton's gRPC messages (package `inference`) to and from the protocol's plain data: a `ModelInferRequest` is read
field by field into the same `ParsedInferRequest` a /v2 body makes (`checked_infer_request` holds /v2's limits for a
request no JSON parser has seen, then the one `build_infer_request` both share), its input's values always one binary
section (raw, or the typed contents packed as raw); the answers are the same dictionaries and models the /v2 routes
send, written as messages. No grpc here, and none of HTTP's request models: protobuf messages only.
"""
from __future__ import annotations

import numpy as np
from google.protobuf import json_format

from vitserve.service.ground.errors import InvalidParameter, PayloadTooLarge
from vitserve.service.grpc.generated import grpc_service_pb2 as pb
from vitserve.service.grpc.generated import model_config_pb2
from vitserve.service.schemas.binary_tensors import pack_bytes
from vitserve.service.schemas.inference_protocol import (
    ParsedInferRequest,
    ProtocolLimits,
    TensorInput,
    checked_infer_request,
    output_arrays,
    raw_bytes,
)
from vitserve.service.schemas.v2 import ModelMetadata

# The typed contents field each datatype travels in (InferTensorContents); the server reads these two.
CONTENTS_FIELDS = {"FP32": "fp32_contents", "UINT8": "uint_contents", "BYTES": "bytes_contents"}


def parameter_values(parameters) -> dict:
    """A protobuf map of InferParameter as plain values (bool, int, float, str)."""
    values = {}
    for key, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        values[key] = getattr(parameter, choice) if choice else None
    return values


def parsed_from_grpc(request: pb.ModelInferRequest, limits: ProtocolLimits) -> ParsedInferRequest:
    """The call a ModelInferRequest makes: its one input from `raw_input_contents` (as Triton's clients send it)
    or from the typed `contents`, validated as /v2 validates a request with binary tensors."""
    if len(request.inputs) != 1:
        raise InvalidParameter(f"inputs: send exactly one input (pixel_values or image), got {len(request.inputs)}")
    tensor = request.inputs[0]
    if request.raw_input_contents and len(request.raw_input_contents) != 1:
        raise InvalidParameter(f"raw_input_contents has {len(request.raw_input_contents)} entries for 1 input")
    typed = [field.name for field, _ in tensor.contents.ListFields()]
    if request.raw_input_contents and typed:
        raise InvalidParameter("inputs.0 has both contents and raw_input_contents; send one")
    if request.raw_input_contents:
        section = request.raw_input_contents[0]
    elif typed:
        section = _typed_section(tensor, typed, limits.max_json_values)
    else:
        raise InvalidParameter("inputs.0 has no contents and there is no raw_input_contents")
    tensor_in = TensorInput(tensor.name, tensor.datatype, list(tensor.shape))
    outputs = [(o.name, parameter_values(o.parameters)) for o in request.outputs] if request.outputs else None
    return checked_infer_request(request.id, parameter_values(request.parameters), tensor_in,
                                 parameter_values(tensor.parameters), memoryview(section), outputs, limits)


def _typed_section(tensor, typed: list[str], max_values: int) -> bytes:
    """Typed contents as the binary section the raw form would have carried. They are for small requests: their
    values are converted one by one on the event loop (a 64 MiB message of them would hold it for a second), so
    past `max_values` (the JSON body's limit, the same trade) they are refused for raw_input_contents."""
    wanted = CONTENTS_FIELDS.get(tensor.datatype)
    if wanted is None or typed != [wanted]:  # None: a datatype without typed contents
        raise InvalidParameter(f"inputs.0 ({tensor.datatype}) must carry its values in contents.{wanted}, "
                               f"got contents.{', contents.'.join(typed)}")
    count = len(getattr(tensor.contents, wanted))
    if count > max_values:
        raise PayloadTooLarge(f"inputs.0.contents.{wanted} holds {count} values; typed contents are for small "
                              f"requests (at most {max_values}): send the tensor in raw_input_contents")
    if tensor.datatype == "BYTES":
        return pack_bytes(tensor.contents.bytes_contents)
    if tensor.datatype == "UINT8":  # uint_contents is uint32 on the wire: a value over 255 is no pixel
        pixels = np.asarray(tensor.contents.uint_contents, dtype=np.int64)
        if pixels.size and pixels.max() > 255:
            raise InvalidParameter(f"inputs.0.contents.uint_contents: {int(pixels.max())} is not a UINT8 pixel "
                                   f"(0 to 255)")
        return pixels.astype(np.uint8).tobytes()
    return np.asarray(tensor.contents.fp32_contents, dtype="<f4").tobytes()


def infer_response(call: ParsedInferRequest, model_name: str, model_version: str, tensors: dict[str, np.ndarray],
                   labels: list[str], parameters: dict | None = None) -> pb.ModelInferResponse:
    """The outputs asked for, each as raw bytes (Triton's server sends every output so); the response's
    `parameters` (int or string values: the token budget used)."""
    response = pb.ModelInferResponse(model_name=model_name, model_version=model_version, id=call.id or "")
    for key, value in (parameters or {}).items():
        if isinstance(value, int):
            response.parameters[key].int64_param = value
        else:
            response.parameters[key].string_param = str(value)
    for wanted, array, datatype in output_arrays(call, tensors, labels):
        response.outputs.add(name=wanted.name, datatype=datatype, shape=array.shape)
        response.raw_output_contents.append(raw_bytes(array, datatype))
    return response


def metadata_response(metadata: ModelMetadata) -> pb.ModelMetadataResponse:
    return json_format.ParseDict(metadata.model_dump(), pb.ModelMetadataResponse())


def config_response(config: dict) -> pb.ModelConfigResponse:
    return pb.ModelConfigResponse(config=json_format.ParseDict(config, model_config_pb2.ModelConfig()))


def statistics_response(model_stats: list[dict]) -> pb.ModelStatisticsResponse:
    return json_format.ParseDict({"model_stats": model_stats}, pb.ModelStatisticsResponse())
