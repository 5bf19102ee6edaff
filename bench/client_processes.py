"""Client processes that start their measured steps together.

Each job runs `run(*job, barrier)` under asyncio in a spawned process of its own (no fork
of a process holding gRPC or CUDA). Spawned processes start seconds apart, so each run
warms up, then waits at the shared barrier before it times anything: a window opened at
the first one's start would count the others' start-up.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Awaitable, Callable
from typing import Any


def _process(run: Callable[..., Awaitable[Any]], job: tuple, barrier: Any, results: Any) -> None:
    try:
        results.put(asyncio.run(run(*job, barrier)))
    except BaseException as exc:
        barrier.abort()  # the others must not wait for this one
        results.put(f"{type(exc).__name__}: {exc}")
        raise


def run_together(
    run: Callable[..., Awaitable[Any]], jobs: list[tuple], timeout: float, what: str
) -> list[Any]:
    """Each job's result (in the order they finish); RuntimeError naming `what` (a
    client process, a verifier) if one of them failed."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(len(jobs)), ctx.Queue()
    workers = [
        ctx.Process(target=_process, args=(run, job, barrier, results), daemon=True) for job in jobs
    ]
    for w in workers:
        w.start()
    try:
        parts = [results.get(timeout=timeout) for _ in workers]
    finally:
        for w in workers:
            w.join(30)
            if w.is_alive():
                w.terminate()
    failed = [p for p in parts if isinstance(p, str)]
    if failed:
        raise RuntimeError(f"{what} failed: {failed[0]}")
    return parts
