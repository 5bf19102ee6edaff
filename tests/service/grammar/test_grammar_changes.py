"""A Propose gives its state a grammar, another one, or none, from its own token on: the
drafts of that step on are the oracle's masked argmax under a matcher of the tests' own
started at that token; a grammar refused fails its row alone and changes nothing."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from grammar_verifier import Verifier, make_engine, run
from grammars import allowed, unpacked

from mtpdraft.service import convert
from mtpdraft.service.engine import columns
from mtpdraft.service.engine.errors import InvalidArgument
from mtpdraft.service.grammar.spec import GrammarChange, GrammarSpec
from mtpdraft.v1 import drafter_pb2 as pb

REGEX = ("regex", "(ab|cd){1,4}")
EBNF = ("ebnf", 'root ::= "x" ("=" [0-9]+)* ";"')


@pytest.fixture
def engine(head, checkpoint):
    return make_engine(head, checkpoint)


def change(grammar: tuple[str, str] | None) -> GrammarChange:
    return GrammarChange(None if grammar is None else GrammarSpec(*grammar))


def first_token(v: Verifier, rng: random.Random) -> int:
    """A token the verifier's grammar allows next (any token without one)."""
    if v.matcher is None:
        return rng.randrange(128)
    return rng.choice(torch.nonzero(allowed(v.matcher)).flatten().tolist())


def test_a_propose_sets_changes_and_clears_its_states_grammar(engine, ref, own_compiler):
    """None, then a regex, the regex kept, an EBNF grammar, kept, then none: every step's
    drafts (and the grammar's masks) are the oracle's under the grammar the verifier
    gave, its matcher started at that step's token; the accepted drafts of a verdict
    given with a new grammar are the old grammar's."""
    v = Verifier(engine, ref, own_compiler, seed=1)
    other = Verifier(engine, ref, own_compiler, seed=2)  # no grammar, in every batch
    rng = random.Random(4)
    plan = [("keep", None), ("set", REGEX), ("keep", None), ("keep", None), ("set", EBNF),
            ("keep", None), ("set", None), ("keep", None)]  # fmt: skip
    constrained = 0
    for step, (what, grammar) in enumerate(plan):
        if what == "set":
            v.restart(grammar)
        token = first_token(v, rng)
        args = v.args(token, 4, 100 + step, grammar=change(grammar) if what == "set" else None)
        free = other.args(rng.randrange(128), 3, 200 + step)
        want, masks = v.expect(args)
        want_free, _ = other.expect(free)
        result = run(engine, [args, free])
        assert not result.errors
        got = result.drafts[0, : result.counts[0]].tolist()
        assert got == want, step
        assert result.drafts[1, : result.counts[1]].tolist() == want_free
        if masks is None:
            assert 0 not in result.grammar_masks
        else:
            constrained += 1
            assert torch.equal(unpacked(result.grammar_masks[0]), masks)
        assert 1 not in result.grammar_masks
        v.judge(got, rng.randint(0, len(got)))
        other.judge(want_free, rng.randint(0, len(want_free)))
    assert constrained == 5
    assert not engine.grammars.which(np.array([engine.states[v.state].slot]))[0]


