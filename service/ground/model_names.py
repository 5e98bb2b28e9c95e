"""What a model's name and version may be, written once for every front end (/v1's query and path parameters, /v2's
and gRPC's names, the repository's folders) and for routing.

Triton's names are free-form; ours must be safe as one path component and in a URL, a metric label and a log line:
letters, digits, '_', '-', '.', starting with a letter or digit (so never '.' or '..'). A name the repository cannot
hold is refused before routing where a transport bounds it (/v1's parameters, gRPC's names); /v2's paths reach
routing, which answers it as a model it does not serve (docs/open-inference-protocol.md).
"""
from __future__ import annotations

import re

from vitserve.service.ground.errors import InvalidModelName

MAX_NAME_CHARS = 64
# A version a client names: a repository's folder number, or a single file's version from its metadata. Triton's
# versions are int64, whose decimal form takes at most 20 characters.
MAX_VERSION_CHARS = 20
MODEL_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{MAX_NAME_CHARS - 1}}}")
# A repository's version folder: a positive whole number below 10**18, so that it fits any int64 reader
VERSION_NAME = re.compile(r"[1-9][0-9]{0,17}")


def is_model_name(name: str) -> bool:
    return MODEL_NAME.fullmatch(name) is not None and ".." not in name


def check_model_name(name: str) -> str:
    if not is_model_name(name):
        raise InvalidModelName(f"{name[:80]!r} is not a model name: 1-{MAX_NAME_CHARS} letters, digits, '_', '-' "
                               f"or '.', starting with a letter or digit")
    return name


def check_version(version: str) -> str:
    if not VERSION_NAME.fullmatch(version):
        raise InvalidModelName(f"{version[:40]!r} is not a version: a positive whole number")
    return version


def check_name_lengths(name: str, version: str) -> None:
    """A name and version a transport got with no bound of its own (gRPC's strings), held to the limits /v1's
    parameters declare before they reach routing."""
    if len(name) > MAX_NAME_CHARS or len(version) > MAX_VERSION_CHARS:
        raise InvalidModelName(f"model names are at most {MAX_NAME_CHARS} characters, versions at most "
                               f"{MAX_VERSION_CHARS}")
