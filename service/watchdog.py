"""Health that follows the engine thread: NOT_SERVING while it makes no progress.

gRPC health is answered on the event loop, which stays free while the engine thread
works, so an engine stuck in a call (a hung device call, a deadlock) would still answer
SERVING, and a liveness probe of health would never restart it. The watchdog queues an
empty call on the engine thread every second: once one has waited `stall_timeout`
seconds, the thread has finished nothing in that time with work queued, and health
answers NOT_SERVING until the call runs, then SERVING again. A stuck event loop answers
no probe at all, which a probe counts as a failure too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from grpc_health.v1 import health_pb2

if TYPE_CHECKING:
    from grpc_health.v1.health import aio

    from .serving.runner import EngineRunner

log = logging.getLogger("mtpdraft.watchdog")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# How often the engine thread is asked to run the empty call.
PROBE_PERIOD_S = 1.0


def _progress() -> None:
    """The probe: a call that does nothing, so that running it is the thread's progress."""


class EngineWatchdog:
    """Turns `services` of `health` NOT_SERVING while a call queued on `runner` has waited
    `stall_timeout` seconds (0: never), and SERVING once it has run. Health set NOT_SERVING
    for good (a drain) stays so: the servicer ignores `set` from then on."""

    def __init__(
        self,
        runner: EngineRunner,
        health: aio.HealthServicer,
        services: Sequence[str],
        stall_timeout: float,
        period: float = PROBE_PERIOD_S,
    ) -> None:
        self.runner, self.health, self.services = runner, health, tuple(services)
        self.stall_timeout, self.period = stall_timeout, period
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.stall_timeout > 0 and self._task is None:
            self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            queued = loop.time()
            probe = asyncio.ensure_future(self.runner.call(_progress))
            try:
                done, _ = await asyncio.wait({probe}, timeout=self.stall_timeout)
                if not done:
                    log.error(
                        "the engine thread has run no call for %g s with work queued: "
                        "health NOT_SERVING",
                        self.stall_timeout,
                    )
                    await self._set(NOT_SERVING)
                    await probe
                    log.warning(
                        "the engine thread ran again after %.1f s: health SERVING",
                        loop.time() - queued,
                    )
                    await self._set(SERVING)
            finally:
                probe.cancel()  # stopped meanwhile: the runner skips a cancelled call
            await asyncio.sleep(self.period)

    async def _set(self, status: int) -> None:
        for service in self.services:
            await self.health.set(service, status)
