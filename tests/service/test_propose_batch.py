"""ProposeBatch and ProposeStream over a real server: a verifier's whole step in one message,
as columns.

Every row is checked against the float64 oracle through the rows the contract
says each state holds (tests/drafting.py), unary and on the stream; a bad row
fails alone and changes nothing; columns that do not fit together fail the call.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch
from drafting import Expected, V, hiddens, tokens
from mtp_reference import Reference
from servers import SERVER_ARGS, start_server

from mtpdraft.client import (
    AsyncDrafterClient,
    DrafterClient,
    FailedPrecondition,
    InvalidArgument,
    ProposeArgs,
    StateNotFound,
    Verdict,
)


@pytest.fixture(scope="module")
def ref(mimo_checkpoint) -> Reference:
    return Reference(mimo_checkpoint)


@pytest.fixture(scope="module")
def address(mimo_checkpoint):
    proc = start_server(mimo_checkpoint, *SERVER_ARGS)
    yield proc.address
    proc.stop()


@pytest.fixture
def client(address):
    with DrafterClient(address, timeout=30.0) as c:
        yield c
        info = c.info()
        assert info.live_states == 0 and info.kv_blocks_free == info.kv_blocks_total


class Verifier:
    """B states stepped together, and what the oracle says each must draft."""

    def __init__(self, client: DrafterClient, ref: Reference, lengths: list[int], seed: int):
        self.client, self.seed = client, seed
        self.states, self.expected = [], []
        for i, n in enumerate(lengths):
            state, exp = client.alloc_state(), Expected(ref)
            toks, hid = tokens(n, seed + i), hiddens(n, seed + i)
            client.prefill(state, toks, hid, start_position=1)
            exp.add(toks, hid)
            self.states.append(state)
            self.expected.append(exp)

    def inputs(self, step: int) -> tuple[list[int], torch.Tensor, list[int]]:
        size = len(self.states)
        toks = tokens(size, 1000 * self.seed + step)
        return (
            toks,
            hiddens(size, 1000 * self.seed + step),
            [e.next_position for e in self.expected],
        )

    def free(self) -> None:
        for state in self.states:
            self.client.free_state(state)


def assert_rows(got, expected: list[tuple[list[int], list[float]]], positions: list[int]) -> None:
    assert got.errors == {}
    width = max(len(d) for d, _ in expected)
    assert got.drafts.shape == got.probs.shape == (len(expected), width)
    for i, (drafts, probs) in enumerate(expected):
        n = len(drafts)
        assert got.counts[i] == n
        assert got.drafts[i, :n].tolist() == drafts
        assert (got.drafts[i, n:] == -1).all() and (got.probs[i, n:] == 0).all()
        np.testing.assert_allclose(got.probs[i, :n], probs, atol=2e-4)
        assert got.confidences[i] == pytest.approx(min(probs), abs=2e-4)
        assert got.first_positions[i] == positions[i] + 1


def test_steps_match_the_oracle_through_every_verdict(client, ref) -> None:
    """Three steps of four states: K per state, verdicts a = 0, some, K, refeed or not,
    a bitmask, unary and on the stream."""
    v = Verifier(client, ref, [1, 6, 13, 4], seed=3)
    try:
        ks = [3, 1, 4, 2]
        toks, hid, pos = v.inputs(0)
        got = client.propose_batch(v.states, toks, pos, hid, ks)
        want = [e.propose(toks[i], hid[i], ks[i]) for i, e in enumerate(v.expected)]
        assert_rows(got, want, pos)

        # Verdicts fused: none, all (a = K = 1), some with refeed, all (a = K = 2 of 2).
        accepted, refeed_rows = [0, 1, 2, 2], [0, 0, 2, 0]
        refeed = hiddens(2, 77)
        for i, e in enumerate(v.expected):
            e.verdict(accepted[i], refeed if refeed_rows[i] else None)
        allowed = [[t for t in range(V) if t % 3 == 1]]  # state 1's mask
        words = torch.zeros(1, (V + 31) // 32, dtype=torch.int64)
        for t in allowed[0]:
            words[0, t // 32] |= 1 << (t % 32)
        mask = torch.zeros(V, dtype=torch.bool)
        mask[allowed[0]] = True
        toks, hid, pos = v.inputs(1)
        got = client.propose_batch(
            v.states, toks, pos, hid, 3,
            num_accepted=accepted, refeed_rows=refeed_rows, refeed_hiddens=refeed,
            bitmask_rows=[0, 1, 0, 0], bitmasks=words.to(torch.int32),
        )  # fmt: skip
        want = [
            e.propose(toks[i], hid[i], 3, mask[None] if i == 1 else None)
            for i, e in enumerate(v.expected)
        ]
        assert_rows(got, want, pos)
        assert all(t % 3 == 1 for t in got.drafts[1])

        with client.stream() as stream:
            for step in (2, 3):
                for e in v.expected:
                    e.verdict(1)
                toks, hid, pos = v.inputs(step)
                got = stream.step(v.states, toks, pos, hid, 2, num_accepted=[1] * 4)
                assert_rows(
                    got, [e.propose(toks[i], hid[i], 2) for i, e in enumerate(v.expected)], pos
                )
        for state in v.states:
            client.after_verify(state, 0)
    finally:
        v.free()


def _words(allowed: list[list[int]], words: int) -> torch.Tensor:
    """xgrammar's packed int32 rows allowing each row's tokens, `words` words a row."""
    packed = torch.zeros(len(allowed), words, dtype=torch.int64)
    for row, tokens_ in enumerate(allowed):
        for t in tokens_:
            packed[row, t // 32] |= 1 << (t % 32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _mask(allowed: list[list[int]]) -> torch.Tensor:
    mask = torch.zeros(len(allowed), V, dtype=torch.bool)
    for row, tokens_ in enumerate(allowed):
        mask[row, tokens_] = True
    return mask


def test_propose_many_sends_states_given_one_by_one_as_columns(client, ref) -> None:
    """ProposeArgs of three states made into one message: hiddens of two dtypes, refeeds of
    2 rows, 1 flat row and none, bitmasks of fewer words and of two rows; each row is the
    oracle's."""
    v = Verifier(client, ref, [3, 7, 5], seed=61)
    try:
        toks, hid, pos = v.inputs(0)
        sent = [hid[0], hid[1:2].to(torch.bfloat16), hid[2].to(torch.bfloat16)]
        got = client.propose_many(
            [ProposeArgs(v.states[i], toks[i], sent[i], pos[i], 3) for i in range(3)]
        )
        want = [e.propose(toks[i], sent[i].float(), 3) for i, e in enumerate(v.expected)]
        assert_rows(got, want, pos)
        assert [p.tokens for p in got.proposals()] == [d for d, _ in want]
        assert [p.state_id for p in got.proposals()] == v.states

        refeeds = [hiddens(2, 62), hiddens(1, 63)[0], None]
        verdicts = [Verdict(2, refeeds[0]), Verdict(1, refeeds[1]), 0]
        few_words = [[t for t in range(64) if t % 5 == 0]]  # 2 words: tokens past 63 masked
        two_rows = [[t for t in range(V) if t % 2 == 0], [t for t in range(V) if t % 7 == 3]]
        masks = [_words(few_words, 2)[0], None, _words(two_rows, (V + 31) // 32)]
        for e, a, refeed in zip(v.expected, (2, 1, 0), refeeds, strict=True):
            e.verdict(a, None if refeed is None else refeed.reshape(-1, 64))
        toks, hid, pos = v.inputs(1)
        args = [
            ProposeArgs(v.states[i], toks[i], hid[i], pos[i], 3, masks[i], previous=verdicts[i])
            for i in range(3)
        ]
        got = client.propose_many(args)
        allowed = [_mask(few_words), None, _mask(two_rows)]
        want = [e.propose(toks[i], hid[i], 3, allowed[i]) for i, e in enumerate(v.expected)]
        assert_rows(got, want, pos)
        assert all(t % 5 == 0 and t < 64 for t in got.drafts[0])
        assert got.drafts[2, 0] % 2 == 0 and all(t % 7 == 3 for t in got.drafts[2, 1:])
        for state in v.states:
            client.after_verify(state, 0)
    finally:
        v.free()


def test_a_failed_row_raises_from_its_proposal_alone(client, ref) -> None:
    v = Verifier(client, ref, [4, 4], seed=65)
    try:
        toks, hid, pos = v.inputs(0)
        got = client.propose_many(
            [
                ProposeArgs(v.states[0], toks[0], hid[0], pos[0], 2),
                ProposeArgs(v.states[1], toks[1], hid[1], pos[1], 2, previous=Verdict(0)),
            ]
        )
        assert got.proposal(0).tokens == v.expected[0].propose(toks[0], hid[0], 2)[0]
        with pytest.raises(FailedPrecondition) as info:
            got.proposal(1)
        assert info.value.reason == "NO_PENDING_PROPOSAL"
        with pytest.raises(FailedPrecondition):
            got.proposals()
        client.after_verify(v.states[0], 0)
    finally:
        v.free()


def test_stream_messages_in_flight_on_one_state_are_served_in_the_order_sent(client, ref) -> None:
    """Five steps of two states sent at once, each message carrying the verdict on the
    previous one's proposal: only arrival order serves them all (a verdict before its
    proposal is NO_PENDING_PROPOSAL), and each answer is the oracle's."""
    v = Verifier(client, ref, [5, 8], seed=71)
    try:
        sent, want = [], []
        for step in range(5):
            accepted = None if step == 0 else [1, 0]
            for i, e in enumerate(v.expected):
                if accepted is not None:
                    e.verdict(accepted[i])
            toks, hid, pos = v.inputs(step)
            want.append(([e.propose(toks[i], hid[i], 2) for i, e in enumerate(v.expected)], pos))
            sent.append((toks, pos, hid, accepted))
        with client.stream() as stream:
            futures = [
                stream.submit(v.states, toks, pos, hid, 2, num_accepted=accepted)
                for toks, pos, hid, accepted in sent
            ]
            for future, (rows, pos) in zip(futures, want, strict=True):
                assert_rows(future.result(timeout=60), rows, pos)
        for state in v.states:
            client.after_verify(state, 0)
    finally:
        v.free()


def test_stream_propose_is_a_batch_of_one(client, ref) -> None:
    v = Verifier(client, ref, [6], seed=75)
    (state,), (e,) = v.states, v.expected
    try:
        toks, hid, pos = v.inputs(0)
        with client.stream() as stream:
            got = stream.propose(state, toks[0], hid[0], pos[0], 3)
            assert (got.state_id, got.first_position) == (state, pos[0] + 1)
            drafts, probs = e.propose(toks[0], hid[0], 3)
            assert got.tokens == drafts and got.probs == pytest.approx(probs, abs=2e-4)
            with pytest.raises(StateNotFound) as info:  # a failed row raises its error
                stream.propose(state ^ 1, toks[0], hid[0], 1, 3)
            assert info.value.field == "state_ids"
            with pytest.raises(InvalidArgument) as info:  # so does a message refused whole
                stream.propose(state, toks[0], hiddens(1, 0)[:, :8], pos[0] + 4, 3)
            assert (info.value.reason, info.value.field) == ("BAD_SHAPE", "hiddens")
            e.verdict(2)
            toks, hid, pos = v.inputs(1)
            got = stream.propose(state, toks[0], hid[0], e.next_position, 3, previous=2)
            assert got.tokens == e.propose(toks[0], hid[0], 3)[0]
        client.after_verify(state, 0)
    finally:
        v.free()


def test_min_confidence_per_row_and_for_all(client, ref) -> None:
    v = Verifier(client, ref, [5, 5], seed=11)
    try:
        toks, hid, pos = v.inputs(0)
        full = client.propose_batch(v.states, toks, pos, hid, 8)
        for state in v.states:
            client.after_verify(state, 0)
        for i, e in enumerate(v.expected):
            e.propose(toks[i], hid[i], 8)
            e.verdict(0)
        # Row 0 stops where its running minimum first falls below tau; row 1 drafts all.
        running = np.minimum.accumulate(full.probs[0])
        drop = next(i for i in range(1, 8) if running[i] < running[i - 1] - 1e-3)
        tau = float(running[drop] + running[drop - 1]) / 2
        toks, hid, pos = v.inputs(1)
        got = client.propose_batch(v.states, toks, pos, hid, 8, min_confidence=[tau, 0.0])
        drafts, probs = v.expected[0].propose(toks[0], hid[0], 8)
        keep = next((i for i in range(8) if min(probs[: i + 1]) < tau), 8)
        assert got.counts[0] == keep and got.drafts[0, :keep].tolist() == drafts[:keep]
        assert got.counts[1] == 8
        assert got.drafts[1].tolist() == v.expected[1].propose(toks[1], hid[1], 8)[0]
        for state in v.states:
            client.after_verify(state, 0)
    finally:
        v.free()


def test_a_bad_row_fails_alone_and_changes_nothing(client, ref) -> None:
    v = Verifier(client, ref, [3, 3, 3], seed=21)
    try:
        toks, hid, pos = v.inputs(0)
        bad_pos = [pos[0], pos[1] + 5, pos[2]]
        unknown = [*v.states[:2], v.states[2] ^ 1]
        got = client.propose_batch(unknown, toks, bad_pos, hid, 2)
        assert got.counts.tolist() == [2, 0, 0]
        assert set(got.errors) == {1, 2}
        assert (got.errors[1].reason, got.errors[1].field) == ("POSITION_MISMATCH", "positions")
        assert got.errors[1].code == grpc.StatusCode.INVALID_ARGUMENT
        assert (got.errors[2].reason, got.errors[2].field) == ("STATE_NOT_FOUND", "state_ids")
        assert (got.drafts[1:] == -1).all()
        assert got.drafts[0].tolist() == v.expected[0].propose(toks[0], hid[0], 2)[0]
        # States 1 and 2 are as they were: the same step now drafts what the oracle says.
        again = client.propose_batch(v.states[1:], toks[1:], pos[1:], hid[1:], 2)
        want = [e.propose(toks[i + 1], hid[i + 1], 2) for i, e in enumerate(v.expected[1:])]
        assert_rows(again, want, pos[1:])
        # A state twice: the second row fails, the first is answered.
        for e in v.expected:
            e.verdict(0)
        toks, hid, pos = v.inputs(1)
        got = client.propose_batch(
            [v.states[0], v.states[0]], toks[:2], [pos[0]] * 2, hid[:2], 2, num_accepted=[0, 0]
        )
        assert got.counts.tolist() == [2, 0] and got.errors[1].reason == "DUPLICATE_STATE"
        client.after_verify(v.states[0], 0)
        for state in v.states[1:]:
            client.after_verify(state, 0)
    finally:
        v.free()


def test_a_row_asking_an_absurd_k_fails_alone_and_sizes_nothing(client, ref) -> None:
    v = Verifier(client, ref, [3, 3], seed=23)
    try:
        toks, hid, pos = v.inputs(0)
        got = client.propose_batch(v.states, toks, pos, hid, [2, 2**31 - 1])
        assert got.counts.tolist() == [2, 0] and got.drafts.shape[1] <= client.info().max_drafts
        assert got.errors[1].reason == "NUM_DRAFTS_OUT_OF_RANGE"
        assert got.drafts[0, :2].tolist() == v.expected[0].propose(toks[0], hid[0], 2)[0]
        client.after_verify(v.states[0], 0)
    finally:
        v.free()


@pytest.mark.parametrize(
    "change, reason, field",
    [
        (dict(positions=[9]), "COLUMNS_MISMATCH", "positions"),
        (dict(state_ids=[]), "BATCH_SIZE_OUT_OF_RANGE", "state_ids"),
        (dict(num_drafts=[2, 2, 2]), "COLUMNS_MISMATCH", "num_drafts"),
        (dict(num_accepted=[0]), "COLUMNS_MISMATCH", "num_accepted"),
        (dict(hiddens=hiddens(3, 5)), "BAD_SHAPE", "hiddens"),
        (dict(refeed_rows=[1, 0], refeed_hiddens=hiddens(1, 6)), "COLUMNS_MISMATCH", "refeed_rows"),
        (
            dict(num_accepted=[1, 0], refeed_rows=[1, 0], refeed_hiddens=hiddens(2, 6)),
            "COLUMNS_MISMATCH",
            "refeed_hiddens",
        ),
        (
            dict(bitmask_rows=[1, 0], bitmasks=torch.zeros(2, 7, dtype=torch.int32)),
            "COLUMNS_MISMATCH",
            "bitmasks",
        ),
        (  # more words than the vocabulary has
            dict(bitmask_rows=[1, 0], bitmasks=torch.zeros(1, 8, dtype=torch.int32)),
            "BAD_SHAPE",
            "bitmasks",
        ),
    ],
)
def test_columns_that_do_not_fit_fail_the_call(client, ref, change, reason, field) -> None:
    """Checked on the server: the request is built by hand, past the client's own checks."""
    from mtpdraft.client import messages as m

    v = Verifier(client, ref, [2, 2], seed=31)
    try:
        toks, hid, pos = v.inputs(0)
        request = m.batch_request(v.states, toks, pos, hid, 2)
        for name, value in change.items():
            field_ = getattr(request, name)
            if isinstance(value, torch.Tensor):
                field_.CopyFrom(m.wire.encode(value, allowed=(1, 2, 3, 4), ndims=(1, 2)))
            else:
                del field_[:]
                field_.extend(value)
        with pytest.raises(InvalidArgument) as info:
            client._send(m.batch_call(request, 30.0))
        assert (info.value.reason, info.value.field) == (reason, field)
        # Nothing changed: the step as it should be drafts what the oracle says.
        got = client.propose_batch(v.states, toks, pos, hid, 2)
        assert_rows(got, [e.propose(toks[i], hid[i], 2) for i, e in enumerate(v.expected)], pos)
        for state in v.states:
            client.after_verify(state, 0)
    finally:
        v.free()


def test_stream_answers_a_bad_message_and_goes_on(client, ref) -> None:
    v = Verifier(client, ref, [4], seed=41)
    try:
        toks, hid, pos = v.inputs(0)
        with client.stream() as stream:
            with pytest.raises(InvalidArgument) as info:
                stream.step(v.states, toks, pos, hiddens(2, 1)[:, :8].contiguous(), 2)
            assert info.value.reason == "BAD_SHAPE"
            got = stream.step(v.states, toks, pos, hid, 2)
        assert_rows(got, [v.expected[0].propose(toks[0], hid[0], 2)], pos)
        client.after_verify(v.states[0], 0)
    finally:
        v.free()


def test_async_client_steps_alike(address, client, ref) -> None:
    v = Verifier(client, ref, [2, 9], seed=51)
    try:
        toks, hid, pos = v.inputs(0)

        async def run():
            async with AsyncDrafterClient(address, timeout=30.0) as c:
                unary = await c.propose_batch(v.states, toks, pos, hid.to(torch.bfloat16), 3)
                async with c.stream() as stream:
                    streamed = await stream.step(
                        v.states, toks2, pos2, hid2, 3, num_accepted=[0, 3]
                    )
                return unary, streamed

        want = [e.propose(toks[i], hid[i].to(torch.bfloat16), 3) for i, e in enumerate(v.expected)]
        v.expected[0].verdict(0)
        v.expected[1].verdict(3)
        toks2, hid2, pos2 = v.inputs(1)
        want2 = [e.propose(toks2[i], hid2[i], 3) for i, e in enumerate(v.expected)]
        unary, streamed = asyncio.run(run())
        assert unary.drafts.tolist() == [d for d, _ in want]
        assert_rows(streamed, want2, pos2)
        for state in v.states:
            client.after_verify(state, 0)
    finally:
        v.free()
