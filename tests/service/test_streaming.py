"""The one-round-trip hot path: ProposeStream, sync and asyncio, against unary Propose."""

from __future__ import annotations

import asyncio
import threading

import pytest
from drafting import hiddens, tokens

from mtpdraft.client import (
    AsyncDrafterClient,
    DrafterClient,
    FailedPrecondition,
    InvalidArgument,
    StateNotFound,
    Verdict,
)


def _prompted(client: DrafterClient, n: int, seed: int) -> int:
    state = client.alloc_state()
    client.prefill(state, tokens(n, seed), hiddens(n, seed), 1)
    return state


def _steps(client: DrafterClient, state: int, propose) -> list:
    """Three verify steps of one sequence, each one round trip."""
    out, position, previous = [], 6, None
    for step in range(3):
        x, h = tokens(1, 10 + step)[0], hiddens(1, 10 + step)
        p = propose(state, x, h, position, 3, previous=previous)
        out.append(p)
        accepted = step % 3
        previous = Verdict(accepted, hiddens(accepted, 20 + step))
        position += accepted + 1
    client.after_verify(state, previous.num_accepted, refeed_hiddens=previous.refeed_hiddens)
    return out


def test_stream_equals_unary_and_survives_errors(client: DrafterClient) -> None:
    unary_state, stream_state = _prompted(client, 5, 1), _prompted(client, 5, 1)
    expected = _steps(client, unary_state, client.propose)
    with client.stream() as stream:
        got = _steps(client, stream_state, stream.propose)
        # A bad message answers its error and leaves the stream open.
        with pytest.raises(StateNotFound):
            stream.propose(987654321, 1, hiddens(1, 0), 1, 2)
        with pytest.raises(InvalidArgument):
            stream.propose(stream_state, 1, hiddens(1, 0), 99, 2)
        with pytest.raises(FailedPrecondition):
            stream.propose(stream_state, 1, hiddens(1, 0), 12, 2, previous=Verdict(0))
        assert stream.propose(stream_state, 1, hiddens(1, 0), 12, 2).first_position == 13
        client.after_verify(stream_state, 0)
    for g, e in zip(got, expected, strict=True):
        assert g.tokens == e.tokens and g.probs == pytest.approx(e.probs, abs=1e-5)
    for state in (unary_state, stream_state):
        client.free_state(state)


def test_one_stream_carries_many_states_in_flight(client: DrafterClient) -> None:
    states = [_prompted(client, 3 + i, 30 + i) for i in range(6)]
    alone = [client.propose(s, 1, hiddens(1, 40 + i), 4 + i, 4) for i, s in enumerate(states)]
    before = client.info().batch_size_counts
    with client.stream() as stream:
        futures = [
            stream.submit(s, 2, hiddens(1, 50 + i), 5 + i, 4, previous=Verdict(0))
            for i, s in enumerate(states)
        ]
        results = [f.result(timeout=30) for f in futures]
    after = client.info().batch_size_counts
    requests = sum(n * (after.get(n, 0) - before.get(n, 0)) for n in after)
    assert requests == 6  # the server's batch-size histogram counted each request once
    assert [r.state_id for r in results] == states
    assert all(len(r.tokens) == 4 for r in results)
    assert all(len(a.tokens) == 4 for a in alone)
    for state in states:
        client.after_verify(state, 0)
        client.free_state(state)


def test_streams_from_many_threads_at_once(client: DrafterClient, server) -> None:
    errors: list[BaseException] = []

    def verifier(seed: int) -> None:
        try:
            with DrafterClient(server.address, timeout=30) as own, own.stream() as stream:
                state = _prompted(own, 5, seed)
                _steps(own, state, stream.propose)
                own.free_state(state)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=verifier, args=(60 + i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_async_stream(server) -> None:
    async def run() -> None:
        async with AsyncDrafterClient(server.address, timeout=30) as c:
            state = await c.alloc_state()
            await c.prefill(state, tokens(5, 1), hiddens(5, 1), 1)
            async with c.stream() as stream:
                first = await stream.propose(state, 3, hiddens(1, 2), 6, 3)
                with pytest.raises(InvalidArgument):
                    await stream.propose(state, 3, hiddens(1, 2), 99, 3, previous=Verdict(1))
                second = await stream.propose(state, 4, hiddens(1, 3), 8, 2, previous=Verdict(1))
            assert len(first.tokens) == 3 and second.first_position == 9
            await c.after_verify(state, 2)
            assert await c.free_state(state)

    asyncio.run(run())


def test_a_failed_forward_answers_internal_and_the_stream_goes_on(mimo_checkpoint) -> None:
    from servers import InProcessServer, small_engine

    from mtpdraft.client import DrafterRpcError

    engine = small_engine(mimo_checkpoint)
    forward = engine.propose_groups

    def broken_once(groups):
        engine.propose_groups = forward
        raise RuntimeError("a bug in the forward")

    server = InProcessServer(engine)
    try:
        with DrafterClient(server.address) as client, client.stream() as stream:
            state = _prompted(client, 5, 1)
            engine.propose_groups = broken_once
            with pytest.raises(DrafterRpcError) as failed:
                stream.propose(state, 1, hiddens(1, 0), 6, 2)
            assert failed.value.code.name == "INTERNAL"
            assert failed.value.reason == "INTERNAL"
            # The failed forward changed nothing: the same request now drafts.
            assert stream.propose(state, 1, hiddens(1, 0), 6, 2).first_position == 7
    finally:
        server.stop()
