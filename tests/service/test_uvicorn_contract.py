"""The contract between service/http/connection.py (the one module that reaches inside uvicorn, because uvicorn has
no public way to bound a request's head or time its arrival) and the uvicorn installed: every method and attribute
it uses (`UVICORN_SURFACE`) exists on uvicorn's httptools protocol and request cycle, with the signatures it calls,
and the installed uvicorn is the version pyproject.toml pins. An upgrade that moves any of it fails here by name,
before test_http_protocol.py's sockets show it as a behaviour."""
from __future__ import annotations

import asyncio
import inspect
import re
import socket
import tomllib

import pytest
import uvicorn
from packaging.requirements import Requirement
from uvicorn.protocols.http import httptools_impl
from uvicorn.server import ServerState

from vitserve.service.http.connection import UVICORN_SURFACE, LimitedHttpToolsProtocol
from service_fixtures import REPO

pytestmark = pytest.mark.anyio


def test_the_installed_uvicorn_and_fastapi_are_the_pinned_ones():
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {Requirement(d).name: Requirement(d) for d in dependencies}
    import fastapi
    assert pins["uvicorn"].specifier.contains(uvicorn.__version__), (uvicorn.__version__, pins["uvicorn"])
    assert pins["fastapi"].specifier.contains(fastapi.__version__), (fastapi.__version__, pins["fastapi"])


def test_the_module_names_and_the_methods_it_overrides_or_calls_are_uvicorn_s():
    for name in UVICORN_SURFACE["module"]:
        assert hasattr(httptools_impl, name), name
    from uvicorn.protocols import utils
    from uvicorn.protocols.http import flow_control
    for name in UVICORN_SURFACE["utils"]:
        assert callable(getattr(utils, name, None)), name
    for name in UVICORN_SURFACE["flow_control"]:
        assert hasattr(flow_control, name), name
    for name in UVICORN_SURFACE["flow_methods"]:
        assert callable(getattr(flow_control.FlowControl, name, None)), name
    assert list(inspect.signature(flow_control.FlowControl.__init__).parameters) == ["self", "transport"]
    protocol, cycle = httptools_impl.HttpToolsProtocol, httptools_impl.RequestResponseCycle
    for name in UVICORN_SURFACE["protocol_methods"]:
        assert callable(getattr(protocol, name, None)), name
    for name in UVICORN_SURFACE["cycle_methods"]:
        assert callable(getattr(cycle, name, None)), name
    # the calls the adapter makes with arguments: the same parameters, in the same order
    assert list(inspect.signature(protocol.__init__).parameters) == ["self", "config", "server_state", "app_state",
                                                                     "_loop"]
    for name in ("on_header", "on_body", "data_received", "connection_lost", "send_400_response"):
        ours, theirs = (list(inspect.signature(getattr(k, name)).parameters) for k in (LimitedHttpToolsProtocol,
                                                                                        protocol))
        assert len(ours) == len(theirs), (name, ours, theirs)
    assert re.search(rb"^HTTP/1.1 408 ", httptools_impl.STATUS_LINE[408])


async def test_a_live_protocol_and_its_request_cycle_have_the_attributes_the_adapter_reads_and_sets():
    received = asyncio.Event()

    async def app(scope, receive, send):
        await receive()
        received.set()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    config = uvicorn.Config(app, http="httptools", log_level="warning", lifespan="off")
    config.load()
    loop = asyncio.get_running_loop()
    protocol = httptools_impl.HttpToolsProtocol(config, ServerState(), {}, loop)
    ours, theirs = socket.socketpair()
    try:
        await loop.connect_accepted_socket(lambda: protocol, ours)
        theirs.sendall(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n")
        for _ in range(200):
            if protocol.cycle is not None:
                break
            await asyncio.sleep(0.01)
        for name in UVICORN_SURFACE["protocol_attributes"]:
            assert hasattr(protocol, name), name
        assert hasattr(protocol.server_state, "default_headers")
        for name in UVICORN_SURFACE["cycle_attributes"]:
            assert hasattr(protocol.cycle, name), name
        theirs.sendall(b"ok")
        await asyncio.wait_for(received.wait(), 10)
    finally:
        theirs.close()
        protocol.transport.close()
