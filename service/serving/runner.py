"""The engine's worker thread: engine calls run there, one at a time.

One call at a time keeps the engine free of locks (no call ever sees another half
done), and a thread of its own keeps the asyncio loop free for I/O, health checks
and batching meanwhile: the loop's gRPC work overlaps the forward's waits on the
GPU. Running every call on the loop's own thread instead lost, at 64 streams and
at batch 1 (bench/README.md). `exclusive` lets the loop run a call itself when the
worker has nothing to do, without a call of the worker's starting meanwhile (the
scheduler does, for a batch that no other call can be waiting for).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("mtpdraft.engine")

# How long a thread may hold the GIL while another waits for it (Python's default:
# 5 ms). The engine thread lets go of the GIL at every torch call and must then win
# it back from the busy event loop; 0.5 ms served 64 streams best of 5, 0.5 and 0.1
# (bench/README.md). Set for the whole engine process by the server's CLI.
GIL_SWITCH_INTERVAL_S = 0.0005


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():  # its caller went away; the call's effect stands
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class EngineRunner:
    """Runs engine calls one at a time on a dedicated thread.

    A call's answer goes back to the loop with one call_soon_threadsafe, not through
    a concurrent.futures.Future chained to an asyncio one (two more loop callbacks).
    """

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._running = threading.Lock()  # held while a call runs, here or `exclusive`ly
        self._thread = threading.Thread(target=self._work, name="engine", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            loop, future, fn, args = call
            if future is not None and future.cancelled():  # cancelled while queued
                continue
            try:
                with self._running:
                    result, error = fn(*args), None
            except Exception as exc:  # the caller's to handle, as the call's outcome
                result, error = None, exc
            if future is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: no one waits
                    loop.call_soon_threadsafe(_settle, future, result, error)
            elif error is not None:
                log.warning("a queued engine call (%s) failed", fn, exc_info=error)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls.put((loop, future, fn, args))
        return await future

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[bool]:
        """True when no call is queued or running: the caller may then call the engine on
        its own thread, and no queued call starts until the block ends. Never waits."""
        if not self._calls.empty() or not self._running.acquire(blocking=False):
            yield False
            return
        try:
            yield True
        finally:
            self._running.release()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queues a call without waiting for it (cleanup from a cancelled handler)."""
        self._calls.put((None, None, fn, args))

    def shutdown(self) -> None:
        self._calls.put(None)
        self._thread.join()
