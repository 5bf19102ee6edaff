"""The engine process's side of the links: serves a LocalBackend to the front ends.

A front end's calls arrive as messages (see remote_backend.py). Propose calls,
their requests read and checked already by the front end, go straight to the
scheduler from the reading callback, with no task per call, and their answers
leave from the job's done-callback; the other calls run as tasks.
When a front end's link closes (it stopped or died), everything it had open is
cancelled: queued Propose calls leave the queue and open Prefills roll back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial

from mtpdraft.v1 import drafter_pb2 as pb

from .backend import LocalBackend
from .engine.types import JobTiming
from .link import Link, Message
from .remote_backend import error_value, mapped
from .wire_values import RawPropose

log = logging.getLogger("mtpdraft.engine_process")

# The calls a front end may make by name (Propose and Prefill have messages of their own).
_CALLS = frozenset({"info", "alloc_state", "after_verify", "take_kv", "install_kv", "free_state"})


async def _until_end(queue: asyncio.Queue, ask_for_more: Callable[[], None]):
    """A Prefill's chunks as they come; asks the front end for each next one."""
    while True:
        if queue.empty():
            ask_for_more()
        if (chunk := await queue.get()) is None:
            return
        yield chunk


class _FrontEndCalls:
    """The calls open on one link."""

    def __init__(self, backend: LocalBackend, link: Link, on_control: Callable) -> None:
        self.backend, self.link, self.on_control = backend, link, on_control
        self.open: dict[int, asyncio.Future] = {}  # call -> its job future or task
        self.chunks: dict[int, asyncio.Queue] = {}  # open Prefill -> its chunks

    def received(self, message: Message) -> None:
        kind, call = message[0], message[1] if len(message) > 1 else None
        if kind == "propose":
            self._propose(call, *message[2:])
        elif kind == "columns":
            self._columns(call, *message[2:])
        elif kind == "call":
            if message[2] not in _CALLS:
                self._answer_error(call, NotImplementedError(message[2]))
                return
            self._track(call, asyncio.ensure_future(getattr(self.backend, message[2])(*message[3])))
        elif kind == "prefill":
            self.chunks[call] = queue = asyncio.Queue()
            chunks = _until_end(queue, partial(self.link.send, ("more", call)))
            self._track(call, asyncio.ensure_future(self.backend.prefill(chunks)))
        elif kind in ("chunk", "end"):
            if (queue := self.chunks.get(call)) is not None:  # else: answered already
                queue.put_nowait(message[2] if kind == "chunk" else None)
        elif kind == "cancel":
            self.chunks.pop(call, None)
            if (pending := self.open.pop(call, None)) is not None:
                pending.cancel()
        else:
            self.on_control(self.link, message)

    def _propose(self, call: int, requests: list[RawPropose], timeout: float | None) -> None:
        try:
            job, timing = self.backend.propose_read(requests, timeout)
        except Exception as err:
            self._answer_error(call, err)
            return
        self.open[call] = job
        job.add_done_callback(partial(self._answer, call, timing))

    def _columns(self, call: int, request: pb.ColumnsRequest, timeout: float | None) -> None:
        try:
            job, timing = self.backend.propose_columns(request, timeout)
        except Exception as err:
            self._answer_error(call, err)
            return
        # A failed row's error crosses as its value: an exception does not pickle whole.
        rows = mapped(
            job, lambda got: [error_value(r) if isinstance(r, Exception) else r for r in got]
        )
        self.open[call] = rows
        rows.add_done_callback(partial(self._answer, call, timing))

    def _track(self, call: int, task: asyncio.Future) -> None:
        self.open[call] = task
        task.add_done_callback(partial(self._answer, call, None))

    def _answer(self, call: int, timing: JobTiming | None, done: asyncio.Future) -> None:
        self.chunks.pop(call, None)
        if self.open.pop(call, None) is None or done.cancelled():  # the front end cancelled
            return
        if (err := done.exception()) is not None:
            self._answer_error(call, err)
            return
        times = None
        if timing is not None:
            times = (timing.started_ns, timing.done_ns, timing.batch_requests, timing.batch_jobs)
        self.link.send(("ok", call, done.result(), times))

    def _answer_error(self, call: int, err: BaseException) -> None:
        value = error_value(err)
        if value[0] is None:
            log.error("a forwarded call failed", exc_info=err)
        self.link.send(("err", call, value))

    def cancel_all(self) -> int:
        for pending in self.open.values():
            pending.cancel()
        count = len(self.open)
        self.open.clear()
        self.chunks.clear()
        return count


class BackendHost:
    """Listens on a unix socket for front ends; `on_control(link, message)` gets their
    other messages (ready); `on_lost(link)` is called when one goes."""

    def __init__(
        self,
        backend: LocalBackend,
        on_control: Callable[[Link, Message], None],
        on_lost: Callable[[Link], None],
    ) -> None:
        self.backend = backend
        self.on_control, self.on_lost = on_control, on_lost
        self.calls: dict[Link, _FrontEndCalls] = {}  # each connected front end's open calls
        self._server: asyncio.base_events.Server | None = None

    async def listen(self, path: str) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = Link(reader, writer, lambda _: None)
        calls = _FrontEndCalls(self.backend, link, self.on_control)
        link.on_message = calls.received
        self.calls[link] = calls
        try:
            await link.run()
        finally:
            del self.calls[link]
            if cancelled := calls.cancel_all():
                log.warning("a front end went away: %d open calls cancelled", cancelled)
            self.on_lost(link)

    def broadcast(self, message: Message) -> None:
        for link in self.calls:
            link.send(message)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self.calls):
            link.close()
