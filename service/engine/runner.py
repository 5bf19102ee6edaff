"""Where engine calls run: one at a time, on the event loop's own thread or on one worker.

Either way no call ever sees another half done, so the engine needs no locks.

On the loop's thread (the one-process server's default) a call blocks the loop
while it runs: messages wait in gRPC's buffers and are read between forwards.
On a worker thread the loop reads and answers while the engine computes, but the
two threads share the GIL: the engine lets go of it at its torch calls and must
win it back from a busy loop each time. One process on an H200, 64 closed-loop
streams (MiMo-7B shape, K=4, Go client): a batch-40 forward took 10.7 ms on the
worker against 4.2 ms alone, and the server made 11.0k drafts/s; on the loop's
thread, 20.1k, and at batch 1 the two hand-offs between threads (~250 us) went.
The engine process before front-end processes keeps the worker: its loop does
only the links' light work, and overlapping it with the forward won there
(20.2k drafts/s against 15.2k on the loop's thread, 4 front ends).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("mtpdraft.engine")

# How long a thread may hold the GIL while another waits for it (Python's default:
# 5 ms), for an engine on its worker thread: it lets go of the GIL at every torch
# call and must then win it back from the busy event loop. One process, 64
# closed-loop streams on an H200 (MiMo-7B shape, K=4), same run: 5 ms 13.4k
# drafts/s (mean batch 42), 0.5 ms 18.2k (57), 0.1 ms 17.8k; batch-1 p50 3893 ->
# 3642 us. With front-end processes the engine's loop is less busy and it changed
# nothing (17.6k, 17.1k, 17.5k). Set for the whole engine process by the server's CLI.
GIL_SWITCH_INTERVAL_S = 0.0005


class EngineRunner:
    """Runs engine calls one at a time: on a dedicated thread (`thread=True`), or in
    place on the event loop's thread."""

    def __init__(self, thread: bool = True) -> None:
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine") if thread else None
        )

    @property
    def threaded(self) -> bool:
        return self._pool is not None

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._pool is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Runs a call without waiting for it (cleanup from a cancelled handler), before
        any call made after it. From the loop's thread, where an engine on the loop's
        thread is never in the middle of a call; a failure is logged."""
        if self._pool is not None:
            self._pool.submit(fn, *args).add_done_callback(_log_failure)
            return
        try:
            fn(*args)
        except Exception:
            log.exception("an engine clean-up call failed")

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _log_failure(done: Future) -> None:
    if not done.cancelled() and (err := done.exception()) is not None:
        log.error("an engine clean-up call failed", exc_info=err)
