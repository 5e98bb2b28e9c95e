"""The Open Inference Protocol's model repository extension, as Triton serves it
(docs/protocol/extension_model_repository.md): the index of every model and version with its state and reason,
and load / unload by name. Restricted: service/http/access.py.
"""
from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from vitserve.service.ground.errors import InvalidParameter
from vitserve.service.http.access import require_admin_key, require_explicit_control
from vitserve.service.http.dependencies import get_ready_state
from vitserve.service.http.errors import openapi_responses
from vitserve.service.schemas.paths import PROTOCOL_ROOT
from vitserve.service.usecases import control
from vitserve.service.usecases.state import ServiceState

router = APIRouter(prefix=PROTOCOL_ROOT + "/repository", tags=["model repository (v2)"],
                   dependencies=[Depends(require_admin_key)])

MAX_BODY_BYTES = 64 * 1024  # {"ready": true} or a load's parameters: small


def _errors(*codes: int) -> dict:
    return openapi_responses(*codes, protocol=True)


async def _json_body(request: Request) -> dict:
    """The optional JSON body of a repository request ({} when empty); a bad one is a 400. Counted as it streams
    in: more than MAX_BODY_BYTES is refused before the rest is read."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise InvalidParameter(f"a repository request's body is at most {MAX_BODY_BYTES} bytes")
    if not body.strip():
        return {}
    try:
        parsed = json.loads(body)
    except ValueError as e:
        raise InvalidParameter(f"the body is not JSON: {e}") from None
    except RecursionError:  # json's C scanner recurses per nesting level
        raise InvalidParameter("the body's JSON nests too deep") from None
    if not isinstance(parsed, dict):
        raise InvalidParameter("the body must be a JSON object")
    return parsed


@router.post("/index", responses=_errors(400, 401, 403, 503))
async def repository_index(request: Request, state: Annotated[ServiceState, Depends(get_ready_state)]) -> list[dict]:
    """Every model of the repository and every version known: `state` (READY, LOADING, UNLOADING, UNAVAILABLE)
    and `reason`. Body `{"ready": true}`: only the ready ones."""
    ready = (await _json_body(request)).get("ready", False)
    if not isinstance(ready, bool):
        raise InvalidParameter("`ready` must be true or false")
    entries = await control.index(state, ready_only=ready)
    return [{"name": e.name, **({"version": e.version, "state": e.state, "reason": e.reason} if e.version else
                                ({"state": e.state, "reason": e.reason} if e.state else {}))} for e in entries]


@router.post("/models/{name}/load", dependencies=[Depends(require_explicit_control)],
             responses=_errors(400, 401, 403, 404, 503))
async def load(name: str, request: Request, state: Annotated[ServiceState, Depends(get_ready_state)]) -> dict:
    """Load (or reload) model `name` as the repository and its version policy say: each new version is warmed up
    before any request is routed to it; versions the policy no longer names are then drained and unloaded. A
    load that fails answers 400 with the reason, and what was serving stays serving."""
    if (await _json_body(request)).get("parameters"):
        raise InvalidParameter("load parameters (a config override, model files) are not supported: the "
                               "repository's files and config.json say what is loaded")
    await control.load(state, name)
    return {}


@router.post("/models/{name}/unload", dependencies=[Depends(require_explicit_control)],
             responses=_errors(400, 401, 403, 404, 503))
async def unload(name: str, request: Request, state: Annotated[ServiceState, Depends(get_ready_state)]) -> dict:
    """Stop routing to every version of `name`, let the requests admitted to it finish, then free it."""
    await _json_body(request)
    await control.unload(state, name)
    return {}
