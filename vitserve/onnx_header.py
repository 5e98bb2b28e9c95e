"""Read an ONNX file's opset and `metadata_props` without the `onnx` package or a session.

A ModelProto is a protobuf message; its top-level `opset_import` (field 8) and `metadata_props` (field 14)
are small, and everything else (the graph, with the weights) is one length-delimited field this reader
seeks past. So checking that a multi-gigabyte file is a vitserve model costs a few reads, and the serving
image, which has no `onnx`, can refuse a foreign file before paying for an ONNX Runtime session.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from vitserve.artifact import ArtifactError, ModelInfo, read_inspection

_OPSET_IMPORT, _METADATA_PROPS = 8, 14
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


@dataclass
class ModelFileHeader:
    opset: int | None  # the default (ai.onnx) domain's version
    metadata: dict[str, str]


def read_header(path: str | Path) -> ModelFileHeader:
    """The file's default-domain opset and metadata; anything that is not a well-formed ModelProto is an
    ArtifactError."""
    path = Path(path)
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.onnx"))
        hint = f"; it holds {', '.join(inside[:5])}: give the file, e.g. {path / inside[0]}" if inside else \
            "; give the .onnx file that `vitserve export` wrote"
        raise ArtifactError(f"{path} is a directory, not a model file{hint}")
    if not path.is_file():
        raise ArtifactError(f"model file not found: {path}")
    size = path.stat().st_size
    if size == 0:
        raise ArtifactError(f"model file is empty: {path}")
    opset: int | None = None
    metadata: dict[str, str] = {}
    with open(path, "rb") as f:
        while (key := _read_varint(f)) is not None:
            number, wire = key >> 3, key & 7
            if wire == _VARINT:
                _read_varint(f)
            elif wire == _LENGTH_DELIMITED:
                length = _read_varint(f)
                if length is None or f.tell() + length > size:
                    raise ArtifactError(f"{path} is not an ONNX model (truncated or corrupt protobuf)")
                if number == _OPSET_IMPORT:
                    fields = _parse_flat_message(f.read(length))
                    if _bytes_field(fields, 1) in (b"", b"ai.onnx"):
                        opset = _number_field(fields, 2)
                elif number == _METADATA_PROPS:
                    fields = _parse_flat_message(f.read(length))
                    metadata[_bytes_field(fields, 1).decode()] = _bytes_field(fields, 2).decode()
                else:
                    f.seek(length, 1)
            elif wire in (_FIXED64, _FIXED32):
                f.seek(8 if wire == _FIXED64 else 4, 1)
            else:
                raise ArtifactError(f"{path} is not an ONNX model (wire type {wire} at offset {f.tell()})")
    return ModelFileHeader(opset, metadata)


def read_model_info(path: str | Path) -> ModelInfo:
    """The artifact's ModelInfo straight from the file: cheap, no session, no `onnx`."""
    header = read_header(path)
    return ModelInfo.from_metadata(header.metadata, header.opset)


def read_stored_inspection(path: str | Path) -> dict | None:
    """The paper's Figure 7 numbers `vitserve export` stored in the file, or None when it stored none."""
    return read_inspection(read_header(path).metadata)


def _read_varint(f: BinaryIO) -> int | None:
    result, shift = 0, 0
    while True:
        byte = f.read(1)
        if not byte:
            return None
        result |= (byte[0] & 0x7F) << shift
        if not byte[0] & 0x80:
            return result
        shift += 7
        if shift > 63:
            raise ArtifactError("not an ONNX model (malformed varint)")


def _parse_flat_message(buf: bytes) -> dict[int, bytes | int]:
    """A message of varint and length-delimited fields only -> {field number: value}."""
    f = io.BytesIO(buf)
    fields: dict[int, bytes | int] = {}
    while (key := _read_varint(f)) is not None:
        wire = key & 7
        if wire not in (_VARINT, _LENGTH_DELIMITED):
            raise ArtifactError("not an ONNX model (unexpected field in a small message)")
        value = _read_varint(f)  # the number itself, or the length of the bytes that follow
        if value is None:
            raise ArtifactError("not an ONNX model (truncated small message)")
        fields[key >> 3] = value if wire == _VARINT else f.read(value)
    return fields


def _bytes_field(fields: dict[int, bytes | int], number: int) -> bytes:
    """A length-delimited field's bytes, b"" when absent (protobuf's default)."""
    value = fields.get(number, b"")
    if isinstance(value, int):
        raise ArtifactError(f"not an ONNX model (field {number} is a number where a string belongs)")
    return value


def _number_field(fields: dict[int, bytes | int], number: int) -> int | None:
    """A varint field's value, None when absent."""
    value = fields.get(number)
    if isinstance(value, bytes):
        raise ArtifactError(f"not an ONNX model (field {number} is a string where a number belongs)")
    return value
