"""A numbered step whose outcome the client never learned, sent again: the clients' side.

`retry_step` sends a step again while its failure is ambiguous (`is_ambiguous`: it may have
been applied), and the server answers a step it applied as it did. Each client face against
an in-process server: the sync and asyncio clients' unary Propose (the answer lost after the
server applied the step), and a ProposeStream whose wait for an answer times out while the
engine is stalled (the message applied later all the same). A twin state that never retried
says what the answers must be.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from servers import PATIENCE, InProcessServer, small_engine

from mtpdraft.client import (
    AsyncDrafterClient,
    DeadlineExceeded,
    DrafterClient,
    FailedPrecondition,
    StateLost,
    Unavailable,
    is_ambiguous,
    retry_step,
    retry_step_async,
)
from mtpdraft.client import messages as m

H = 64


@pytest.fixture(scope="module")
def served(mimo_checkpoint: Path) -> Iterator[InProcessServer]:
    server = InProcessServer(small_engine(mimo_checkpoint))
    yield server
    server.stop()


def hidden(seed: int, rows: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, H)).astype(np.float32)


def prompted(c: DrafterClient) -> int:
    state = c.alloc_state()
    c.prefill(state, [1, 2, 3, 4], hidden(0, 4), 1)
    return state


def lost_answer(call: Callable):
    """`call` whose first answer is lost after the server applied it (DeadlineExceeded)."""
    calls = []

    def once():
        got = call()
        calls.append(got)
        if len(calls) == 1:
            raise DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "the answer was lost")
        return got

    return once, calls


def test_which_failures_are_ambiguous() -> None:
    assert is_ambiguous(DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "late"))
    assert is_ambiguous(Unavailable(grpc.StatusCode.UNAVAILABLE, "connection reset"))
    # A drain refuses before applying; a lost state and a refusal were not applied.
    assert not is_ambiguous(Unavailable(grpc.StatusCode.UNAVAILABLE, "no", reason="DRAINING"))
    assert not is_ambiguous(StateLost(grpc.StatusCode.NOT_FOUND, "gone", reason="STATE_LOST"))
    assert not is_ambiguous(FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION, "stale"))
    assert not is_ambiguous(ValueError("not a call's failure"))


def test_step_numbers_on_the_wire() -> None:
    req = m.propose_request(7, 1, hidden(1)[0], 5, 2, step_number=2**64 - 1)
    assert req.step_number == 2**64 - 1
    assert m.propose_request(7, 1, hidden(1)[0], 5, 2).step_number == 0
    batch = m.batch_request([7, 8], [1, 2], [5, 6], hidden(1, 2), 2, step_numbers=9)
    assert list(batch.step_numbers) == [9]
    with pytest.raises(ValueError, match="step_number"):
        m.propose_request(7, 1, hidden(1)[0], 5, 2, step_number=-1)


def test_retry_step_sends_again_only_what_may_have_been_applied() -> None:
    sent = []

    def refused():
        sent.append(1)
        raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION, "no", reason="STALE_STEP")

    with pytest.raises(FailedPrecondition):
        retry_step(refused, backoff=0)
    assert len(sent) == 1

    def late():
        sent.append(1)
        raise DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "late")

    sent.clear()
    with pytest.raises(DeadlineExceeded):
        retry_step(late, attempts=3, backoff=0)
    assert len(sent) == 3
    with pytest.raises(ValueError, match="attempts"):
        retry_step(late, attempts=0)


def test_a_lost_answer_is_asked_again_and_the_step_applied_once(served) -> None:
    with DrafterClient(served.address, timeout=PATIENCE) as c:
        state, twin = prompted(c), prompted(c)
        # (token, position, verdict on the proposal before): accepted 1, then 0.
        steps = [(5, 5, None), (6, 7, 1), (7, 8, 0)]
        for number, (token, position, verdict) in enumerate(steps, start=1):

            def step(s: int, n: int, token=token, position=position, verdict=verdict):
                h = hidden(position)[0]
                return c.propose(s, token, h, position, 3, previous=verdict, step_number=n)

            call, calls = lost_answer(lambda step=step, number=number: step(state, number))
            got = retry_step(call, backoff=0)
            assert len(calls) == 2 and calls[0] == got  # asked twice, answered alike
            want = step(twin, 0)
            assert (got.tokens, got.first_position) == (want.tokens, want.first_position)
            assert got.probs == pytest.approx(want.probs, abs=1e-6)
        c.free_state(state)
        c.free_state(twin)


def test_the_asyncio_client_retries_alike(served) -> None:
    async def scenario() -> None:
        async with AsyncDrafterClient(served.address, timeout=PATIENCE) as c:
            states = []
            for _ in range(2):
                s = await c.alloc_state()
                await c.prefill(s, [1, 2, 3, 4], hidden(0, 4), 1)
                states.append(s)
            state, twin = states
            calls = []

            async def call():
                got = await c.propose(state, 5, hidden(1)[0], 5, 3, step_number=4)
                calls.append(got)
                if len(calls) == 1:
                    raise DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "the answer was lost")
                return got

            got = await retry_step_async(call, backoff=0)
            assert calls[0] == got
            want = await c.propose(twin, 5, hidden(1)[0], 5, 3)
            assert got.tokens == want.tokens
            # The step was applied once: the next step, with its verdict, fits the state.
            nxt = await c.propose(state, 9, hidden(2)[0], 6 + 0, 2, previous=0, step_number=5)
            assert nxt.first_position == 7
            for s in states:
                await c.free_state(s)

    asyncio.run(scenario())


def test_a_stream_message_unanswered_in_time_is_sent_again(mimo_checkpoint: Path) -> None:
    """The engine stalls: the stream's wait for an answer ends (DeadlineExceeded) while the
    message stays queued and is applied once the engine moves; sent again with its step
    number, it is answered as its twin's, and the stream goes on."""
    engine = small_engine(mimo_checkpoint)
    server = InProcessServer(engine)
    original, release = engine.step, threading.Event()

    def stalled(step):
        release.wait(PATIENCE)
        return original(step)

    try:
        with DrafterClient(server.address, timeout=PATIENCE) as c:
            state, twin = prompted(c), prompted(c)
            with c.stream() as stream:
                engine.step = stalled
                with pytest.raises(DeadlineExceeded):
                    stream.propose(state, 5, hidden(1)[0], 5, 3, step_number=1, timeout=0.3)
                engine.step = original
                release.set()
                got = retry_step(
                    lambda: stream.propose(state, 5, hidden(1)[0], 5, 3, step_number=1),
                    backoff=0,
                )
                want = stream.propose(twin, 5, hidden(1)[0], 5, 3)
                assert (got.tokens, got.first_position) == (want.tokens, want.first_position)
                nxt = stream.propose(state, 9, hidden(2)[0], 6, 2, previous=0, step_number=2)
                assert nxt.first_position == 7
            c.free_state(state)
            c.free_state(twin)
    finally:
        release.set()
        server.stop()
