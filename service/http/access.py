"""Keys: the repository API changes what the server runs, so it needs the admin key (`--admin-key`); with
`--api-key`, the inference and model routes need that key too. Health, metrics, the web page's files and the
docs stay open (probes and scrapers carry no key). Both are sent as `Authorization: Bearer KEY` and compared in
constant time. This is a shared secret, not identity: put TLS and OIDC in front (docs/repository.md).
"""
from __future__ import annotations

import hmac

from fastapi import Request
from pydantic import SecretStr

from service.core.errors import Forbidden, RepositoryControlDisabled, Unauthorized

MAX_KEY_CHARS = 512  # a longer Authorization header is wrong, and is not compared
OPEN_PROTOCOL_PATHS = frozenset({"/v2", "/v2/health/live", "/v2/health/ready"})


def check_bearer(request: Request, key: SecretStr | None, what: str) -> None:
    """Nothing when `key` is unset or the request carries it; Unauthorized (401) without credentials,
    Forbidden (403) with others."""
    if key is None:
        return
    header = request.headers.get("authorization")
    if not header:
        raise Unauthorized(f"{what} needs a key: send Authorization: Bearer KEY")
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > MAX_KEY_CHARS:
        raise Unauthorized(f"{what} needs a key: send Authorization: Bearer KEY")
    if not hmac.compare_digest(token.encode(), key.get_secret_value().encode()):
        raise Forbidden(f"the key sent does not open {what}")


# The dependencies are coroutines: FastAPI runs a plain function dependency in its thread pool, a thread hop on
# every request for a dictionary lookup.
async def require_api_key(request: Request) -> None:
    """Dependency of the inference and model routes (health and the server's metadata excepted)."""
    if request.url.path in OPEN_PROTOCOL_PATHS:
        return
    check_bearer(request, request.app.state.service.settings.api_key, "this route")


async def require_admin_key(request: Request) -> None:
    """Dependency of the repository API: on only with model_control_mode explicit (or poll, read-only), and then
    the admin key."""
    settings = request.app.state.service.settings
    if settings.model_control_mode == "none":
        raise RepositoryControlDisabled("the repository API is off: start the server with --model-repository DIR "
                                        "--model-control-mode explicit (or poll)")
    check_bearer(request, settings.admin_key, "the repository API")


async def require_explicit_control(request: Request) -> None:
    """Load and unload: only in explicit mode (in poll mode the repository's files decide, as in Triton)."""
    if request.app.state.service.settings.model_control_mode != "explicit":
        raise RepositoryControlDisabled("load and unload need --model-control-mode explicit (in poll mode the "
                                        "repository's files decide what is served)")
