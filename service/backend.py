"""What the servicer asks of the engine: one interface, served here or by another process.

`LocalBackend` runs the calls on an engine in this process (every engine call on
its worker thread, Propose calls through the batching scheduler).
`remote_backend.RemoteBackend` forwards the same calls to an engine process that
several gRPC front-end processes share. Requests come in as proto messages; a
Propose's are read and checked (`wire_values`) where they arrive, in the front-end
process when there is one, and reach the engine as tensors (`wire`). Results go
out as the engine's small dataclasses, which the servicer turns into responses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from mtpdraft.v1 import drafter_pb2 as pb

from . import wire
from .engine import errors
from .engine.columns import rows
from .engine.engine import DraftEngine, PrefillSession
from .engine.runner import EngineRunner
from .engine.scheduler import DEFAULT_BATCH_WAIT_S, ProposeScheduler
from .engine.types import (
    JobTiming,
    Proposal,
    RowCount,
    ServerInfo,
    TakenKV,
)
from .telemetry import Telemetry
from .wire_values import HIDDEN_DTYPES, RawPropose, read_proposes, read_verdict

log = logging.getLogger("mtpdraft.backend")


class Serving(Protocol):
    """What serves a backend over gRPC: one front end, or the processes of several."""

    async def enter_graceful_shutdown(self) -> None: ...

    async def stop(self, grace: float) -> None: ...


class DraftBackend(Protocol):
    async def info(self) -> ServerInfo: ...

    async def alloc_state(self, owner: str) -> int: ...

    async def prefill(self, chunks: AsyncIterator[pb.PrefillChunk]) -> RowCount: ...

    def propose(
        self, requests: Sequence[pb.ProposeRequest], timeout: float | None, batch: bool = False
    ) -> tuple[asyncio.Future[list[Proposal]], JobTiming]:
        """Queues one call's requests (`batch`: a ProposeBatch, whose errors name the
        request's index); the future holds the proposals once their batch ran, and
        cancelling it takes the call out of the queue."""
        ...

    def propose_columns(
        self, request: pb.ColumnsRequest, timeout: float | None
    ) -> tuple[asyncio.Future[list[Proposal | errors.DrafterError]], JobTiming]:
        """Queues a verifier's step (INVALID_ARGUMENT at once when its columns do not fit
        together); the future holds each row's proposal or error once their batch ran."""
        ...

    async def after_verify(self, request: pb.AfterVerifyRequest) -> RowCount: ...

    async def take_kv(self, state_id: int) -> TakenKV: ...

    async def install_kv(self, state_id: int, handle_id: int) -> RowCount: ...

    async def free_state(self, state_id: int) -> bool: ...


