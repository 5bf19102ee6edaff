"""`mtpdraft serve ARGV` built in this process, as the command builds it; an engine held busy.

The command parses its flags into a ServeConfig, builds the engine
(`cli.build_engine`) and the server around it (`cli.build_server`) from it and
starts it; `CliServer` does the same,
with the event loop on a thread of its own, so that a test can reach into the
engine and the scheduler of the server it talks to. Cheaper than a subprocess
(no second torch import), for the flags whose effect lives in those builders.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Coroutine
from typing import Any

from mtpdraft.service import cli
from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.telemetry import Telemetry


def serve_args(*argv: str) -> ServeConfig:
    """`mtpdraft serve ARGV`'s configuration, parsed by the command's own parser."""
    return cli.parse_serve(argv)


class CliServer:
    """The server of `mtpdraft serve --port 0 --device cpu ARGV`, started; `stop()` drains it."""

    def __init__(self, *argv: str, telemetry: Telemetry | None = None) -> None:
        self.config = serve_args("--port", "0", "--device", "cpu", *argv)
        self.engine = cli.build_engine(self.config)
        self._switch_interval = sys.getswitchinterval()  # build_server sets the process's
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

        async def start():
            server = cli.build_server(self.config, self.engine, telemetry or Telemetry())
            await server.start()
            return server

        self.server = self.run(start())
        self.address = f"{self.config.host}:{self.server.port}"

    @property
    def scheduler(self):
        return self.server.serving.scheduler

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        try:
            self.run(self.server.drain(0))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            sys.setswitchinterval(self._switch_interval)


def hold_the_engine(engine: DraftEngine) -> tuple[threading.Event, threading.Event]:
    """Makes the engine's next batched forward wait until `release` is set (60 s at most):
    returns (entered, release). Calls that come meanwhile stay queued."""
    entered, release = threading.Event(), threading.Event()
    forward = engine.step

    def held(step):
        entered.set()
        release.wait(60)
        return forward(step)

    engine.step = held
    return entered, release
