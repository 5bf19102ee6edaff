"""The engine's single worker thread: every engine call runs there, one at a time.

One thread keeps the engine free of locks (no call ever sees another half done)
and keeps the asyncio loop free for I/O, health checks and batching meanwhile.

Running the engine on the loop's own thread instead (no GIL shared with a worker)
lost in one H200 run, same host, one process, K=4: 64 streams made 13.3k drafts/s
against 22.0k on the worker (Go client: 18.4k against 22.2k), and batch 1 was
1294 us over the in-process step against 973: the worker overlaps the loop's
gRPC work with the forward's waits on the GPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# How long a thread may hold the GIL while another waits for it (Python's default:
# 5 ms). The engine thread lets go of the GIL at every torch call and must then win
# it back from the busy event loop. One process, 64 closed-loop streams on an H200
# (MiMo-7B shape, K=4), same run: 5 ms 13.4k drafts/s (mean batch 42), 0.5 ms 18.2k
# (57), 0.1 ms 17.8k; batch-1 p50 3893 -> 3642 us.
# Set for the whole engine process by the server's CLI.
GIL_SWITCH_INTERVAL_S = 0.0005


class EngineRunner:
    """Runs engine calls one at a time on a dedicated thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queues a call without waiting for it (cleanup from a cancelled handler)."""
        self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
