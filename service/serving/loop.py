"""The serving loop: the engine as the servicer calls it. `ServingLoop` runs each call on
the engine's worker thread (runner.py), Propose calls through the batching scheduler
(scheduler.py), and reaps expired leases.

Calls come in as the engine's types (the servicer reads the wire's messages into them
with `wire`) and results go out as the engine's types (a ProposeBatch step's as a
StepResult of columns), which the servicer turns into responses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..config import DEFAULTS
from ..engine import columns, errors
from ..engine.columns import Columns
from ..engine.engine import DraftEngine, PrefillSession
from ..engine.kv_transfer import KVChunk, KVHeader, KVImport
from ..engine.step import StepResult
from ..engine.types import (
    PrefillChunk,
    Proposal,
    ProposeArgs,
    RowCount,
    ServerInfo,
    TakenKV,
    Verdict,
)
from ..telemetry import Telemetry
from .runner import EngineRunner
from .scheduler import ProposeScheduler

if TYPE_CHECKING:
    from ..front_end import FrontEnd

log = logging.getLogger("mtpdraft.backend")
_Session = TypeVar("_Session", PrefillSession, KVImport)


class ServingLoop:
    """The engine in this process: its worker thread, the scheduler and the lease reaper,
    with the engine's metrics recorded by `telemetry`."""

    def __init__(
        self,
        engine: DraftEngine,
        telemetry: Telemetry | None = None,
        *,
        max_queue: int = DEFAULTS.max_queue,
        batch_wait: float = DEFAULTS.batch_wait,
    ) -> None:
        self.telemetry = telemetry = telemetry or Telemetry()
        self.engine = engine
        self.runner = EngineRunner()
        self.scheduler = ProposeScheduler(
            engine,
            self.runner,
            max_queue=max_queue,
            batch_wait=batch_wait,
            on_batch=telemetry.record_batch,
            # A GPU engine's step is short: a batch nobody else waits on may hold the loop.
            inline=engine.head.device.type == "cuda",
        )
        telemetry.observe_engine(engine, lambda: self.scheduler.queued)
        self._reaper: asyncio.Task | None = None

    # ---- the calls ---------------------------------------------------------

    async def info(self) -> ServerInfo:
        queued, batches = self.scheduler.queued, dict(self.scheduler.batch_sizes)
        engine = await self.runner.call(self.engine.info)
        return ServerInfo(engine, queued, batches)

    async def alloc_state(self, owner: str) -> int:
        return await self.runner.call(self.engine.alloc_state, owner)

    def propose(
        self, requests: list[ProposeArgs], timeout: float | None, caller: object
    ) -> asyncio.Future[list[Proposal]]:
        """Queues one call's requests; the future holds the proposals once their batch
        ran, and cancelling it takes the call out of the queue. `caller`: the call's
        span context (Telemetry.span_context), which its batch's span links."""
        return self.scheduler.enqueue(requests, timeout, tag=caller)

    def propose_batch(
        self, request: Columns, timeout: float | None, caller: object
    ) -> asyncio.Future[StepResult]:
        """Queues a verifier's step (INVALID_ARGUMENT at once when its columns do not fit
        together); the future holds its rows' results, as columns, once their batch ran."""
        c = self.engine.head.config
        step = columns.step(request, c.hidden_size, c.vocab_size, self.engine.max_batch)
        return self.scheduler.enqueue(step, timeout, apart=True, tag=caller)

    async def after_verify(self, state_id: int, verdict: Verdict) -> RowCount:
        return await self.runner.call(self.engine.after_verify, state_id, verdict)

    async def take_kv(self, state_id: int) -> TakenKV:
        return await self.runner.call(self.engine.take_kv, state_id)

    async def install_kv(self, state_id: int, handle_id: int) -> RowCount:
        return await self.runner.call(self.engine.install_kv, state_id, handle_id)

    async def free_state(self, state_id: int) -> bool:
        return await self.runner.call(self.engine.free_state, state_id)

    async def export_kv(
        self, handle_id: int, chunk_bytes: int, keep_handle: bool
    ) -> AsyncIterator[KVChunk]:
        """A handle's KV: the header with the first rows, then the rest, at most
        `chunk_bytes` of K and V a chunk (one row at least). The handle is freed once
        the last chunk is taken, unless `keep_handle`."""
        export = await self.runner.call(self.engine.export_kv, handle_id)
        h = export.header
        row_bytes = 2 * h.num_kv_heads * h.head_dim * h.dtype.itemsize
        step = max(1, chunk_bytes // row_bytes)
        header: KVHeader | None = h
        for first in range(0, max(h.num_rows, 1), step):
            k = v = None
            if h.num_rows:
                k, v = await self.runner.call(export.rows, first, step)
            yield KVChunk(header, first, k, v)
            header = None
        await self.runner.call(export.finish, keep_handle)

    async def import_kv(self, chunks: AsyncIterator[KVChunk]) -> RowCount:
        """Exported KV into the empty state the first chunk names; all or nothing."""
        session: KVImport | None = None
        try:
            state_id = 0
            async for chunk in chunks:
                if session is None:
                    if chunk.header is None:
                        raise errors.InvalidArgument(
                            "header: required on the first chunk",
                            reason="MISSING_FIELD",
                            field="header",
                        )
                    state_id = chunk.state_id
                    session = await self._opened(self.engine.import_kv, chunk)
                elif chunk.state_id not in (0, state_id) or chunk.header is not None:
                    raise errors.InvalidArgument(
                        "a later chunk names another state, or a header again",
                        reason="CHUNK_MISMATCH",
                        field="state_id",
                    )
                elif chunk.k is not None:
                    await self.runner.call(session.write, chunk.first_row, chunk.k, chunk.v)
            if session is None:
                raise errors.InvalidArgument(
                    "ImportKV needs at least one chunk", reason="EMPTY_STREAM", field="state_id"
                )
            rows = await self.runner.call(session.finish)
            session = None
            return rows
        finally:
            if session is not None:  # error, cancellation or a broken stream: roll back
                self.runner.submit(session.abort)

    async def prefill(self, chunks: AsyncIterator[PrefillChunk]) -> RowCount:
        session: PrefillSession | None = None
        try:
            state_id = start = total = received = 0
            async for chunk in chunks:
                if session is None:
                    state_id, start = chunk.state_id, chunk.start_position
                    total = chunk.total_rows
                    if total < 0:
                        raise errors.InvalidArgument(
                            f"total_rows: {total} is negative",
                            reason="BAD_SHAPE",
                            field="total_rows",
                        )
                    session = await self._opened(
                        self.engine.begin_prefill, state_id, start, chunk.tokens, chunk.hiddens
                    )
                elif chunk.state_id not in (0, state_id) or chunk.start_position not in (0, start):
                    raise errors.InvalidArgument(
                        "a later chunk names another state or start_position than the first",
                        reason="CHUNK_MISMATCH",
                        field="state_id",
                    )
                elif chunk.hiddens is not None:
                    await self.runner.call(session.append, chunk.tokens, chunk.hiddens)
                if chunk.hiddens is not None:
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

    async def _opened(self, begin: Callable[..., _Session], *args: Any) -> _Session:
        """A session `begin(*args)` opened (a Prefill's or an import's), aborted once it is
        open if this call is cancelled meanwhile."""
        begun = asyncio.ensure_future(self.runner.call(begin, *args))
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

    async def drain(self, grace: float, front_end: FrontEnd) -> int:
        """Stops taking new states, lets live ones finish for up to `grace` seconds, stops
        `front_end` and the engine, flushes the telemetry. Returns how many states were
        still live (and freed)."""
        await self.runner.call(setattr, self.engine, "draining", True)
        await front_end.enter_graceful_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while loop.time() < deadline and self.engine.states:
            await asyncio.sleep(0.05)
        # Grace is over: refuse new Propose calls, answer the ones already taken,
        # then close the connections (a taken request is never left unanswered).
        self.scheduler.closing = True
        await self.scheduler.settle(timeout=5.0)
        # Half a second at least: time to write the answers just given.
        await front_end.stop(max(0.5, min(1.0, deadline - loop.time())))
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
