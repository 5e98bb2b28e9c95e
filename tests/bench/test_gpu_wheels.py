"""bench/gpu_wheels.py's fatbin slimming on a hand-built fatbin (no ELF, no network, no download): only the
payloads an sm_90 device never loads are zeroed, and nothing moves."""
from __future__ import annotations

import struct
import zipfile

from vitserve.bench.gpu_wheels import (FLAG_ZSTD, KIND_ELF, KIND_PTX, parse_fatbin, record_hash, slim_fatbin,
                              slim_wheel)


def entry(kind: int, arch: int, payload: bytes, flags: int = 0) -> bytes:
    """A 64-byte entry header (kind, version, header size, padded size, compressed size at +16, arch at +28,
    flags at +40, uncompressed size at +56) and its payload padded to 8 bytes."""
    padded = payload + bytes(-len(payload) % 8)
    header = bytearray(64)
    struct.pack_into("<HHIQ", header, 0, kind, 0x0101, 64, len(padded))
    struct.pack_into("<I", header, 16, len(payload))
    struct.pack_into("<I", header, 28, arch)
    struct.pack_into("<Q", header, 40, flags)
    struct.pack_into("<Q", header, 56, len(payload))
    return bytes(header) + padded


def container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def test_only_the_sm80_payload_is_zeroed():
    sm80, sm90 = b"\x80" * 100, b"\x90" * 60
    fat = container(entry(KIND_ELF, 80, sm80, FLAG_ZSTD), entry(KIND_ELF, 90, sm90, FLAG_ZSTD))
    blob = bytearray(b"host code before" + fat + b"and after")
    original = bytes(blob)
    start, end = 16, 16 + len(fat)

    stats = slim_fatbin(blob, start, end)

    assert len(blob) == len(original)
    assert blob[:start] == original[:start] and blob[end:] == original[end:]
    (e80, e90), = parse_fatbin(blob, start, end)  # headers intact: still parses, same offsets and sizes
    assert (e80.arch, e80.padded_size, e90.arch, e90.padded_size) == (80, 104, 90, 64)
    assert bytes(blob[e80.payload]) == bytes(104)
    assert bytes(blob[e90.payload]) == sm90 + bytes(4)
    assert blob[e80.offset:e80.offset + 64] == original[e80.offset:e80.offset + 64]
    assert stats.entries == {(KIND_ELF, 80): 1, (KIND_ELF, 90): 1}
    assert stats.zeroed == {(KIND_ELF, 80): 1}


def test_ptx_stays_where_no_sm90_cubin_exists():
    """A kernel group without sm_90 SASS keeps the newest PTX the driver could JIT (arch <= 90), and only it."""
    fat = container(entry(KIND_ELF, 80, b"a" * 8), entry(KIND_PTX, 80, b"p" * 8), entry(KIND_PTX, 100, b"q" * 8)) \
        + container(entry(KIND_ELF, 90, b"s" * 8), entry(KIND_PTX, 90, b"t" * 8))
    blob = bytearray(fat)
    slim_fatbin(blob)
    (a, p, q), (s, t) = parse_fatbin(blob, 0, len(blob))
    assert [bytes(blob[x.payload]) for x in (a, p, q, s, t)] == [bytes(8), b"p" * 8, bytes(8), b"s" * 8, bytes(8)]


def test_slim_wheel_rewrites_record(tmp_path):
    """A wheel without fatbins comes out with the TensorRT library gone and RECORD matching every file."""
    src = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(src, "w") as z:
        z.writestr("pkg/__init__.py", "x = 1\n")
        z.writestr("pkg/capi/libonnxruntime_providers_tensorrt.so", b"\x7fELF")
        z.writestr("pkg-1.0.dist-info/RECORD", "stale\n")
    out = tmp_path / "out" / src.name
    out.parent.mkdir()
    slim_wheel(src, out, drop_llm=False)
    with zipfile.ZipFile(out) as z:
        assert "pkg/capi/libonnxruntime_providers_tensorrt.so" not in z.namelist()
        record = z.read("pkg-1.0.dist-info/RECORD").decode().splitlines()
        assert record == [f"pkg/__init__.py,{record_hash(b'x = 1' + bytes([10]))},6", "pkg-1.0.dist-info/RECORD,,"]
