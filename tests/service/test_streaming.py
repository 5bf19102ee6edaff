"""The one-round-trip hot path: ProposeStream, one state a message (a batch of one), sync and
asyncio, against unary Propose."""

from __future__ import annotations

import asyncio
import threading

import pytest
from drafting import Expected, hiddens, tokens
from mtp_reference import Reference

from mtpdraft.client import (
    AsyncDrafterClient,
    DrafterClient,
    FailedPrecondition,
    InvalidArgument,
    StateNotFound,
    Verdict,
)


@pytest.fixture(scope="module")
def ref(mimo_checkpoint) -> Reference:
    return Reference(mimo_checkpoint)


def _assert_oracle(got, drafts: list[int], probs: list[float]) -> None:
    assert got.tokens == drafts
    assert got.probs == pytest.approx(probs, abs=2e-4)


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


def _oracle_steps(ref: Reference, n: int, seed: int) -> list[tuple[list[int], list[float]]]:
    """The oracle's (drafts, probs) of `_steps` on a state prompted as `_prompted` does."""
    exp = Expected(ref)
    exp.add(tokens(n, seed), hiddens(n, seed))
    out = []
    for step in range(3):
        x, h = tokens(1, 10 + step)[0], hiddens(1, 10 + step)
        out.append(exp.propose(x, h, 3))
        accepted = step % 3
        exp.verdict(accepted, hiddens(accepted, 20 + step))
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


def test_one_stream_carries_many_states_in_flight(client: DrafterClient, ref: Reference) -> None:
    """Six messages of one state in flight on one stream, batched together: each answer is
    its own state's, the oracle's drafts and what the same request gets alone on a twin state."""
    states = [_prompted(client, 3 + i, 30 + i) for i in range(6)]
    twins = [_prompted(client, 3 + i, 30 + i) for i in range(6)]
    oracle = []
    for i, (state, twin) in enumerate(zip(states, twins, strict=True)):
        exp = Expected(ref)
        exp.add(tokens(3 + i, 30 + i), hiddens(3 + i, 30 + i))
        first = exp.propose(1, hiddens(1, 40 + i), 4)
        for s in (state, twin):
            _assert_oracle(client.propose(s, 1, hiddens(1, 40 + i), 4 + i, 4), *first)
        exp.verdict(0)
        oracle.append(exp.propose(2, hiddens(1, 50 + i), 4))
    alone = [
        client.propose(s, 2, hiddens(1, 50 + i), 5 + i, 4, previous=Verdict(0))
        for i, s in enumerate(twins)
    ]
    before = client.info().batch_size_counts
    with client.stream() as stream:
        futures = [
            stream.submit([s], [2], [5 + i], hiddens(1, 50 + i), 4, num_accepted=[0])
            for i, s in enumerate(states)
        ]
        results = [f.result(timeout=30).proposal(0) for f in futures]
    after = client.info().batch_size_counts
    requests = sum(n * (after.get(n, 0) - before.get(n, 0)) for n in after)
    assert requests == 6  # the server's batch-size histogram counted each request once
    assert [r.state_id for r in results] == states
    assert len({tuple(drafts) for drafts, _ in oracle}) > 1  # the answers tell states apart
    for got, one, want in zip(results, alone, oracle, strict=True):
        _assert_oracle(got, *want)
        assert got.tokens == one.tokens and got.probs == pytest.approx(one.probs, abs=1e-5)
        assert got.first_position == one.first_position
    for state in states + twins:
        client.after_verify(state, 0)
        client.free_state(state)


def test_streams_from_many_threads_at_once(client: DrafterClient, server, ref: Reference) -> None:
    """Eight verifiers, each on its own channel and stream: each gets its own state's drafts."""
    errors: list[BaseException] = []
    answers: dict[int, list] = {}

    def verifier(seed: int) -> None:
        try:
            with DrafterClient(server.address, timeout=30) as own, own.stream() as stream:
                state = _prompted(own, 5, seed)
                answers[seed] = _steps(own, state, stream.propose)
                assert all(p.state_id == state for p in answers[seed])
                own.free_state(state)
        except BaseException as exc:  # reported below
            errors.append(exc)

    seeds = [60 + i for i in range(8)]
    threads = [threading.Thread(target=verifier, args=(seed,)) for seed in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a verifier did not finish"
    assert not errors, errors
    assert sorted(answers) == seeds
    oracle = {seed: _oracle_steps(ref, 5, seed) for seed in seeds}
    assert len({tuple(o[0][0]) for o in oracle.values()}) > 1  # the answers tell states apart
    for seed in seeds:
        for got, want in zip(answers[seed], oracle[seed], strict=True):
            _assert_oracle(got, *want)


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
    forward = engine.step

    def broken_once(step):
        engine.step = forward
        raise RuntimeError("a bug in the forward")

    server = InProcessServer(engine)
    try:
        with DrafterClient(server.address) as client, client.stream() as stream:
            state = _prompted(client, 5, 1)
            engine.step = broken_once
            with pytest.raises(DrafterRpcError) as failed:
                stream.propose(state, 1, hiddens(1, 0), 6, 2)
            assert failed.value.code.name == "INTERNAL"
            assert failed.value.reason == "INTERNAL"
            # The failed forward changed nothing: the same request now drafts.
            assert stream.propose(state, 1, hiddens(1, 0), 6, 2).first_position == 7
    finally:
        server.stop()
