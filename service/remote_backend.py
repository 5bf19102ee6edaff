"""A front-end process's backend: every call forwarded to the engine process over a link.

Calls are told apart by an id; the answer (a result, or the engine error to raise
again here) comes back with it. A Propose's requests are read and checked here
(wire_values.py) and cross as plain values. A call cancelled here (the client
went away) sends a cancel, so that the engine drops it too. Should the engine
process go, every open call fails with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from typing import Any

from mtpdraft.v1 import drafter_pb2 as pb

from .engine import errors
from .engine.types import JobTiming, Proposal, RowCount, ServerInfo, TakenKV
from .link import Link, Message
from .wire_values import read_proposes

# What an answer's error is: (class name in engine.errors, message, reason, field),
# the class name None for an unexpected failure.
ErrorValue = tuple[str | None, str, str, str | None]


def error_value(err: BaseException) -> ErrorValue:
    if isinstance(err, errors.DrafterError):
        return type(err).__name__, err.message, err.reason, err.field
    return None, f"internal error: {type(err).__name__}: {err}", "INTERNAL", None


def rebuild_error(value: ErrorValue) -> Exception:
    name, message, reason, field = value
    if name is None:
        return RuntimeError(message)
    return getattr(errors, name)(message, reason=reason, field=field)


def mapped(source: asyncio.Future, fn: Callable[[Any], Any]) -> asyncio.Future:
    """A future of `fn` of `source`'s result (its exception as it is); cancelling either
    cancels the other."""
    out = asyncio.get_running_loop().create_future()

    def settle(done: asyncio.Future) -> None:
        if out.done():
            return
        if done.cancelled():
            out.cancel()
        elif (err := done.exception()) is not None:
            out.set_exception(err)
        else:
            out.set_result(fn(done.result()))

    source.add_done_callback(settle)
    out.add_done_callback(lambda _: source.cancel())
    return out


class RemoteBackend:
    """The DraftBackend of a front end. `on_control` gets the engine process's other
    messages (drain, stop); `on_lost` is called once the link is gone."""

    def __init__(self, on_control: Callable[[Message], None], on_lost: Callable[[], None]) -> None:
        self.on_control, self.on_lost = on_control, on_lost
        self._link: Link | None = None
        self._ids = itertools.count(1)
        self._open: dict[int, tuple[asyncio.Future, JobTiming | None]] = {}
        self._credits: dict[int, asyncio.Semaphore] = {}  # open Prefill -> chunks it may send

    async def connect(self, path: str) -> asyncio.Task:
        """Connects to the engine process; the task returned reads its messages."""
        self._link = await Link.connect(path, self._received)
        return asyncio.create_task(self._run())

    async def _run(self) -> None:
        assert self._link is not None
        try:
            await self._link.run()
        finally:
            gone = errors.Unavailable("the engine process is gone", reason="ENGINE_GONE")
            for future, _ in self._open.values():
                if not future.done():
                    future.set_exception(gone)
            self._open.clear()
            self.on_lost()

    def send(self, message: Message) -> None:
        assert self._link is not None
        self._link.send(message)

    def _received(self, message: Message) -> None:
        kind = message[0]
        if kind == "more":
            if (credit := self._credits.get(message[1])) is not None:
                credit.release()
            return
        if kind not in ("ok", "err"):
            self.on_control(message)
            return
        entry = self._open.pop(message[1], None)
        if entry is None or entry[0].done():
            return
        future, timing = entry
        if kind == "err":
            future.set_exception(rebuild_error(message[2]))
            return
        if timing is not None:  # the queue wait starts when this process sent the call
            (timing.started_ns, timing.done_ns, timing.batch_requests, timing.batch_jobs) = message[
                3
            ]
        future.set_result(message[2])

    def _open_call(self, timing: JobTiming | None = None) -> tuple[int, asyncio.Future]:
        call, future = next(self._ids), asyncio.get_running_loop().create_future()
        self._open[call] = (future, timing)
        future.add_done_callback(partial(self._closed, call))
        return call, future

    def _closed(self, call: int, future: asyncio.Future) -> None:
        if future.cancelled() and self._open.pop(call, None) is not None:
            self.send(("cancel", call))

    async def _call(self, method: str, *args):
        call, future = self._open_call()
        self.send(("call", call, method, args))
        return await future

    # ---- DraftBackend ------------------------------------------------------

    async def info(self) -> ServerInfo:
        return await self._call("info")

    async def alloc_state(self, owner: str) -> int:
        return await self._call("alloc_state", owner)

    def propose(
        self, requests: Sequence[pb.ProposeRequest], timeout: float | None, batch: bool = False
    ) -> tuple[asyncio.Future[list[Proposal]], JobTiming]:
        # A malformed request goes no further; the engine process takes the NaN/inf flags.
        read = read_proposes(requests, batch, flag_finite=True)
        timing = JobTiming(time.time_ns())
        call, future = self._open_call(timing)
        self.send(("propose", call, read, timeout))
        return future, timing

    def propose_columns(
        self, request: pb.ColumnsRequest, timeout: float | None
    ) -> tuple[asyncio.Future[list], JobTiming]:
        # The step crosses as its message: the engine process reads it into tensors.
        timing = JobTiming(time.time_ns())
        call, future = self._open_call(timing)
        self.send(("columns", call, request, timeout))
        # A failed row's error crosses as its value (see error_value).
        rows = mapped(
            future, lambda got: [rebuild_error(r) if type(r) is tuple else r for r in got]
        )
        return rows, timing

    async def after_verify(self, request: pb.AfterVerifyRequest) -> RowCount:
        return await self._call("after_verify", request)

    async def take_kv(self, state_id: int) -> TakenKV:
        return await self._call("take_kv", state_id)

    async def install_kv(self, state_id: int, handle_id: int) -> RowCount:
        return await self._call("install_kv", state_id, handle_id)

    async def free_state(self, state_id: int) -> bool:
        return await self._call("free_state", state_id)

    async def prefill(self, chunks: AsyncIterator[pb.PrefillChunk]) -> RowCount:
        call, future = self._open_call()
        # Flow control: past the first, a chunk leaves only once the engine asks for
        # more (it does each time it waits for one), so that a fast client has at most
        # two chunks held here or there, as gRPC's flow control holds them in one process.
        self._credits[call] = credit = asyncio.Semaphore(1)
        future.add_done_callback(lambda _: credit.release())  # no waiting on a done call
        self.send(("prefill", call))
        try:
            async for chunk in chunks:
                await credit.acquire()
                if future.done():  # refused already: the rest of the stream is moot
                    break
                self.send(("chunk", call, chunk))
            else:
                self.send(("end", call))
            return await future
        finally:
            del self._credits[call]
            if not future.done():  # cancelled, or the request stream broke: roll back
                future.cancel()
