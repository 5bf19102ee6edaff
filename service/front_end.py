"""The gRPC side of the server: the Drafter service over the backend, health, reflection, auth."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mtpdraft.v1 import drafter_pb2 as pb

from .config import DEFAULTS
from .security import TokenAuthInterceptor, TokenSource
from .servicer import DrafterServicer, add_to_server
from .telemetry import Telemetry

if TYPE_CHECKING:
    from .backend import LocalBackend

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Drafter"].full_name


class FrontEnd:
    """A grpc.aio server bound to `address` (and to `unix_socket`, a path, if given),
    serving `backend`; not yet started.

    `credentials` (e.g. `security.server_credentials(...)`) serves over TLS instead of
    plaintext; `tokens` (a `security.TokenSource` or the accepted tokens) makes every
    call but the health service's carry `authorization: Bearer <token>` metadata.
    """

    def __init__(
        self,
        backend: LocalBackend,
        address: str,
        telemetry: Telemetry,
        *,
        max_message_bytes: int = DEFAULTS.max_message_bytes,
        reflection_enabled: bool = DEFAULTS.reflection,
        max_inflight: int | None = DEFAULTS.max_inflight,
        credentials: grpc.ServerCredentials | None = None,
        tokens: TokenSource | Sequence[str | bytes] | None = None,
        unix_socket: str | None = DEFAULTS.unix_socket,
    ) -> None:
        self.health = health.aio.HealthServicer()
        # Authentication first, so that an unauthenticated call is refused before any
        # other interceptor (telemetry's) or handler sees it.
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if tokens is not None:
            if not isinstance(tokens, TokenSource):
                tokens = TokenSource(tokens)
            interceptors.append(TokenAuthInterceptor(tokens))
        interceptors += telemetry.server_interceptors()
        # Past max_inflight concurrent RPCs (a stream counts as one) gRPC itself
        # answers RESOURCE_EXHAUSTED.
        self.server = grpc.aio.server(
            interceptors=interceptors,
            maximum_concurrent_rpcs=max_inflight,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
            ],
        )
        servicer = DrafterServicer(backend, telemetry, max_message_bytes)
        add_to_server(servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if reflection_enabled:
            names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
            reflection.enable_server_reflection((*names, reflection.SERVICE_NAME), self.server)
        self.port = self._bind(address, credentials)
        if unix_socket is not None:
            self._bind(f"unix:{unix_socket}", credentials)

    def _bind(self, address: str, credentials: grpc.ServerCredentials | None) -> int:
        if credentials is None:
            port = self.server.add_insecure_port(address)
        else:
            port = self.server.add_secure_port(address, credentials)
        if port == 0:
            raise OSError(f"could not bind {address}")
        return port

    async def start(self) -> None:
        await self.server.start()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    async def enter_graceful_shutdown(self) -> None:
        """Health answers NOT_SERVING from now on; calls are still served."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace)
