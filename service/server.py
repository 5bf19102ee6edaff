"""One process serving it all: the gRPC server (the Drafter service, health, reflection,
auth) over the serving loop and its engine, and their graceful shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from mtpdraft.v1 import drafter_pb2 as pb

from . import addresses
from .config import ServeConfig
from .engine.engine import DraftEngine
from .security import TokenAuthInterceptor, TokenSource
from .servicer import DrafterServicer, add_library_service, add_to_server
from .serving.loop import ServingLoop
from .telemetry import Telemetry
from .watchdog import EngineWatchdog

__all__ = ["SERVICE_NAME", "DrafterServer"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Drafter"].full_name
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
# How long the Propose calls already queued when the grace period ends may take to be
# answered before the gRPC server stops.
ANSWER_QUEUED_S = 5.0


class DrafterServer:
    """The engine served on `config`'s addresses (`config.address`, and `config.unix_socket`,
    a path, if given), as `config` says, not yet started; `port` is the TCP port it is
    bound to.

    `credentials` (e.g. `security.server_credentials(...)`) serves over TLS instead of
    plaintext; `tokens` (a `security.TokenSource` or the accepted tokens) makes every
    call but the health service's carry `authorization: Bearer <token>` metadata.
    Health answers NOT_SERVING while the engine thread is stuck for
    `config.engine_stall_timeout` seconds (watchdog.py; 0: never).
    """

    def __init__(
        self,
        engine: DraftEngine,
        config: ServeConfig,
        telemetry: Telemetry | None = None,
        *,
        credentials: grpc.ServerCredentials | None = None,
        tokens: TokenSource | Sequence[str | bytes] | None = None,
    ) -> None:
        self.engine = engine
        self.telemetry = telemetry = telemetry or Telemetry()
        self.serving = ServingLoop(engine, config, telemetry)
        self.health = health.aio.HealthServicer()
        self.watchdog = EngineWatchdog(
            self.serving.runner, self.health, ("", SERVICE_NAME), config.engine_stall_timeout
        )
        self.grpc_server = _grpc_server(config, telemetry, tokens)
        servicer = DrafterServicer(self.serving, telemetry, config.max_message_bytes)
        add_to_server(servicer, self.grpc_server)
        add_library_service(HEALTH, self.health, self.grpc_server)
        if config.reflection:
            names = (SERVICE_NAME, HEALTH.full_name, reflection.SERVICE_NAME)
            servicer = reflection.aio.ReflectionServicer(names)
            add_library_service(REFLECTION, servicer, self.grpc_server)
        self.port = self._bind(config.address, credentials)
        if config.unix_socket is not None:
            self._bind(f"unix:{config.unix_socket}", credentials)

    def _bind(self, address: str, credentials: grpc.ServerCredentials | None) -> int:
        addresses.check_free(address)
        try:
            if credentials is None:
                port = self.grpc_server.add_insecure_port(address)
            else:
                port = self.grpc_server.add_secure_port(address, credentials)
        except RuntimeError:  # "Failed to bind to address ...": gRPC's log says why
            port = 0
        if port == 0:
            raise addresses.ListenError(address, "gRPC could not bind it (its log line says why)")
        return port

    async def start(self) -> None:
        self.serving.start()
        await self.grpc_server.start()
        for service in self.watchdog.services:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.watchdog.start()

    async def drain(self, grace: float) -> int:
        """The graceful shutdown: new states are refused and health answers NOT_SERVING;
        live states may go on for up to `grace` seconds (or until none is left); then new
        Propose calls are refused, the queued ones answered, the gRPC server stopped,
        every state freed and the telemetry flushed. Returns how many states were still
        live (and freed) at the end."""
        await self.serving.stop_taking_states()
        await self.watchdog.stop()
        await self.health.enter_graceful_shutdown()  # for good; calls are still served
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        await self.serving.states_gone(grace)
        # Grace is over: refuse new Propose calls, answer the ones already taken,
        # then close the connections (a taken request is never left unanswered).
        await self.serving.answer_queued(ANSWER_QUEUED_S)
        # Half a second at least: time to write the answers just given.
        await self.grpc_server.stop(max(0.5, min(1.0, deadline - loop.time())))
        freed = await self.serving.close()
        self.telemetry.shutdown()
        return freed


def _grpc_server(
    config: ServeConfig, telemetry: Telemetry, tokens: TokenSource | Sequence[str | bytes] | None
) -> grpc.aio.Server:
    """A grpc.aio server with no service yet: its interceptors and message limits."""
    # Authentication first, so that an unauthenticated call is refused before any
    # other interceptor (telemetry's) or handler sees it.
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if tokens is not None:
        if not isinstance(tokens, TokenSource):
            tokens = TokenSource(tokens)
        interceptors.append(TokenAuthInterceptor(tokens))
    interceptors += telemetry.server_interceptors()
    # Past max_inflight concurrent RPCs (a stream counts as one) gRPC itself
    # answers RESOURCE_EXHAUSTED. SO_REUSEPORT off: a second server on a port in use
    # must fail, not share the port and split the clients' calls (and states) with it.
    return grpc.aio.server(
        interceptors=interceptors,
        maximum_concurrent_rpcs=config.max_inflight,
        options=[
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
