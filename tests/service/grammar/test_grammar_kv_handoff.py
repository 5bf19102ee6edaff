"""A state's grammar travels with its KV: TakeKV / InstallKV here, ExportKV / ImportKV
through the wire's header to another engine; the state that takes the KV drafts under
the same grammar, its matcher at the committed tokens (the oracle's masked argmax, a
matcher of the tests' own); where it cannot be carried, the import is refused whole."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from grammar_verifier import Verifier, make_engine, run
from grammars import EOS, allowed, unpacked

from mtpdraft.service import convert
from mtpdraft.service.engine.errors import FailedPrecondition
from mtpdraft.service.engine.kv_transfer import KVChunk
from mtpdraft.service.grammar.spec import GrammarChange, GrammarSpec
from mtpdraft.service.model.synthetic import write_random_checkpoint

# What it allows tells where the matcher stands: each letter once, in order, a digit
# after each.
SCHEMA = ("regex", "".join(f"{chr(c)}[0-9]" for c in range(ord("a"), ord("z") + 1)))


def next_token(v: Verifier, rng: random.Random) -> int:
    """A token the grammar allows next, not the stop token (the text goes on)."""
    ok = torch.nonzero(allowed(v.matcher)).flatten().tolist()
    return rng.choice([t for t in ok if t != EOS])


def walk(engine, v: Verifier, steps: int, rng: random.Random, seed: int) -> None:
    """`steps` Proposes under the verifier's grammar with random verdicts, each drafted as
    the oracle says; the last verdict applied with AfterVerify (the state left idle)."""
    for step in range(steps):
        token = next_token(v, rng)
        give = GrammarChange(GrammarSpec(*SCHEMA)) if v.previous is None else None
        args = v.args(token, 4, seed + step, grammar=give)
        want, masks = v.expect(args)
        result = run(engine, [args])
        got = result.drafts[0, : result.counts[0]].tolist()
        assert got == want and torch.equal(unpacked(result.grammar_masks[0]), masks)
        v.judge(got, rng.randint(0, len(got) - (EOS in got)))  # the text goes on
    engine.after_verify(v.state, v.previous)
    v.previous = None


def goes_on(engine, v: Verifier, rng: random.Random, seed: int) -> None:
    """The next Proposes on the state that took the KV: the oracle's drafts under the
    grammar at the committed tokens."""
    for step in range(3):
        token = next_token(v, rng)
        args = v.args(token, 4, seed + step)
        want, masks = v.expect(args)
        result = run(engine, [args])
        assert not result.errors
        got = result.drafts[0, : result.counts[0]].tolist()
        assert got == want and torch.equal(unpacked(result.grammar_masks[0]), masks)
        v.judge(got, rng.randint(0, len(got) - (EOS in got)))  # the text goes on


def moved(v: Verifier, state: int) -> Verifier:
    """The verifier's view of its sequence, now on `state`."""
    v.state = state
    return v


def test_take_and_install_carry_the_grammar_at_its_committed_tokens(
    head, checkpoint, ref, own_compiler
):
    engine = make_engine(head, checkpoint)
    rng = random.Random(3)
    v = Verifier(engine, ref, own_compiler, seed=1)
    v.restart(SCHEMA)
    walk(engine, v, 4, rng, 10)
    source = v.state
    taken = engine.take_kv(source)
    assert not engine.grammars.which(np.array([engine.states[source].slot]))[0]
    target = engine.alloc_state("")  # no grammar of its own: the KV's is given it
    engine.install_kv(target, taken.handle_id)
    goes_on(engine, moved(v, target), rng, 30)


def test_export_and_import_carry_the_grammar_through_the_wire_header(
    head, checkpoint, ref, own_compiler
):
    here, there = make_engine(head, checkpoint), make_engine(head, checkpoint)
    rng = random.Random(4)
    v = Verifier(engine := here, ref, own_compiler, seed=2)
    v.restart(SCHEMA)
    walk(engine, v, 4, rng, 40)
    chunk = exported(here, v.state)
    assert chunk.header.grammar.spec == GrammarSpec(*SCHEMA)
    target = there.alloc_state("", grammar=there.grammars.compile(GrammarSpec("regex", "q+")))
    imported = there.import_kv(KVChunk(chunk.header, 0, chunk.k, chunk.v, state_id=target))
    imported.finish()
    goes_on(there, moved(v, target), rng, 60)  # the KV's grammar, not the state's own


def exported(engine, state: int) -> KVChunk:
    """The state's KV as ImportKV's first message, read back from the wire's bytes."""
    export = engine.export_kv(engine.take_kv(state).handle_id)
    k, v = export.rows(0, export.header.num_rows)
    msg = convert.kv_chunk(KVChunk(export.header, 0, k, v))
    return convert.read_kv_chunk(type(msg).FromString(msg.SerializeToString()))


def test_kv_whose_grammar_cannot_be_carried_is_refused_and_changes_nothing(
    head, checkpoint, ref, own_compiler, tmp_path
):
    here = make_engine(head, checkpoint)
    v = Verifier(here, ref, own_compiler, seed=3)
    v.restart(SCHEMA)
    walk(here, v, 2, random.Random(5), 80)
    chunk = exported(here, v.state)
    # A server that serves no grammars (no tokenizer): refused rather than taken without.
    plain = make_engine(head, write_random_checkpoint(tmp_path, "mimo", seed=5))
    state = plain.alloc_state("")
    with pytest.raises(FailedPrecondition) as err:
        plain.import_kv(KVChunk(chunk.header, 0, chunk.k, chunk.v, state_id=state))
    assert err.value.reason == "GRAMMARS_UNAVAILABLE" and err.value.field == "header.grammar"
    assert plain.states[state].num_rows == 0 and not plain.states[state].prefilling
    # Tokens the grammar refuses (the exporting server read token ids otherwise).
    there = make_engine(head, checkpoint)
    state = there.alloc_state("")
    chunk.header.grammar.tokens = [ord("}"), *chunk.header.grammar.tokens]
    with pytest.raises(FailedPrecondition) as err:
        there.import_kv(KVChunk(chunk.header, 0, chunk.k, chunk.v, state_id=state))
    assert err.value.reason == "KV_GRAMMAR_MISMATCH"
    assert there.states[state].num_rows == 0 and not there.grammars.matchers
    assert there.pool.num_free == there.pool.num_total
