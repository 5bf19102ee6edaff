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
from grammars import EOS, allowed, compiler, oracle_drafts, write_tokenizer
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
                    state, token, hidden.numpy(), exp.next_position - 1, 4, previous=previous
                )
                assert got.tokens == want
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
                got = await drafter.propose(state, ord("7"), hiddens(1, 1)[0].numpy(), 1, 3)
                assert got.tokens and all(chr(t).isdigit() for t in got.tokens if t != EOS)
            finally:
                await drafter.free_state(state)

    asyncio.run(run())


def test_a_server_without_a_tokenizer_serves_no_grammar(client):
    assert client.info().grammar_kinds == ()
    with pytest.raises(FailedPrecondition) as err:
        client.alloc_state(Grammar(regex="a+"))
    assert err.value.reason == "GRAMMARS_UNAVAILABLE"
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
