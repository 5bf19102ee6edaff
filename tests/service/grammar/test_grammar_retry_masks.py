"""A retried step (its number, at its pending proposal's position) is answered with the
grammar's bitmasks its first answer had, in a batch of its own or beside new rows."""

from __future__ import annotations

import torch
from grammar_verifier import Verifier, make_engine, run
from grammars import unpacked

from mtpdraft.service.engine.types import Verdict
from mtpdraft.service.grammar.spec import GrammarChange, GrammarSpec

REGEX = ("regex", "(ab|cd){1,4}")


def test_a_retry_answers_the_first_answers_bitmasks(head, checkpoint, ref, own_compiler):
    engine = make_engine(head, checkpoint)
    v = Verifier(engine, ref, own_compiler, seed=1)
    w = Verifier(engine, ref, own_compiler, seed=2)
    v.restart(REGEX)
    first = v.args(ord("a"), 4, 5, grammar=GrammarChange(GrammarSpec(*REGEX)), step_number=1)
    want, masks = v.expect(first)
    answer = run(engine, [first])
    assert answer.drafts[0, : answer.counts[0]].tolist() == want
    assert torch.equal(unpacked(answer.grammar_masks[0]), masks)
    # Sent again, alone and then behind another state's new step: the same masks.
    alone = run(engine, [first])
    beside = run(engine, [w.args(7, 2, 6), first])
    for again, row in ((alone, 0), (beside, 1)):
        assert not again.errors
        assert again.drafts[row, : again.counts[row]].tolist() == want
        assert torch.equal(again.grammar_masks[row], answer.grammar_masks[0])
    assert 0 not in beside.grammar_masks  # w has no grammar
    # The verdict ends the proposal: its masks are not kept past it.
    engine.after_verify(v.state, Verdict(0))
    assert engine.states[v.state].slot not in engine.table.pending_masks
