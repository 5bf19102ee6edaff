"""The gRPC side of the server: the Drafter service over the serving loop, health,
reflection, auth."""

from __future__ import annotations

import errno
import os
import socket
import stat
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from mtpdraft.v1 import drafter_pb2 as pb

from .security import TokenAuthInterceptor, TokenSource
from .servicer import DrafterServicer, add_library_service, add_to_server
from .telemetry import Telemetry
from .watchdog import EngineWatchdog

if TYPE_CHECKING:
    from .config import ServeConfig
    from .serving.loop import ServingLoop

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Drafter"].full_name
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
# How long a connection to a Unix socket file may take to tell whether a server accepts
# on it (a live one answers at once, even when busy).
UNIX_PROBE_S = 1.0


class ListenError(OSError):
    """An address the server cannot listen on, and why."""

    def __init__(self, address: str, why: str) -> None:
        super().__init__(f"cannot listen on {address}: {why}")
        self.address = address


def check_free(address: str) -> None:
    """Raises ListenError where another server listens on `address` ("host:port", or
    "unix:PATH") already. gRPC's own bind refuses a taken port too (SO_REUSEPORT off), but
    only logs why, and it replaces a Unix socket file whatever listens on it."""
    if address.startswith("unix:"):
        _check_unix_socket(address.removeprefix("unix:"), address)
    else:
        _check_port(address)


def _check_port(address: str) -> None:
    """A port some socket listens on (any of the host's addresses) is taken; port 0 never
    is. Other errors (an address not on this host) are left for gRPC's bind to report."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return
    try:
        found = socket.getaddrinfo(
            host.strip("[]") or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror:
        return
    for family, kind, proto, _, where in found:
        with socket.socket(family, kind, proto) as probe:
            # As gRPC's listener: a port whose connections linger in TIME_WAIT is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(where)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ListenError(address, "the port is in use (another server?)") from exc


def _check_unix_socket(path: str, address: str) -> None:
    """A socket file something accepts on is live and must not be replaced; a stale one
    (its server gone) may be, as gRPC does."""
    if not os.path.lexists(path):
        if not os.path.isdir(os.path.dirname(path) or "."):
            raise ListenError(address, "its folder does not exist")
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise ListenError(address, "the path exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(UNIX_PROBE_S)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return  # stale
        except TimeoutError:
            pass  # bound and listening, its backlog full: live
        except OSError as exc:
            raise ListenError(address, f"cannot tell whether a server uses it ({exc})") from exc
    raise ListenError(address, "a server accepts connections on this socket")


class FrontEnd:
    """A grpc.aio server bound to `config.address` (and to `config.unix_socket`, a path,
    if given), serving `serving`; not yet started.

    `credentials` (e.g. `security.server_credentials(...)`) serves over TLS instead of
    plaintext; `tokens` (a `security.TokenSource` or the accepted tokens) makes every
    call but the health service's carry `authorization: Bearer <token>` metadata.
    Health answers NOT_SERVING while the engine thread is stuck for
    `config.engine_stall_timeout` seconds (watchdog.py; 0: never).
    """

    def __init__(
        self,
        serving: ServingLoop,
        config: ServeConfig,
        telemetry: Telemetry,
        *,
        credentials: grpc.ServerCredentials | None = None,
        tokens: TokenSource | Sequence[str | bytes] | None = None,
    ) -> None:
        self.health = health.aio.HealthServicer()
        self.watchdog = EngineWatchdog(
            serving.runner, self.health, ("", SERVICE_NAME), config.engine_stall_timeout
        )
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
        self.server = grpc.aio.server(
            interceptors=interceptors,
            maximum_concurrent_rpcs=config.max_inflight,
            options=[
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.max_send_message_length", config.max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
        )
        servicer = DrafterServicer(serving, telemetry, config.max_message_bytes)
        add_to_server(servicer, self.server)
        add_library_service(HEALTH, self.health, self.server)
        if config.reflection:
            names = (SERVICE_NAME, HEALTH.full_name, reflection.SERVICE_NAME)
            add_library_service(REFLECTION, reflection.aio.ReflectionServicer(names), self.server)
        self.port = self._bind(config.address, credentials)
        if config.unix_socket is not None:
            self._bind(f"unix:{config.unix_socket}", credentials)

    def _bind(self, address: str, credentials: grpc.ServerCredentials | None) -> int:
        check_free(address)
        try:
            if credentials is None:
                port = self.server.add_insecure_port(address)
            else:
                port = self.server.add_secure_port(address, credentials)
        except RuntimeError:  # "Failed to bind to address ...": gRPC's log says why
            port = 0
        if port == 0:
            raise ListenError(address, "gRPC could not bind it (its log line says why)")
        return port

    async def start(self) -> None:
        await self.server.start()
        for service in self.watchdog.services:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.watchdog.start()

    async def enter_graceful_shutdown(self) -> None:
        """Health answers NOT_SERVING from now on; calls are still served."""
        await self.watchdog.stop()
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float) -> None:
        await self.watchdog.stop()
        await self.server.stop(grace)
