"""The gRPC front end: grpcio's asyncio server on the HTTP worker's own event loop, beside uvicorn, over the same
serving state (one engine, one admission, one set of metrics per process).

Every HTTP worker listens on the gRPC port with SO_REUSEPORT, so the kernel spreads gRPC connections over the
workers as uvicorn's shared socket spreads HTTP ones; `vitserve serve` checks first that no other program holds
the port (service.cli.port_is_free), since SO_REUSEPORT would otherwise share it silently with another server of
the same user.

Limits, set on the server's channel: a message at most the binary body limit (grpcio refuses a larger one with
RESOURCE_EXHAUSTED from its length prefix, before reading it), `grpc_max_concurrent_streams` calls open on one
connection, `grpc_max_metadata_bytes` of metadata per call, and idle connections closed after a while.
Compressed requests are inflated by grpcio within the message limit; answers are compressed only with
`grpc_response_compression` (servicer.compress_answer bounds their size).
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from vitserve.service.ground.settings import Settings
from vitserve.service.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from vitserve.service.grpc.servicer import RESPONSE_COMPRESSIONS, InferenceServicer
from vitserve.service.usecases.state import ServiceState

log = logging.getLogger("vitserve.grpc")

MESSAGE_OVERHEAD_BYTES = 64 * 1024  # a ModelInferRequest's fields around its raw tensor
IDLE_CONNECTION_MS = 5 * 60 * 1000


def server_options(settings: Settings) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", settings.max_binary_body_bytes + MESSAGE_OVERHEAD_BYTES),
            ("grpc.max_send_message_length", -1),  # answers are bounded by what was asked
            ("grpc.max_concurrent_streams", settings.grpc_max_concurrent_streams),
            ("grpc.max_metadata_size", settings.grpc_max_metadata_bytes),
            ("grpc.max_connection_idle_ms", IDLE_CONNECTION_MS),
            ("grpc.so_reuseport", 1)]


def listen_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """TLS from the server's certificate and key (and with ssl_ca_certs, clients' certificates required), or None
    for plain text."""
    if settings.ssl_certfile is None:
        return None
    assert settings.ssl_keyfile is not None, "Settings take ssl_certfile and ssl_keyfile together"
    chain, key = settings.ssl_certfile.read_bytes(), settings.ssl_keyfile.read_bytes()
    authorities = settings.ssl_ca_certs.read_bytes() if settings.ssl_ca_certs else None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=authorities,
                                       require_client_auth=authorities is not None)


class GrpcFrontEnd:
    """The gRPC server of one process: started after the serving state, stopped (new calls refused, admitted
    ones given the drain time) when the drain begins, and closed before the state."""

    def __init__(self, state: ServiceState):
        self.state = state
        self.server: grpc.aio.Server | None = None
        self._drain: asyncio.Task | None = None

    async def start(self) -> None:
        s = self.state.settings
        self.server = grpc.aio.server(options=server_options(s),
                                      compression=RESPONSE_COMPRESSIONS[s.grpc_response_compression])
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(self.state), self.server)
        address = listen_address(s.host, s.grpc_port)
        credentials = server_credentials(s)
        if credentials is None:
            self.server.add_insecure_port(address)
        else:
            self.server.add_secure_port(address, credentials)
        await self.server.start()
        self._drain = asyncio.create_task(self._stop_when_draining(self.server))
        # debug: every HTTP worker starts one, and `vitserve serve`'s first line already names the gRPC port
        log.debug("gRPC (Open Inference Protocol) on %s%s", address, " with TLS" if credentials else "")

    async def _stop_when_draining(self, server: grpc.aio.Server) -> None:
        await self.state.drain.begun.wait()
        await server.stop(grace=self.state.settings.drain_timeout_s)

    async def stop(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.cancel()
        if self.server is not None:
            await self.server.stop(grace=self.state.settings.drain_timeout_s)
