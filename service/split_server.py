"""An engine process before several gRPC front-end processes, all on one port.

One grpc.aio process spends about 90 us of its event loop on each stream message
at 64 streams (H200, bench/results/service.md): 64 messages take 5.8 ms, more
than the 4.4 ms batched step itself, and a single loop cannot overlap them.
Here N front-end processes (front_end_process.py) share the port (SO_REUSEPORT:
the kernel spreads connections over them) and do the gRPC work in parallel; each
forwards its calls over a unix-socket link to this process, which runs the
engine and the scheduler and so still batches across every front end's clients.
The engine's metrics are recorded here, the RPCs' in the front ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import socket
import tempfile
from dataclasses import replace

from .backend import LocalBackend
from .backend_host import BackendHost
from .engine.engine import DraftEngine
from .engine.scheduler import DEFAULT_BATCH_WAIT_S
from .front_end_process import FrontEndSpec, run
from .link import Link, Message
from .telemetry import Telemetry

log = logging.getLogger("mtpdraft.engine_process")

# A spawned front end imports grpc, protobuf and OpenTelemetry afresh (no torch):
# well under a second each, in parallel; a loaded machine (CI) may take far longer.
START_TIMEOUT_S = 120.0


def _reserve_port(host: str) -> socket.socket:
    """A socket bound to a free port with SO_REUSEPORT, not listening: it keeps the port
    from being taken while the front ends bind it, and takes no connections itself."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    return sock


class SplitServer:
    """`front_ends` processes serving gRPC on `host:port` (0: a free port) before the
    engine in this process. `spec` gives the front ends' options; its socket_path
    and address are filled in here."""

    def __init__(
        self,
        engine: DraftEngine,
        host: str,
        port: int,
        front_ends: int,
        spec: FrontEndSpec,
        *,
        max_queue: int = 4096,
        batch_wait: float = DEFAULT_BATCH_WAIT_S,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.engine = engine
        self.backend = LocalBackend(engine, telemetry, max_queue=max_queue, batch_wait=batch_wait)
        self.host_name, self.port, self.front_ends, self.spec = host, port, front_ends, spec
        self.link_host = BackendHost(self.backend, self._control, self._lost)
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self._ready: set[Link] = set()
        self._changed = asyncio.Event()  # a front end became ready or went away
        self.gone = asyncio.Event()  # every front end has gone: nothing serves any more
        self._dir = tempfile.mkdtemp(prefix="mtpdraft-")  # mode 0700

    def _control(self, link: Link, message: Message) -> None:
        if message[0] == "ready":
            self._ready.add(link)
            self._changed.set()

    def _lost(self, link: Link) -> None:
        self._ready.discard(link)
        self._changed.set()
        if not self.link_host.calls:
            self.gone.set()

    async def start(self) -> None:
        socket_path = os.path.join(self._dir, "engine.sock")
        await self.link_host.listen(socket_path)
        self.backend.start()
        reserved = _reserve_port(self.host_name) if self.port == 0 else None
        if reserved is not None:
            self.port = reserved.getsockname()[1]
        spec = replace(self.spec, socket_path=socket_path, address=f"{self.host_name}:{self.port}")
        context = multiprocessing.get_context("spawn")  # no CUDA, loop or threads inherited
        try:
            for i in range(self.front_ends):
                process = context.Process(target=run, args=(spec,), name=f"mtpdraft-front-end-{i}")
                process.start()
                self.processes.append(process)
            await asyncio.wait_for(self._all_ready(), START_TIMEOUT_S)
        except BaseException:
            await self._stop_front_ends(0.0)
            raise
        finally:
            if reserved is not None:
                reserved.close()

    async def _all_ready(self) -> None:
        while len(self._ready) < self.front_ends:
            if any(not p.is_alive() for p in self.processes):
                raise RuntimeError("a front-end process exited while starting (see its log)")
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), 0.5)

    async def drain(self, grace: float) -> int:
        """As DrafterServer.drain, every front end taking part; returns the states freed."""
        freed = await self.backend.drain(grace, self)
        shutil.rmtree(self._dir, ignore_errors=True)
        return freed

    async def enter_graceful_shutdown(self) -> None:
        """Every front end's health answers NOT_SERVING from now on."""
        self.link_host.broadcast(("drain",))

    async def stop(self, grace: float) -> None:
        """Every front end stops (its calls given `grace` to end), then the links close."""
        await self._stop_front_ends(grace)
        await self.link_host.close()

    async def _stop_front_ends(self, grace: float) -> None:
        """Tells each front end to stop within `grace`; one still running 5 s later is killed."""
        self.link_host.broadcast(("stop", grace))
        loop = asyncio.get_running_loop()
        for process in self.processes:
            await loop.run_in_executor(None, process.join, grace + 5.0)
            if process.is_alive():
                log.error("front end %s did not stop: killing it", process.name)
                process.kill()
                await loop.run_in_executor(None, process.join)
