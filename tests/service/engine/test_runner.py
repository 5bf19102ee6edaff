"""EngineRunner: where engine calls run, one at a time, and what a queued call does."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from mtpdraft.service.engine.runner import EngineRunner


@pytest.mark.parametrize("thread", [False, True], ids=["on-the-loop", "engine-thread"])
def test_calls_run_one_at_a_time_where_chosen(thread: bool) -> None:
    async def run() -> None:
        runner = EngineRunner(thread=thread)
        loop_thread = threading.get_ident()
        running, overlaps, threads = [0], [], set()

        def work(x: int) -> int:
            running[0] += 1
            overlaps.append(running[0])
            threads.add(threading.get_ident())
            time.sleep(0.01)
            running[0] -= 1
            return x * 2

        try:
            assert await asyncio.gather(*(runner.call(work, i) for i in range(5))) == [
                0, 2, 4, 6, 8
            ]  # fmt: skip
            assert max(overlaps) == 1
            assert (loop_thread in threads) is not thread and len(threads) == 1
            assert runner.threaded is thread
            with pytest.raises(ZeroDivisionError):
                await runner.call(lambda: 1 / 0)
        finally:
            runner.shutdown()

    asyncio.run(run())


@pytest.mark.parametrize("thread", [False, True], ids=["on-the-loop", "engine-thread"])
def test_a_submitted_call_runs_before_later_calls_and_its_failure_is_logged(
    thread: bool, caplog: pytest.LogCaptureFixture
) -> None:
    async def run() -> None:
        runner = EngineRunner(thread=thread)
        done: list[int] = []
        try:
            runner.submit(done.append, 1)
            runner.submit(lambda: 1 / 0)
            runner.submit(done.append, 2)
            assert await runner.call(done.append, 3) is None
            assert done == [1, 2, 3]
        finally:
            runner.shutdown()

    asyncio.run(run())
    (record,) = [r for r in caplog.records if "clean-up call failed" in r.getMessage()]
    assert record.exc_info is not None and record.exc_info[0] is ZeroDivisionError
