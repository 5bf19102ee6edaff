"""The serving loop: the engine as the servicer calls it, from the event loop.

`ServingLoop` runs each engine call on the engine's worker thread (runner.py), every
Propose's Step through the batching scheduler (scheduler.py), reaps expired leases and
keeps a Prefill's or an import's chunks together, rolled back when the stream breaks.
Calls come in and results go out as the engine's types: the servicer converts them
from and to the wire's messages. The server (server.py) starts it and, to shut down,
takes its steps in turn (`stop_taking_states`, `states_gone`, `answer_queued`,
`close`) between its own on the gRPC server.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ..engine import errors
from ..engine.engine import DraftEngine, PrefillSession
from ..engine.kv_transfer import KVChunk, KVHeader, KVImport
from ..engine.sampling import GREEDY, Sampling
from ..engine.step import Step, StepResult
from ..engine.types import EngineInfo, PrefillChunk, RowCount, TakenKV, Verdict
from ..grammar.spec import GrammarSpec
from ..telemetry import Telemetry
from .runner import EngineRunner
from .scheduler import ProposeScheduler

if TYPE_CHECKING:
    from ..config import ServeConfig

log = logging.getLogger("mtpdraft.backend")
_Session = TypeVar("_Session", PrefillSession, KVImport)


@dataclass
class ServerInfo:
    """GetInfo's answer, less what the servicer adds."""

    engine: EngineInfo
    queued_calls: int
    batch_size_counts: dict[int, int]  # requests per batch -> batches run


class ServingLoop:
    """The engine in this process: its worker thread, the scheduler (its options
    `config`'s) and the lease reaper, with the engine's metrics recorded by `telemetry`."""

    def __init__(self, engine: DraftEngine, config: ServeConfig, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.engine = engine
        self.runner = EngineRunner()
        self.scheduler = ProposeScheduler(
            engine,
            self.runner,
            config,
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

    async def alloc_state(
        self, owner: str, sampling: Sampling = GREEDY, grammar: GrammarSpec | None = None
    ) -> int:
        compiled = None
        if grammar is not None:  # compiled on a thread of its own: the engine's goes on
            compiled = await asyncio.to_thread(self.engine.grammars.compile, grammar)
        return await self.runner.call(self.engine.alloc_state, owner, sampling, compiled)

    def propose(
        self, step: Step, timeout: float | None, caller: object
    ) -> asyncio.Future[StepResult]:
        """Queues one call's step; the future holds its rows' results once their batch
        ran, and cancelling it takes the call out of the queue. `caller`: the call's
        span context (Telemetry.span_context), which its batch's span links. A step whose
        rows give grammars is queued once they are compiled, off the engine's thread."""
        if all(c is None or c.resolved for c in step.grammars):
            return self.scheduler.enqueue(step, timeout, caller)
        return asyncio.ensure_future(self._compiled_then_queued(step, timeout, caller))

    async def _compiled_then_queued(
        self, step: Step, timeout: float | None, caller: object
    ) -> StepResult:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.to_thread(self.engine.grammars.compile_changes, step.grammars)
        if timeout is not None:  # the compilation took part of the call's time
            timeout = max(timeout - (loop.time() - started), 0.0)
        return await self.scheduler.enqueue(step, timeout, caller)

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
                    if chunk.header.grammar is not None:  # compiled off the engine's thread
                        await asyncio.to_thread(
                            self.engine.grammars.compile_held, chunk.header.grammar
                        )
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
        period = min(max(self.engine.config.state_ttl / 4, 0.05), 1.0)
        while True:
            await asyncio.sleep(period)
            states, handles = await self.runner.call(self.engine.reap_expired)
            if states or handles:
                log.info("lease expired: freed %d states and %d KV handles", states, handles)

    async def stop_taking_states(self) -> None:
        """New states are refused (UNAVAILABLE) from now on; live ones go on."""
        await self.runner.call(setattr, self.engine, "draining", True)

    async def states_gone(self, timeout: float) -> None:
        """Waits (at most `timeout` seconds) until no state is live."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline and self.engine.states:
            await asyncio.sleep(0.05)

    async def answer_queued(self, timeout: float) -> None:
        """New Propose calls are refused from now on; those already queued are answered
        (waiting at most `timeout` seconds)."""
        self.scheduler.closing = True
        await self.scheduler.settle(timeout)

    async def close(self) -> int:
        """Stops the scheduler and the reaper, frees every state; returns how many were live."""
        if self._reaper is not None:
            self._reaper.cancel()
        await self.scheduler.stop()
        freed = await self.runner.call(self.engine.close)
        self.runner.shutdown()
        return freed
