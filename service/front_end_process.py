"""A gRPC front-end process: serves the Drafter service on the shared port, forwarding
every call to the engine process (split_server.py starts it)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass

from .front_end import FrontEnd
from .link import Message
from .remote_backend import RemoteBackend
from .security import TokenSource, server_credentials
from .telemetry import Telemetry, providers_from_env

log = logging.getLogger("mtpdraft.front_end")


@dataclass
class FrontEndSpec:
    """What a front end needs to start, as plain values (it crosses a process spawn)."""

    socket_path: str
    address: str
    max_message_bytes: int
    reflection_enabled: bool = True
    max_inflight: int | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_token_file: str | None = None
    # Makes the front end's telemetry (a module-level function, for the spawn); by
    # default the OTEL_* variables choose, as in the engine process.
    telemetry: Callable[[], Telemetry] | None = None

    def security(self) -> dict:
        options: dict = {}
        if self.tls_cert:
            options["credentials"] = server_credentials(
                self.tls_cert, self.tls_key, self.tls_client_ca
            )
        if self.auth_token_file:
            options["tokens"] = TokenSource(path=self.auth_token_file)
        return options


def run(spec: FrontEndSpec) -> None:
    """The process's entry point. Signals are the engine process's to act on: it drains,
    then tells every front end when to stop (a terminal's Ctrl-C reaches them all)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    asyncio.run(_serve(spec))


async def _serve(spec: FrontEndSpec) -> None:
    stop = asyncio.Event()
    grace = 0.0
    front_end: FrontEnd | None = None
    tasks: list[asyncio.Future] = []

    def control(message: Message) -> None:
        nonlocal grace
        if message[0] == "drain" and front_end is not None:
            tasks.append(asyncio.ensure_future(front_end.enter_graceful_shutdown()))
        elif message[0] == "stop":
            grace = message[1]
            stop.set()

    def lost() -> None:
        if not stop.is_set():
            log.error("the engine process is gone: stopping")
        stop.set()

    backend = RemoteBackend(control, lost)
    reading = await backend.connect(spec.socket_path)
    telemetry = spec.telemetry() if spec.telemetry else Telemetry(*providers_from_env())
    front_end = FrontEnd(
        backend,
        spec.address,
        telemetry,
        max_message_bytes=spec.max_message_bytes,
        reflection_enabled=spec.reflection_enabled,
        max_inflight=spec.max_inflight,
        **spec.security(),
    )
    await front_end.start()
    backend.send(("ready", front_end.port))
    await stop.wait()
    await front_end.stop(grace)
    reading.cancel()
    # The calls the stop cut are still unwinding: let them end before asyncio.run
    # cancels whatever is left (grpc logs a handler it sees cancelled that way).
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=1.0)
    telemetry.shutdown()
