"""One process serving it all: the engine, its scheduler and the gRPC front end, with draining."""

from __future__ import annotations

from .config import DEFAULTS
from .engine.engine import DraftEngine
from .front_end import SERVICE_NAME, FrontEnd
from .serving.loop import ServingLoop
from .telemetry import Telemetry

__all__ = ["SERVICE_NAME", "DrafterServer", "create_server"]


class DrafterServer:
    """A started-or-not server around one engine. Use create_server() to make one.

    Takes FrontEnd's options (credentials, tokens, max_message_bytes,
    reflection_enabled, max_inflight) and the scheduler's (max_queue, batch_wait in
    seconds); those not given are `mtpdraft serve`'s defaults (config.py).
    """

    def __init__(
        self,
        engine: DraftEngine,
        address: str,
        *,
        max_queue: int = DEFAULTS.max_queue,
        batch_wait: float = DEFAULTS.batch_wait,
        telemetry: Telemetry | None = None,
        **front_end_options,
    ) -> None:
        self.engine = engine
        self.serving = ServingLoop(engine, telemetry, max_queue=max_queue, batch_wait=batch_wait)
        self.telemetry = self.serving.telemetry
        self.runner, self.scheduler = self.serving.runner, self.serving.scheduler
        self.front_end = FrontEnd(self.serving, address, self.telemetry, **front_end_options)
        self.port = self.front_end.port

    async def start(self) -> None:
        self.serving.start()
        await self.front_end.start()

    async def drain(self, grace: float) -> int:
        """Stops taking new states, lets live ones finish for up to `grace` seconds, stops.

        Returns how many states were still live (and freed) at the end.
        """
        return await self.serving.drain(grace, self.front_end)

    async def wait_for_termination(self) -> None:
        await self.front_end.server.wait_for_termination()


def create_server(
    engine: DraftEngine, address: str = "127.0.0.1:0", **options
) -> tuple[DrafterServer, int]:
    """A server bound to `address` (port 0 picks a free one), not yet started."""
    server = DrafterServer(engine, address, **options)
    return server, server.port
