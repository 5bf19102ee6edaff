"""The engine watchdog: health NOT_SERVING while the engine thread is stuck with work
queued, SERVING once it moves again, never while it is merely busy; a drain's NOT_SERVING
stays. First on a runner and a health servicer alone, then served (`mtpdraft serve
--engine-stall-timeout`), seen by a gRPC health check while a Propose holds the engine."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cli_server import CliServer, hold_the_engine
from drafting import hiddens, tokens
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mtpdraft.client import DrafterClient
from mtpdraft.service.server import SERVICE_NAME
from mtpdraft.service.serving.runner import EngineRunner
from mtpdraft.service.watchdog import EngineWatchdog

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
STALL_S = 0.4


async def status(servicer: health.aio.HealthServicer) -> set[int]:
    """What Check answers for the server and for the Drafter service, as a probe asks."""
    statuses = set()
    for service in ("", SERVICE_NAME):
        request = health_pb2.HealthCheckRequest(service=service)
        statuses.add((await servicer.Check(request, context=None)).status)
    return statuses


async def watched(stall_timeout: float = STALL_S):
    runner, servicer = EngineRunner(), health.aio.HealthServicer()
    for service in ("", SERVICE_NAME):
        await servicer.set(service, SERVING)
    watchdog = EngineWatchdog(runner, servicer, ("", SERVICE_NAME), stall_timeout, period=0.05)
    watchdog.start()
    return runner, servicer, watchdog


async def until(servicer: health.aio.HealthServicer, want: int, timeout: float = 30.0) -> float:
    """Seconds until health answers `want` for both services."""
    start = time.monotonic()
    while await status(servicer) != {want}:
        assert time.monotonic() - start < timeout, "timed out"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def test_a_stuck_engine_thread_turns_health_not_serving_until_it_moves() -> None:
    async def run() -> None:
        runner, servicer, watchdog = await watched()
        release = threading.Event()
        try:
            await asyncio.sleep(3 * STALL_S)
            assert await status(servicer) == {SERVING}  # idle: the probe runs at once
            runner.submit(release.wait, 60)  # the engine thread is stuck in a call
            waited = await until(servicer, NOT_SERVING)
            assert waited >= STALL_S * 0.9  # not before the stall timeout
            await asyncio.sleep(2 * STALL_S)
            assert await status(servicer) == {NOT_SERVING}
            release.set()
            await until(servicer, SERVING)
        finally:
            release.set()
            await watchdog.stop()
            runner.shutdown()

    asyncio.run(run())


def test_a_busy_engine_thread_that_finishes_its_calls_stays_serving() -> None:
    async def run() -> None:
        runner, servicer, watchdog = await watched()
        try:
            seen = set()
            deadline = time.monotonic() + 6 * STALL_S
            while time.monotonic() < deadline:  # back to back, each a third of the timeout
                await runner.call(time.sleep, STALL_S / 3)
                seen |= await status(servicer)
            assert seen == {SERVING}
        finally:
            await watchdog.stop()
            runner.shutdown()

    asyncio.run(run())


def test_a_drains_not_serving_outlasts_the_stall() -> None:
    async def run() -> None:
        runner, servicer, watchdog = await watched()
        release = threading.Event()
        try:
            runner.submit(release.wait, 60)
            await until(servicer, NOT_SERVING)
            await servicer.enter_graceful_shutdown()
            release.set()
            await runner.call(lambda: None)  # the thread has moved on
            await asyncio.sleep(3 * STALL_S)
            assert await status(servicer) == {NOT_SERVING}
        finally:
            release.set()
            await watchdog.stop()
            runner.shutdown()

    asyncio.run(run())


def health_of(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        return stub.Check(request, timeout=10).status


@pytest.mark.parametrize("stall_timeout", ["1", "0"])
def test_served_health_follows_the_engine_thread(mimo_checkpoint, stall_timeout) -> None:
    """A Propose held in the engine (a wedged forward), a GetInfo queued behind it: with a
    stall timeout, health over gRPC turns NOT_SERVING, then SERVING once the engine moves;
    with 0, the watchdog is off and health stays SERVING."""
    server = CliServer("--model", str(mimo_checkpoint), "--engine-stall-timeout", stall_timeout)
    entered, release = hold_the_engine(server.engine)
    try:
        with DrafterClient(server.address, timeout=60) as c, ThreadPoolExecutor(2) as pool:
            state = c.alloc_state()
            c.prefill(state, tokens(4, 0), hiddens(4, 0), 1)
            held = pool.submit(c.propose, state, 7, hiddens(1, 1)[0], 5, 2)
            assert entered.wait(30), "the Propose never reached the engine"
            queued = pool.submit(c.info)  # work waiting for the engine thread
            if stall_timeout == "0":
                time.sleep(2.5)
                assert health_of(server.address) == SERVING
            else:
                deadline = time.monotonic() + 30
                while health_of(server.address) != NOT_SERVING:
                    assert time.monotonic() < deadline, "health stayed SERVING"
                    time.sleep(0.05)
            release.set()
            assert len(held.result(60).tokens) == 2 and queued.result(60).live_states == 1
            deadline = time.monotonic() + 30
            while health_of(server.address) != SERVING:
                assert time.monotonic() < deadline, "health stayed NOT_SERVING"
                time.sleep(0.05)
            c.free_state(state)
    finally:
        release.set()
        server.stop()
