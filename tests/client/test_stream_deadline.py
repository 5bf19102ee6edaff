"""Streams have no deadline unless one is asked for: a client's default timeout is
for its unary calls, and a verifier's stream outlives it. A stream opened with a
timeout does end with DEADLINE_EXCEEDED once it has passed.

Both clients, both stream kinds, against a real server in-process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from servers import PATIENCE, InProcessServer, small_engine

from mtpdraft.client import AsyncDrafterClient, DeadlineExceeded, DrafterClient

SHORT = 0.5  # the clients' default timeout, and an explicit stream's deadline
PAST = 1.2  # how long each stream is kept open: well past SHORT


@pytest.fixture(scope="module")
def address(mimo_checkpoint: Path) -> Iterator[str]:
    server = InProcessServer(small_engine(mimo_checkpoint))
    yield server.address
    server.stop()


def _hiddens(n: int, size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, size)).astype(np.float32)


def _prompted(c: DrafterClient, size: int, seed: int) -> tuple[int, np.ndarray]:
    """A state prefilled with 4 rows (positions 1-4), and the hiddens of 3 more steps.

    The unary calls carry their own generous timeout: only the stream is on trial."""
    state = c.alloc_state(timeout=PATIENCE)
    hs = _hiddens(7, size, seed)
    c.prefill(state, [1, 2, 3, 4], hs[:4], 1, timeout=PATIENCE)
    return state, hs[4:]


def _size(c: DrafterClient) -> int:
    return c.info(timeout=PATIENCE).hidden_size


def test_a_stream_outlives_the_client_timeout(address: str) -> None:
    with DrafterClient(address, timeout=SHORT) as c:
        state, hs = _prompted(c, _size(c), 1)
        start = time.monotonic()
        with c.stream() as stream:
            p = stream.propose(state, 5, hs[0], 5, 2)
            time.sleep(PAST)
            p = stream.propose(state, 6, hs[1], 6, 2, previous=0)
            assert p.state_id == state and time.monotonic() - start > PAST
        c.free_state(state, timeout=PATIENCE)


def test_a_stream_of_batches_outlives_the_client_timeout(address: str) -> None:
    with DrafterClient(address, timeout=SHORT) as c:
        state, hs = _prompted(c, _size(c), 2)
        with c.stream() as stream:
            step = stream.step([state], [5], [5], hs[:1], 2)
            time.sleep(PAST)
            step = stream.step([state], [6], [6], hs[1:2], 2, num_accepted=[0])
            assert step.errors == {} and step.counts.tolist() == [2]
        c.free_state(state, timeout=PATIENCE)


def test_a_stream_with_a_timeout_expires(address: str) -> None:
    with DrafterClient(address) as c:
        state, hs = _prompted(c, _size(c), 3)
        with c.stream(timeout=SHORT) as stream:
            stream.propose(state, 5, hs[0], 5, 2)
            time.sleep(PAST)
            with pytest.raises(DeadlineExceeded):
                stream.propose(state, 6, hs[1], 6, 2, previous=0)
        with c.stream(timeout=SHORT) as stream:
            time.sleep(PAST)
            with pytest.raises(DeadlineExceeded):
                stream.step([state], [6], [6], hs[1:2], 2, num_accepted=[0])
        c.free_state(state, timeout=PATIENCE)


def test_async_streams_outlive_the_client_timeout(address: str) -> None:
    async def main() -> None:
        async with AsyncDrafterClient(address, timeout=SHORT) as c:
            size = (await c.info(timeout=PATIENCE)).hidden_size
            state = await c.alloc_state(timeout=PATIENCE)
            hs = _hiddens(7, size, 4)
            await c.prefill(state, [1, 2, 3, 4], hs[:4], 1, timeout=PATIENCE)
            async with c.stream() as stream:
                await stream.propose(state, 5, hs[4], 5, 2)
                await asyncio.sleep(PAST)
                p = await stream.propose(state, 6, hs[5], 6, 2, previous=0)
                assert p.state_id == state
            async with c.stream() as batches:
                await asyncio.sleep(PAST)
                step = await batches.step([state], [7], [7], hs[6:7], 2, num_accepted=[0])
                assert step.errors == {} and step.counts.tolist() == [2]
            async with c.stream(timeout=SHORT) as stream:
                await asyncio.sleep(PAST)
                with pytest.raises(DeadlineExceeded):
                    await stream.propose(state, 8, hs[6], 8, 2, previous=0)
            async with c.stream(timeout=SHORT) as batches:
                await asyncio.sleep(PAST)
                with pytest.raises(DeadlineExceeded):
                    await batches.step([state], [8], [8], hs[6:7], 2, num_accepted=[0])
            await c.free_state(state, timeout=PATIENCE)

    asyncio.run(main())