def test_a_grammar_given_to_a_state_with_none_masks_that_steps_drafts(engine, ref, own_compiler):
    v = Verifier(engine, ref, own_compiler, seed=3)
    v.restart(("regex", "[0-4]{6}"))
    args = v.args(ord("2"), 5, 7, grammar=change(("regex", "[0-4]{6}")))
    want, _ = v.expect(args)
    result = run(engine, [args])
    got = result.drafts[0, : result.counts[0]].tolist()
    assert got == want and got and all(ord("0") <= d <= ord("4") for d in got)


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (GrammarChange(GrammarSpec("regex", "[a-")), "GRAMMAR_INVALID"),
        (GrammarChange(GrammarSpec("lark", "start: x")), "GRAMMAR_KIND"),
        (GrammarChange(GrammarSpec("regex", "z+")), "TOKEN_REJECTED_BY_GRAMMAR"),
    ],
)
def test_a_refused_grammar_fails_its_row_alone_and_changes_nothing(
    engine, ref, own_compiler, bad, reason
):
    """A grammar that does not compile, or whose matcher refuses the step's token: that
    row fails (its field named), the other row is drafted, and the state keeps its
    grammar, its pending proposal and its rows: the same step without the bad grammar
    then drafts under the old grammar, its verdict applied once."""
    v = Verifier(engine, ref, own_compiler, seed=4)
    w = Verifier(engine, ref, own_compiler, seed=5)
    v.restart(REGEX)
    first = v.args(ord("a"), 3, 10, grammar=change(REGEX))
    want, _ = v.expect(first)
    result = run(engine, [first])
    drafts = result.drafts[0, : result.counts[0]].tolist()
    assert drafts == want
    v.judge(drafts, 1)
    state = engine.states[v.state]
    rows, pending = state.num_rows, state.pending
    token = first_token(v, random.Random(1))
    refused = v.args(token, 3, 11, grammar=bad)
    free = w.args(9, 2, 12)
    result = run(engine, [refused, free])
    err = result.errors[0]
    assert isinstance(err, InvalidArgument) and err.reason == reason
    assert err.field == ("token" if reason == "TOKEN_REJECTED_BY_GRAMMAR" else "grammar")
    assert 1 not in result.errors and result.counts[1] > 0
    assert state.num_rows == rows and state.pending == pending
    again = v.args(token, 3, 11)
    want, masks = v.expect(again)
    result = run(engine, [again])
    assert not result.errors
    assert result.drafts[0, : result.counts[0]].tolist() == want
    assert torch.equal(unpacked(result.grammar_masks[0]), masks)


def test_a_batch_message_names_its_grammar_rows(head, checkpoint):
    """ProposeBatchRequest.grammar_rows / grammars: a change per row listed, none
    elsewhere; Grammar.none a clear; a Grammar that names nothing that row's refusal;
    rows and values that do not pair refuse the message."""
    shape = make_engine(head, checkpoint).step_shape
    msg = pb.ProposeBatchRequest(
        state_ids=[1, 2, 3, 4], tokens=[1, 2, 3, 4], positions=[1, 1, 1, 1], num_drafts=[2],
        grammar_rows=[0, 2, 3],
        grammars=[pb.Grammar(regex="a+"), pb.Grammar(none=True), pb.Grammar(none=False)],
    )  # fmt: skip
    msg.hiddens.CopyFrom(convert.tensor(torch.zeros(4, shape.hidden_size)))
    step = convert.batch(msg, shape)
    g = step.grammars
    assert g[0].spec == GrammarSpec("regex", "a+") and g[0].error is None
    assert g[1] is None
    assert g[2].spec is None and g[2].error is None
    assert g[3].error.reason == "GRAMMAR_KIND" and g[3].error.field == "grammar"
    empty = convert.grammar_change(pb.Grammar())
    assert empty.error.reason == "MISSING_FIELD"
    assert convert.COLUMN_OF_FIELD["grammar"] == "grammars"
    for rows in ([0, 0], [4], [1, 0]):
        with pytest.raises(InvalidArgument) as err:
            columns.step(
                shape, state_ids=[1, 2, 3, 4], tokens=[1] * 4, positions=[1] * 4,
                hiddens=torch.zeros(4, shape.hidden_size), num_drafts=[2],
                grammar_rows=rows, grammars=[change(None)] * len(rows),
            )  # fmt: skip
        assert err.value.reason == "COLUMNS_MISMATCH" and err.value.field == "grammar_rows"
    single = pb.ProposeRequest(state_id=1, token=1, position=1, num_drafts=2)
    single.hidden.CopyFrom(convert.tensor(torch.zeros(shape.hidden_size)))
    assert convert.propose(single, shape).grammars[0] is None
    single.grammar.ebnf = 'root ::= "x"'
    assert convert.propose(single, shape).grammars[0].spec == GrammarSpec("ebnf", 'root ::= "x"')
    assert convert.grammar(pb.AllocStateRequest(grammar=pb.Grammar(none=True))) is None
