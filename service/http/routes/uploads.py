"""A request's I/O: its body (raw, or multipart `file` fields) within the byte limits and its call's deadline.

Byte limits hold however the body comes: a declared Content-Length over the limit is refused before any
byte is read, and a chunked body is counted as it streams in. A client that hangs up mid-upload is a
`ClientDisconnected` (499 in logs and metrics), never a server error.
"""
from __future__ import annotations

import time
import zlib

from fastapi import Request
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from vitserve.service.ground.errors import (
    ClientDisconnected,
    InvalidParameter,
    PayloadTooLarge,
    RequestTimeout,
    ServiceError,
    UnsupportedMediaType,
)
from vitserve.service.usecases.pipeline import Call
from vitserve.service.usecases.preprocess import IMAGE_MEDIA_TYPES, MEDIA_TYPES

MULTIPART_OVERHEAD_BYTES = 64 * 1024  # boundaries and part headers on top of the files themselves


def image_body(several: bool, raw: bool = True) -> dict:
    """The OpenAPI requestBody of an image route: multipart `file` fields (one, or `several`), and with `raw` one
    image as the body with its media type."""
    binary = {"type": "string", "format": "binary"}
    file = {"type": "array", "items": binary} if several else binary
    multipart = {"multipart/form-data": {"schema": {"type": "object", "required": ["file"],
                                                    "properties": {"file": file}}}}
    raw_bodies = {t: {"schema": binary} for t in MEDIA_TYPES} if raw else {}
    return {"required": True, "content": {**multipart, **raw_bodies}}
_PART_TYPES = IMAGE_MEDIA_TYPES | {"application/octet-stream", ""}


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def _check_content_length(request: Request, limit: int) -> None:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")


async def read_raw_body(request: Request, limit: int) -> bytes:
    """The body, read as it streams in; stops reading as soon as it passes `limit` bytes."""
    _check_content_length(request, limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect as e:
        raise ClientDisconnected(f"client disconnected after {size} bytes of its body") from e
    return b"".join(chunks)


# Content-Encoding -> zlib's window bits: gzip's header and trailer, or zlib's ("deflate" in HTTP is the zlib
# format, RFC 9110 section 8.4.1.2; some clients send raw deflate, tried when the zlib header is missing).
_CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def decode_content(body: bytes, encoding: str, limit: int) -> bytes:
    """A body sent with `Content-Encoding` (gzip or deflate; identity), decompressed up to `limit` bytes: a small
    body that would expand past it (a compression bomb) is refused after `limit` bytes of output, not all."""
    coding = encoding.strip().lower()
    if coding in ("", "identity"):
        return body
    if coding not in _CODINGS:
        raise UnsupportedMediaType(f"Content-Encoding {encoding[:32]!r} is not supported; use gzip, deflate or none")
    try:
        return _inflate(body, _CODINGS[coding], limit)
    except zlib.error:
        if coding != "deflate":
            raise InvalidParameter(f"the body is not valid {coding} data") from None
    try:
        return _inflate(body, -zlib.MAX_WBITS, limit)
    except zlib.error:
        raise InvalidParameter("the body is not valid deflate data") from None


def _inflate(data: bytes, wbits: int, limit: int) -> bytes:
    out: list[bytes] = []
    rest = data
    while rest:  # a gzip body may hold several members, one after the other
        inflater = zlib.decompressobj(wbits)
        out.append(inflater.decompress(rest, limit + 1 - sum(map(len, out))))
        if sum(map(len, out)) > limit:
            raise PayloadTooLarge(f"the decompressed body exceeds the limit of {limit} bytes")
        if not inflater.eof:
            raise InvalidParameter("the compressed body is cut short")
        rest = inflater.unused_data
    return b"".join(out)


async def read_files(request: Request, *, max_bytes: int, max_files: int) -> list[bytes | ServiceError]:
    """Every `file` field of a multipart body, or the raw body as one file; a file over the byte limit
    (or not an image type) is returned as its error so that its neighbours still run."""
    kind = media_type(request)
    if kind in IMAGE_MEDIA_TYPES:
        return [await read_raw_body(request, max_bytes)]
    if kind != "multipart/form-data":
        raise UnsupportedMediaType(f"send an image (JPEG, PNG, WebP, BMP, GIF, TIFF) as the body or as multipart "
                                   f"field 'file'; got content type {kind or 'none'!r}")
    limit = max_files * max_bytes + MULTIPART_OVERHEAD_BYTES
    _check_content_length(request, limit)
    try:
        async with _counted(request, limit).form(max_files=max_files, max_fields=max_files) as form:
            uploads = form.getlist("file")
            if not uploads:
                raise InvalidParameter("multipart body has no 'file' field")
            return [await _upload_bytes(u, max_bytes) for u in uploads]
    except HTTPException as e:  # Starlette's multipart parser: too many files/fields, malformed body
        if "Too many files" in str(e.detail):
            raise PayloadTooLarge(f"at most {max_files} files per request") from e
        raise InvalidParameter(f"malformed multipart body: {e.detail}") from e
    except ClientDisconnect as e:
        raise ClientDisconnected("client disconnected during its multipart upload") from e


def _counted(request: Request, limit: int) -> Request:
    """The same request, its body counted as the multipart parser pulls it: a chunked body (no Content-Length)
    is refused as soon as it passes `limit`, before it fills a temporary file."""
    received = 0

    async def receive():
        nonlocal received
        message = await request.receive()
        received += len(message.get("body", b""))
        if received > limit:
            raise PayloadTooLarge(f"multipart body exceeds the limit of {limit} bytes")
        return message

    return Request(request.scope, receive)


async def _upload_bytes(upload, max_bytes: int) -> bytes | ServiceError:
    if not isinstance(upload, UploadFile):
        return InvalidParameter("field 'file' must be a file upload, not a text field")
    part_type = (upload.content_type or "").split(";")[0].strip().lower()
    if part_type not in _PART_TYPES:
        return UnsupportedMediaType(f"file {upload.filename!r} has content type {part_type!r}, not an image")
    if upload.size is not None and upload.size > max_bytes:
        return PayloadTooLarge(f"file {upload.filename!r} is {upload.size} bytes; the limit is {max_bytes}")
    return await upload.read()


async def upload_within(call: Call, reading):
    """`reading` (of the request's body) within the call's deadline: a slower upload is the client's (408)."""
    timeout = RequestTimeout("the upload did not finish within the request's deadline")
    started = time.perf_counter()
    body = await call.run(reading, on_timeout=timeout, watch=False)
    call.stages.append(("body", time.perf_counter() - started))
    return body
