"""The canned-reply floor (bench/grpc_floor.py) counts only the round trips after every
client process is warm: processes start seconds apart, and a window opened at the
first one's start would understate what the transport carries."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


class _Barrier:
    """Stands for the client processes' barrier: the others arrive a while later."""

    def __init__(self) -> None:
        self.passed_at: float | None = None

    def wait(self, timeout: float) -> None:
        time.sleep(0.2)
        self.passed_at = time.monotonic()


def test_the_floor_times_the_steps_after_the_barrier(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import grpc_floor

    barrier = _Barrier()
    server = grpc_floor.start_server(4, 0.0)
    try:
        got = asyncio.run(grpc_floor._streams(server.target, 2, b"", 3, 2, barrier))
    finally:
        server.stop()
    assert barrier.passed_at is not None and got["started"] >= barrier.passed_at
    assert len(got["times"]) == 2 * 3  # the warm-up's round trips are not among them
    assert got["finished"] >= got["started"] + sum(got["times"]) / 2