class LocalBackend:
    """The engine in this process: its worker thread, the scheduler and the lease reaper,
    with the engine's metrics recorded by `telemetry`."""

    def __init__(
        self,
        engine: DraftEngine,
        telemetry: Telemetry | None = None,
        *,
        max_queue: int = 4096,
        batch_wait: float = DEFAULT_BATCH_WAIT_S,
    ) -> None:
        self.telemetry = telemetry = telemetry or Telemetry()
        self.engine = engine
        self.runner = EngineRunner()
        self.scheduler = ProposeScheduler(
            engine,
            self.runner,
            max_queue=max_queue,
            batch_wait=batch_wait,
            on_batch=lambda requests, _: telemetry.batch_size.record(requests),
        )
        telemetry.observe_engine(engine, lambda: self.scheduler.queued)
        self._reaper: asyncio.Task | None = None

    # ---- the calls ---------------------------------------------------------

    async def info(self) -> ServerInfo:
        queued, batches = self.scheduler.queued, dict(self.scheduler.batch_sizes)
        engine = await self.runner.call(self.engine.info)
        return ServerInfo(engine, list(HIDDEN_DTYPES), queued, batches)

    async def alloc_state(self, owner: str) -> int:
        return await self.runner.call(self.engine.alloc_state, owner)

    def propose(
        self, requests: Sequence[pb.ProposeRequest], timeout: float | None, batch: bool = False
    ) -> tuple[asyncio.Future[list[Proposal]], JobTiming]:
        # No NaN/inf flags here: the engine thread checks the batch (see wire_values).
        return self.propose_read(read_proposes(requests, batch, flag_finite=False), timeout)

    def propose_read(
        self, requests: list[RawPropose], timeout: float | None
    ) -> tuple[asyncio.Future[list[Proposal]], JobTiming]:
        """As propose, the requests read already (by a front-end process)."""
        return self.scheduler.enqueue([wire.propose_args(r) for r in requests], timeout)

    def propose_columns(
        self, request: pb.ColumnsRequest, timeout: float | None
    ) -> tuple[asyncio.Future[list[Proposal | errors.DrafterError]], JobTiming]:
        hidden_size = self.engine.head.config.hidden_size
        requests = rows(wire.columns(request), hidden_size, self.engine.max_batch)
        return self.scheduler.enqueue(requests, timeout, apart=True)

    async def after_verify(self, request: pb.AfterVerifyRequest) -> RowCount:
        given = wire.verdict(read_verdict(request.verdict, "verdict", flag_finite=False))
        return await self.runner.call(self.engine.after_verify, request.state_id, given)

    async def take_kv(self, state_id: int) -> TakenKV:
        return await self.runner.call(self.engine.take_kv, state_id)

    async def install_kv(self, state_id: int, handle_id: int) -> RowCount:
        return await self.runner.call(self.engine.install_kv, state_id, handle_id)

    async def free_state(self, state_id: int) -> bool:
        return await self.runner.call(self.engine.free_state, state_id)

    async def prefill(self, chunks: AsyncIterator[pb.PrefillChunk]) -> RowCount:
        session: PrefillSession | None = None
        try:
            state_id = start = total = received = 0
            async for chunk in chunks:
                if session is None:
                    state_id, start = chunk.state_id, chunk.start_position
                    total = chunk.total_rows
                    session = await self._begin_prefill(state_id, start)
                elif chunk.state_id not in (0, state_id) or chunk.start_position not in (0, start):
                    raise errors.InvalidArgument(
                        "a later chunk names another state or start_position than the first",
                        reason="CHUNK_MISMATCH",
                        field="state_id",
                    )
                if chunk.HasField("hiddens") or chunk.tokens:
                    hiddens = wire.decode_hiddens(chunk.hiddens, "hiddens")
                    await self.runner.call(session.append, list(chunk.tokens), hiddens)
                    received += len(chunk.tokens)
            if session is None:
                raise errors.InvalidArgument(
                    "Prefill needs at least one chunk", reason="EMPTY_STREAM", field="state_id"
                )
            if total and received != total:
                raise errors.InvalidArgument(
                    f"the stream ended after {received} of its {total} rows",
                    reason="INCOMPLETE_PREFILL",
                    field="total_rows",
                )
            rows = await self.runner.call(session.finish)
            session = None
            return rows
        finally:
            if session is not None:  # error, cancellation or a broken stream: roll back
                self.runner.submit(session.abort)

    async def _begin_prefill(self, state_id: int, start: int) -> PrefillSession:
        """begin_prefill, aborted once it is done if this call is cancelled meanwhile."""
        begun = asyncio.ensure_future(self.runner.call(self.engine.begin_prefill, state_id, start))
        try:
            return await asyncio.shield(begun)
        except asyncio.CancelledError:

            def abort(done: asyncio.Future) -> None:
                if not done.cancelled() and done.exception() is None:
                    self.runner.submit(done.result().abort)

            begun.add_done_callback(abort)
            raise

    # ---- lifecycle ---------------------------------------------------------

    def start(self) -> None:
        self.scheduler.start()
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

    async def drain(self, grace: float, serving: Serving) -> int:
        """Stops taking new states, lets live ones finish for up to `grace` seconds, stops
        `serving` and the engine, flushes the telemetry. Returns how many states were
        still live (and freed)."""
        await self.runner.call(setattr, self.engine, "draining", True)
        await serving.enter_graceful_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while loop.time() < deadline and self.engine.states:
            await asyncio.sleep(0.05)
        # Grace is over: refuse new Propose calls, answer the ones already taken,
        # then close the connections (a taken request is never left unanswered).
        self.scheduler.closing = True
        await self.scheduler.settle(timeout=5.0)
        # Half a second at least: time to write the answers just given.
        await serving.stop(max(0.5, min(1.0, deadline - loop.time())))
        freed = await self.close()
        self.telemetry.shutdown()
        return freed

    async def close(self) -> int:
        """Stops the scheduler and the reaper, frees every state; returns how many were live."""
        if self._reaper is not None:
            self._reaper.cancel()
        await self.scheduler.stop()
        freed = await self.runner.call(self.engine.close)
        self.runner.shutdown()
        return freed
