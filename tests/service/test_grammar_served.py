"""Grammar states over a real server: AllocState's grammar through the Python clients,
drafts held to the float64 oracle's masked argmax, refusals by code, reason and field."""

from __future__ import annotations

import asyncio
import random

import grpc
import numpy as np
import pytest
import torch
import xgrammar
from drafting import Expected, hiddens
from grammars import (
    EOS,
    allowed,
    compiler,
    masks_along,
    oracle_drafts,
    unpacked,
    write_tokenizer,
)
from mtp_reference import Reference
from servers import PATIENCE, SERVER_ARGS, start_server

from mtpdraft.client import (
    AsyncDrafterClient,
    DrafterClient,
    FailedPrecondition,
    Grammar,
    InvalidArgument,
    Verdict,
)
from mtpdraft.service.model.synthetic import write_random_checkpoint

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = write_random_checkpoint(
        tmp_path_factory.mktemp("grammar"), "mimo", seed=5, extra_config={"eos_token_id": EOS}
    )
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def grammar_server(checkpoint):
    proc = start_server(checkpoint, *SERVER_ARGS, "--grammar-compile-timeout", "20")
    yield proc
    proc.stop()


def test_a_served_grammar_state_drafts_the_oracles_masked_argmax(grammar_server, checkpoint):
    ref, rng = Reference(checkpoint), random.Random(3)
    matcher = xgrammar.GrammarMatcher(compiler().compile_json_schema(SCHEMA))
    with DrafterClient(grammar_server.address, timeout=PATIENCE) as drafter:
        info = drafter.info()
        assert info.grammar_kinds == ("json_schema", "ebnf", "regex", "structural_tag")
        state = drafter.alloc_state(Grammar(json_schema=SCHEMA))
        exp = Expected(ref)
        prompt = hiddens(4, 1)
        drafter.prefill(state, [1, 2, 3, 4], prompt.numpy(), start_position=1)
        exp.add([1, 2, 3, 4], prompt)
        previous, drafted = None, 0
        with drafter.stream() as stream:
            for step in range(6):
                token = rng.choice(torch.nonzero(allowed(matcher)).flatten().tolist())
                assert matcher.accept_token(token)
                hidden = hiddens(1, 100 + step)[0]
                exp.add([token], hidden)
                want, probs, outs = oracle_drafts(ref, exp.tokens, exp.hiddens, 4, matcher)
                exp.last = (want, outs)
                got = stream.propose(
                    state,
                    token,
                    hidden.numpy(),
                    exp.next_position - 1,
                    4,
                    previous=previous,
                    return_bitmasks=step % 2 == 0,
                )
                assert got.tokens == want
                if step % 2 == 0:  # the verifier's masks: the grammar's at each position
                    assert torch.equal(unpacked(got.bitmasks), masks_along(matcher, want))
                else:
                    assert got.bitmasks is None
                np.testing.assert_allclose(got.probs, probs, rtol=1e-4, atol=1e-5)
                drafted += len(want)
                a = rng.randint(0, len(want))
                for d in want[:a]:
                    assert matcher.accept_token(d)
                exp.verdict(a)
                previous = Verdict(a)
        assert drafted > 6
        assert drafter.free_state(state)


def test_bad_grammars_are_refused_by_reason_and_field(grammar_server):
    with DrafterClient(grammar_server.address, timeout=PATIENCE) as drafter:
        with pytest.raises(InvalidArgument) as err:
            drafter.alloc_state(Grammar(ebnf="root ::= nothing"))
        assert err.value.reason == "GRAMMAR_INVALID" and err.value.field == "grammar"
        assert 'Rule "nothing" is not defined' in str(err.value)
        with pytest.raises(ValueError):
            drafter.alloc_state(Grammar(regex="a", ebnf='root ::= "a"'))
        assert drafter.info().live_states == 0


def test_a_refused_token_is_a_row_error_over_the_wire(grammar_server):
    async def run():
        async with AsyncDrafterClient(grammar_server.address, timeout=PATIENCE) as drafter:
            state = await drafter.alloc_state(Grammar(regex="[0-9]+"))
            try:
                with pytest.raises(InvalidArgument) as err:
                    await drafter.propose(state, ord("x"), hiddens(1, 1)[0].numpy(), 1, 2)
                assert err.value.reason == "TOKEN_REJECTED_BY_GRAMMAR"
                got = await drafter.propose(
                    state, ord("7"), hiddens(1, 1)[0].numpy(), 1, 3, return_bitmasks=True
                )
                assert got.tokens and all(chr(t).isdigit() for t in got.tokens if t != EOS)
                digits = unpacked(got.bitmasks)[:, ord("0") : ord("9") + 1]
                assert got.bitmasks.shape == (len(got.tokens) + 1, 7) and digits.all()
            finally:
                await drafter.free_state(state)

    asyncio.run(run())


def test_a_server_without_a_tokenizer_serves_no_grammar(client):
    assert client.info().grammar_kinds == ()
    with pytest.raises(FailedPrecondition) as err:
        client.alloc_state(Grammar(regex="a+"))
    assert err.value.reason == "GRAMMARS_UNAVAILABLE"
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_a_batch_answers_its_grammar_rows_bitmasks(grammar_server):
    with DrafterClient(grammar_server.address, timeout=PATIENCE) as drafter:
        free, digits = drafter.alloc_state(), drafter.alloc_state(Grammar(regex="[0-9]{2}"))
        try:
            step = drafter.propose_batch(
                [free, digits], [5, ord("4")], [1, 1], hiddens(2, 3).numpy(), 3,
                return_bitmasks=True,
            )  # fmt: skip
            assert set(step.bitmasks) == {1}
            assert step.proposal(0).bitmasks is None
            masks = unpacked(step.proposal(1).bitmasks)
            # After "4": one digit more, then only the checkpoint's stop token, then nothing.
            assert step.counts[1] == 2 and chr(step.drafts[1, 0]).isdigit()
            assert step.drafts[1, 1] == EOS
            assert masks[0, ord("0") : ord("9") + 1].all() and masks[0].sum() == 10
            assert masks[1].tolist() == [t == EOS for t in range(masks.shape[1])]
            assert not masks[2].any()  # after the stop token: the grammar has ended
        finally:
            drafter.free_state(free)
            drafter.free_state(digits)
