"""Servers for the tests: `mtpdraft serve` in a subprocess, or a DrafterServer in-process."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

SERVER_START_TIMEOUT = 60.0
# The bound of a wait for something that comes at once on a healthy server: only a
# failure waits it out, so it can be generous on any machine, however slow or loaded.
PATIENCE = 120.0


@dataclass
class ServerProcess:
    process: subprocess.Popen
    address: str
    lines: list[str]

    def new_output(self) -> str:
        """What the server wrote since the last call, without waiting (its stdout made
        non-blocking first: os.set_blocking(process.stdout.fileno(), False))."""
        fd, chunks = self.process.stdout.fileno(), []
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")

    def stop(self, timeout: float = PATIENCE) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def start_server(model: Path, *extra: str) -> ServerProcess:
    """Starts `mtpdraft serve --port 0` and waits for the port it prints."""
    cmd = [sys.executable, "-m", "mtpdraft", "serve", "--model", str(model), "--port", "0"]
    cmd += ["--device", "cpu", *extra]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    for line in process.stdout:  # the server prints its port once it accepts calls
        lines.append(line)
        match = re.search(r"listening on (\S+):(\d+)", line)
        if match:
            return ServerProcess(process, f"127.0.0.1:{match.group(2)}", lines)
    process.wait()
    raise RuntimeError("server exited before listening:\n" + "".join(lines))


# Small blocks (4 rows) so that every test crosses block boundaries; 256 blocks
# = 1024 rows in all, enough for every test and small enough to exhaust on purpose.
SERVER_ARGS = ("--kv-blocks", "256", "--block-size", "4", "--max-drafts", "8")
SERVER_ARGS += ("--max-batch", "8", "--max-states", "32", "--grace-period", "2")


class InProcessServer:
    """A DrafterServer on loopback (a free port), its event loop on a background thread;
    `fields`: ServeConfig's."""

    def __init__(self, engine, *, telemetry=None, credentials=None, tokens=None, **fields) -> None:
        import asyncio
        import threading

        from mtpdraft.service.config import ServeConfig
        from mtpdraft.service.server import DrafterServer

        config = ServeConfig(port=0, **fields)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

        async def make():
            server = DrafterServer(
                engine, config, telemetry, credentials=credentials, tokens=tokens
            )
            await server.start()
            return server

        self.server = asyncio.run_coroutine_threadsafe(make(), self.loop).result(PATIENCE)
        self.address = f"127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.server.drain(0), self.loop).result(PATIENCE)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(PATIENCE)


def recording_tracer():
    """(a TracerProvider, the in-memory exporter that holds its finished spans at once)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def small_engine(checkpoint: Path, clock=None, **options):
    """An in-process engine on the test checkpoint, with the shared server's limits
    (`options`: ServeConfig's fields; `clock`: the engine's)."""
    from mtpdraft.service.config import ServeConfig
    from mtpdraft.service.engine.engine import DraftEngine
    from mtpdraft.service.model.checkpoint import load_mtp_weights
    from mtpdraft.service.model.mtp_head import MTPHead

    head = MTPHead(load_mtp_weights(checkpoint), torch.device("cpu"))
    limits = {"kv_blocks": 256, "block_size": 4, "max_drafts": 8, "max_batch": 8} | options
    timing = {} if clock is None else {"clock": clock}
    return DraftEngine(head, ServeConfig(**limits), **timing)


async def until(predicate, what: str) -> None:
    """Polls `predicate` on the event loop until it holds (failing after PATIENCE)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PATIENCE
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)
