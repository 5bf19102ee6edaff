"""The engine's single worker thread: every engine call runs there, one at a time.

One thread keeps the engine free of locks (no call ever sees another half done)
and keeps the asyncio loop free for I/O, health checks and batching meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


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
