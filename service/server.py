"""The grpc.aio server: the Drafter service, health, reflection, leases and draining."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mtpdraft.v1 import drafter_pb2 as pb
from mtpdraft.v1 import drafter_pb2_grpc as pb_grpc

from .engine.engine import DraftEngine
from .engine.runner import EngineRunner
from .engine.scheduler import DEFAULT_BATCH_WAIT_S, ProposeScheduler
from .security import TokenAuthInterceptor, TokenSource
from .servicer import DrafterServicer
from .telemetry import Telemetry

log = logging.getLogger("mtpdraft.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Drafter"].full_name
# 16 MiB: room for a ProposeBatch of 64 states with bf16 hiddens of 4096 and a
# bitmask row each (64 x (8 KB + 19 KB) = 1.7 MB) and for Prefill chunks of a few
# MB, while one message can never take a large share of memory.
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20


class DrafterServer:
    """A started-or-not server around one engine. Use create_server() to make one.

    `credentials` (e.g. `security.server_credentials(...)`) serves over TLS instead of
    plaintext; `tokens` (a `security.TokenSource` or the accepted tokens) makes every
    call but the health service's carry `authorization: Bearer <token>` metadata.
    """

    def __init__(
        self,
        engine: DraftEngine,
        address: str,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        reflection_enabled: bool = True,
        max_queue: int = 4096,
        max_inflight: int | None = None,
        batch_wait: float = DEFAULT_BATCH_WAIT_S,
        telemetry: Telemetry | None = None,
        credentials: grpc.ServerCredentials | None = None,
        tokens: TokenSource | Sequence[str | bytes] | None = None,
    ) -> None:
        self.engine = engine
        self.runner = EngineRunner()
        self.telemetry = telemetry or Telemetry()
        self.health = health.aio.HealthServicer()
        # Authentication first, so that an unauthenticated call is refused before any
        # other interceptor (telemetry's) or handler sees it.
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if tokens is not None:
            if not isinstance(tokens, TokenSource):
                tokens = TokenSource(tokens)
            interceptors.append(TokenAuthInterceptor(tokens))
        interceptors += self.telemetry.server_interceptors()
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
        self.scheduler = ProposeScheduler(
            engine,
            self.runner,
            max_queue=max_queue,
            batch_wait=batch_wait,
            on_batch=lambda requests, _: self.telemetry.batch_size.record(requests),
        )
        self.telemetry.observe_engine(engine, lambda: self.scheduler.queued)
        servicer = DrafterServicer(
            engine, self.runner, self.scheduler, self.telemetry, max_message_bytes
        )
        pb_grpc.add_DrafterServicer_to_server(servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if reflection_enabled:
            names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
            reflection.enable_server_reflection((*names, reflection.SERVICE_NAME), self.server)
        if credentials is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, credentials)
        if self.port == 0:
            raise OSError(f"could not bind {address}")
        self._reaper: asyncio.Task | None = None

    async def start(self) -> None:
        await self.server.start()
        self.scheduler.start()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._reaper = asyncio.create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        # A quarter of the TTL keeps an expired state's overstay under 25%, and at
        # most a second apart so that short TTLs (tests) act promptly.
        period = min(max(self.engine.state_ttl / 4, 0.05), 1.0)
        while True:
            await asyncio.sleep(period)
            states, handles = await self.runner.call(self.engine.reap_expired)
            if states or handles:
                log.info("lease expired: freed %d states and %d KV handles", states, handles)

    async def drain(self, grace: float) -> int:
        """Stops taking new states, lets live ones finish for up to `grace` seconds, stops.

        Returns how many states were still live (and freed) at the end.
        """
        await self.runner.call(setattr, self.engine, "draining", True)
        await self.health.enter_graceful_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while loop.time() < deadline and self.engine.states:
            await asyncio.sleep(0.05)
        # Grace is over: refuse new Propose calls, answer the ones already taken,
        # then close the connections (a taken request is never left unanswered).
        self.scheduler.closing = True
        await self.scheduler.settle(timeout=5.0)
        # Half a second at least: time to write the answers just given.
        await self.server.stop(max(0.5, min(1.0, deadline - loop.time())))
        if self._reaper is not None:
            self._reaper.cancel()
        await self.scheduler.stop()
        freed = await self.runner.call(self.engine.close)
        self.runner.shutdown()
        self.telemetry.shutdown()
        return freed

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


def create_server(
    engine: DraftEngine, address: str = "127.0.0.1:0", **options
) -> tuple[DrafterServer, int]:
    """A server bound to `address` (port 0 picks a free one), not yet started."""
    server = DrafterServer(engine, address, **options)
    return server, server.port
