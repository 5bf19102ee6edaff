"""One process serving it all: the serving loop and the gRPC front end over one engine,
and their graceful shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from .config import ServeConfig
from .engine.engine import DraftEngine
from .front_end import SERVICE_NAME, FrontEnd
from .security import TokenSource
from .serving.loop import ServingLoop
from .telemetry import Telemetry

__all__ = ["SERVICE_NAME", "DrafterServer"]

# How long the Propose calls already queued when the grace period ends may take to be
# answered before the gRPC server stops.
ANSWER_QUEUED_S = 5.0


class DrafterServer:
    """The engine served on `config`'s addresses, as `config` says (the serving loop's and
    the front end's options), not yet started; `port` is the TCP port it is bound to.

    `credentials` (e.g. `security.server_credentials(...)`) serves over TLS instead of
    plaintext; `tokens` (a `security.TokenSource` or the accepted tokens) makes every
    call but the health service's carry `authorization: Bearer <token>` metadata.
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
        self.front_end = FrontEnd(
            self.serving, config, telemetry, credentials=credentials, tokens=tokens
        )
        self.port = self.front_end.port

    async def start(self) -> None:
        self.serving.start()
        await self.front_end.start()

    async def drain(self, grace: float) -> int:
        """The graceful shutdown: new states are refused and health answers NOT_SERVING;
        live states may go on for up to `grace` seconds (or until none is left); then new
        Propose calls are refused, the queued ones answered, the gRPC server stopped,
        every state freed and the telemetry flushed. Returns how many states were still
        live (and freed) at the end."""
        await self.serving.stop_taking_states()
        await self.front_end.enter_graceful_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        await self.serving.states_gone(grace)
        # Grace is over: refuse new Propose calls, answer the ones already taken,
        # then close the connections (a taken request is never left unanswered).
        await self.serving.answer_queued(ANSWER_QUEUED_S)
        # Half a second at least: time to write the answers just given.
        await self.front_end.stop(max(0.5, min(1.0, deadline - loop.time())))
        freed = await self.serving.close()
        self.telemetry.shutdown()
        return freed
