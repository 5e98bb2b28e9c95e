"""Keys on HTTP (service/usecases/keys.py): the repository API needs the admin key (`--admin-key`); with
`--api-key`, the inference and model routes need that key too. Health, metrics, the web page's files and the
docs stay open (probes and scrapers carry no key).
"""
from __future__ import annotations

from fastapi import Request

from vitserve.service.schemas.paths import PROTOCOL_ROOT
from vitserve.service.usecases.keys import check_authorization, check_repository_access

OPEN_PROTOCOL_PATHS = frozenset({PROTOCOL_ROOT, PROTOCOL_ROOT + "/health/live", PROTOCOL_ROOT + "/health/ready"})


# The dependencies are coroutines: FastAPI runs a plain function dependency in its thread pool, a thread hop on
# every request for a dictionary lookup.
async def require_api_key(request: Request) -> None:
    """Dependency of the inference and model routes (health and the server's metadata excepted)."""
    key = request.app.state.service.settings.api_key
    if key is None or request.scope["path"] in OPEN_PROTOCOL_PATHS:  # not request.url: it builds the whole URL
        return
    check_authorization(request.headers.get("authorization"), key, "this route")


async def require_admin_key(request: Request) -> None:
    """Dependency of the repository API's index."""
    check_repository_access(request.app.state.service.settings, request.headers.get("authorization"),
                            changes=False)


async def require_explicit_control(request: Request) -> None:
    """Load and unload: only in explicit mode (in poll mode the repository's files decide, as in Triton)."""
    check_repository_access(request.app.state.service.settings, request.headers.get("authorization"),
                            changes=True)
