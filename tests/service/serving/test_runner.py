"""The engine runner: calls run one at a time on one thread, in order; results and errors
come back to the caller; a call cancelled while queued never runs."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from mtpdraft.service.serving.runner import EngineRunner


def test_calls_run_in_order_on_one_thread_and_return_their_results() -> None:
    runner = EngineRunner()
    seen: list[tuple[int, int]] = []

    def work(i: int) -> int:
        seen.append((i, threading.get_ident()))
        return i * i

    async def main() -> list[int]:
        return await asyncio.gather(*(runner.call(work, i) for i in range(20)))

    try:
        assert asyncio.run(main()) == [i * i for i in range(20)]
    finally:
        runner.shutdown()
    assert [i for i, _ in seen] == list(range(20))
    assert len({thread for _, thread in seen}) == 1
    assert seen[0][1] != threading.get_ident()


def test_an_error_reaches_the_caller_and_the_thread_serves_on() -> None:
    runner = EngineRunner()

    def fail() -> None:
        raise ValueError("bad call")

    async def main() -> int:
        with pytest.raises(ValueError, match="bad call"):
            await runner.call(fail)
        return await runner.call(lambda: 7)

    try:
        assert asyncio.run(main()) == 7
    finally:
        runner.shutdown()


def test_a_call_cancelled_while_queued_never_runs() -> None:
    runner = EngineRunner()
    release, ran = threading.Event(), []

    async def main() -> None:
        blocker = asyncio.ensure_future(runner.call(release.wait, 10))
        await asyncio.sleep(0.05)  # the engine thread is inside the blocker now
        queued = asyncio.ensure_future(runner.call(ran.append, "queued"))
        await asyncio.sleep(0)
        queued.cancel()
        release.set()
        assert await blocker is True
        with pytest.raises(asyncio.CancelledError):
            await queued
        await runner.call(ran.append, "after")

    try:
        asyncio.run(main())
    finally:
        runner.shutdown()
    assert ran == ["after"]


def test_a_failed_submitted_call_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    runner = EngineRunner()

    def cleanup() -> None:
        raise RuntimeError("cleanup failed")

    with caplog.at_level(logging.WARNING, logger="mtpdraft.engine"):
        runner.submit(cleanup)
        runner.shutdown()  # runs what was queued, then stops
    assert any("cleanup failed" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


def test_exclusive_is_granted_only_to_an_idle_runner_and_holds_its_calls_back() -> None:
    runner = EngineRunner()
    release, order = threading.Event(), []

    async def main() -> None:
        with runner.exclusive() as idle:
            assert idle
            queued = asyncio.ensure_future(runner.call(order.append, "queued"))
            await asyncio.sleep(0.05)  # the engine thread took the call, and waits
            order.append("exclusive")
        await queued
        assert order == ["exclusive", "queued"]
        busy = asyncio.ensure_future(runner.call(release.wait, 10))
        await asyncio.sleep(0.05)  # the engine thread is inside it now
        with runner.exclusive() as idle:
            assert not idle  # a call is running
        waiting = asyncio.ensure_future(runner.call(order.append, "after"))
        with runner.exclusive() as idle:
            assert not idle  # and one is queued
        release.set()
        await asyncio.gather(busy, waiting)

    try:
        asyncio.run(main())
    finally:
        runner.shutdown()
