"""Grammar states in-process: every draft obeys the state's grammar and is the float64
oracle's masked argmax; the state's matcher follows the verifier's committed tokens only."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch
import xgrammar
from drafting import Expected, H, V, hiddens
from grammars import (
    EOS,
    allowed,
    compile_kind,
    masks_along,
    oracle_drafts,
    unpacked,
)
from proposing import ProposeArgs, propose, step_of

from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.engine.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from mtpdraft.service.engine.sampling import Sampling
from mtpdraft.service.engine.types import Verdict
from mtpdraft.service.grammar.spec import GrammarSpec
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.mtp_head import MTPHead
from mtpdraft.service.model.synthetic import write_random_checkpoint

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "tag": {"type": "string", "maxLength": 4}},
        "required": ["id", "tag"],
        "additionalProperties": False,
    }
)
REGEX = "(ab|cd){1,3}"
EBNF = 'root ::= "x" ("=" [0-9]+)* ";"'
STRUCTURAL = json.dumps(
    {
        "type": "structural_tag",
        "format": {"type": "const_string", "value": "ok"},
    }
)
GRAMMARS = [("json_schema", SCHEMA), ("regex", REGEX), ("ebnf", EBNF)]


def make_engine(head, checkpoint, **config) -> DraftEngine:
    defaults = {"kv_blocks": 256, "block_size": 4, "max_drafts": 8, "model": str(checkpoint)}
    return DraftEngine(head, ServeConfig(**{**defaults, **config}))


@pytest.fixture
def engine(head, checkpoint) -> DraftEngine:
    return make_engine(head, checkpoint)


def start(engine, grammar=None, prompt=6, seed=0):
    """A state with `prompt` rows, its Expected rows and its independent matcher."""
    state = engine.alloc_state("", grammar=grammar)
    toks = torch.randint(0, 128, (prompt,), generator=torch.Generator().manual_seed(seed))
    hid = hiddens(prompt, seed)
    session = engine.begin_prefill(state, 1)
    session.append(toks.tolist(), hid)
    session.finish()
    return state, toks.tolist(), hid


class Sequence:
    """One state as a verifier sees it: its rows (Expected), its grammar's independent
    matcher (None: no grammar), the pending proposal."""

    def __init__(self, engine, ref, own_compiler, kind_source, seed):
        self.grammar = None
        if kind_source is not None:
            self.grammar = engine.grammars.compile(GrammarSpec(*kind_source))
        self.state, toks, hid = start(engine, self.grammar, seed=seed)
        self.exp = Expected(ref)
        self.exp.add(toks, hid)
        self.matcher = None
        if kind_source is not None:
            self.matcher = xgrammar.GrammarMatcher(compile_kind(own_compiler, *kind_source))
        self.committed: list[int] = []

    def choose_token(self, rng) -> int | None:
        """A token the target might sample: one the grammar allows (None: it has ended)."""
        if self.matcher is None:
            return rng.randrange(V)
        ok = torch.nonzero(allowed(self.matcher)).flatten().tolist()
        return rng.choice(ok) if ok else None

    def commit(self, tokens: list[int]) -> None:
        self.committed += tokens
        if self.matcher is not None:
            for t in tokens:
                assert self.matcher.accept_token(t)

    def expected(self, token, hidden, k, min_confidence):
        self.exp.add([token], hidden)
        if self.matcher is None:
            drafts, probs, outs = self.exp.ref.propose(self.exp.tokens, self.exp.hiddens, k)
            running = np.minimum.accumulate(probs)
            n = int((running >= min_confidence).sum())
            drafts, probs = drafts[:n], probs[:n]
        else:
            drafts, probs, outs = oracle_drafts(
                self.exp.ref, self.exp.tokens, self.exp.hiddens, k, self.matcher, min_confidence
            )
        self.exp.last = (drafts, outs)
        return drafts, probs


def test_grammar_drafts_are_the_oracles_masked_argmax_through_random_verdicts(
    engine, ref, own_compiler
):
    """A long randomized session of grammar states and one without, in one batch each
    step: random K, min_confidence, verdicts and refeeds; each proposal equals the float64
    oracle's under the grammar at the committed tokens, and every draft is one that an
    independent matcher, moved on only by committed tokens, allows."""
    session(engine, ref, own_compiler)


@pytest.mark.gpu
def test_grammar_states_replay_cuda_graphs_as_eager_launches_do(checkpoint, own_compiler):
    """On the GPU a grammar state's one-step chains replay the captured graphs (whose
    outputs the next replay overwrites): the drafts equal an eager engine's, bit for bit,
    through random verdicts, and obey the grammar."""
    head = MTPHead(load_mtp_weights(checkpoint), torch.device("cuda"), torch.float32)
    graphed = make_engine(head, checkpoint, max_batch=8)
    eager = make_engine(head, checkpoint, max_batch=8, cuda_graphs=False)
    assert head._graphs is not None
    rng = random.Random(5)
    runs = []
    for engine in (graphed, eager):
        states = []
        for i, g in enumerate([*GRAMMARS, None]):
            grammar = None if g is None else engine.grammars.compile(GrammarSpec(*g))
            matcher = None if g is None else xgrammar.GrammarMatcher(compile_kind(own_compiler, *g))
            states.append((start(engine, grammar, seed=i)[0], matcher))
        runs.append(states)
    previous, position = [None] * 4, [7] * 4
    for step in range(10):
        tokens = []
        for _state, matcher in runs[0]:
            ok = torch.ones(V, dtype=torch.bool) if matcher is None else allowed(matcher)
            tokens.append(rng.choice(torch.nonzero(ok).flatten().tolist()) if ok.any() else None)
        live = [i for i, t in enumerate(tokens) if t is not None]
        k = [rng.randint(1, 6) for _ in live]
        hidden = hiddens(len(live), 1000 + step)
        results = []
        for engine, states in zip((graphed, eager), runs, strict=True):
            rows = [
                ProposeArgs(states[i][0], tokens[i], hidden[j], position[i], k[j], None, 0.0,
                            previous[i])
                for j, i in enumerate(live)
            ]  # fmt: skip
            results.append(engine.step(step_of(rows, engine.step_shape)))
        a_res, b_res = results
        assert not a_res.errors and not b_res.errors
        assert np.array_equal(a_res.drafts, b_res.drafts) and np.array_equal(
            a_res.probs, b_res.probs
        )
        for j, i in enumerate(live):
            drafts = a_res.drafts[j, : a_res.counts[j]].tolist()
            matcher = runs[0][i][1]
            if matcher is not None:
                assert matcher.accept_token(tokens[i])
                fork = matcher.fork()
                assert all(fork.accept_token(d) for d in drafts)
            a = rng.randint(0, len(drafts))
            if matcher is not None:
                assert all(matcher.accept_token(d) for d in drafts[:a])
            previous[i], position[i] = Verdict(a), position[i] + a + 1


def session(engine, ref, own_compiler) -> None:
    rng = random.Random(11)
    seqs = [Sequence(engine, ref, own_compiler, g, seed=i) for i, g in enumerate(GRAMMARS)]
    seqs.append(Sequence(engine, ref, own_compiler, None, seed=9))
    verdicts = {}
    drafted = ended = 0
    for _step in range(14):
        requests, expect = [], []
        for seq in seqs:
            previous = verdicts.pop(seq.state, None)
            token = seq.choose_token(rng)
            if token is None:  # its grammar has ended: the verifier would free it
                continue
            seq.commit([token])
            k = rng.randint(1, 6)
            tau = rng.choice([0.0, 0.0, 0.3])
            hidden = hiddens(1, rng.randrange(10**6))[0]
            position = seq.exp.next_position
            expect.append((seq, seq.expected(token, hidden, k, tau)))
            requests.append(ProposeArgs(seq.state, token, hidden, position, k, None, tau, previous))
        if not requests:
            break
        step = step_of(requests, engine.step_shape)
        result = engine.step(step)
        assert not result.errors
        for i, (seq, (drafts, probs)) in enumerate(expect):
            got = result.drafts[i, : result.counts[i]].tolist()
            assert got == drafts, (seq.grammar is not None, i)
            np.testing.assert_allclose(result.probs[i, : len(got)], probs, rtol=1e-4, atol=1e-5)
            if seq.matcher is not None:
                fork = seq.matcher.fork()
                assert all(fork.accept_token(d) for d in got)
                drafted += len(got)
                ended += fork.is_terminated()
                # What a verifier masks its logits with: the grammar's at each position.
                masks = unpacked(result.grammar_masks[i])
                assert torch.equal(masks, masks_along(seq.matcher, got))
            else:
                assert i not in result.grammar_masks
            a = rng.randint(0, len(got))
            refeed = hiddens(a, rng.randrange(10**6)) if a and rng.random() < 0.5 else None
            verdicts[seq.state] = Verdict(a, refeed)
            seq.exp.verdict(a, None if refeed is None else refeed.double())
            seq.commit(got[:a])
    assert drafted > 30  # the session drafted under grammars, not around them
    for seq in seqs:
        engine.free_state(seq.state)
    assert not engine.grammars.matchers


def test_every_draft_of_a_grammar_is_valid_text(engine, ref, own_compiler):
    """Decoded, a regex state's drafts after its committed text stay a prefix the regex
    can finish, and the stop token comes only where the text matches it whole."""
    seq = Sequence(engine, ref, own_compiler, ("regex", REGEX), seed=3)
    token = seq.choose_token(random.Random(0))
    seq.commit([token])
    proposal = propose(engine, ProposeArgs(seq.state, token, hiddens(1, 5)[0], 7, 8))
    text = bytes([token, *(d for d in proposal.tokens if d != EOS)]).decode()
    assert re.fullmatch(r"((ab|cd){0,3})(a|c)?", text), text
    if EOS in proposal.tokens:
        assert proposal.tokens[-1] == EOS and re.fullmatch(REGEX, text)
    assert len(proposal.tokens) <= 7  # at most three pairs and the stop token


def test_a_finished_grammar_gets_no_drafts_and_refuses_more_tokens(engine, ref, own_compiler):
    seq = Sequence(engine, ref, own_compiler, ("ebnf", 'root ::= "x"'), seed=4)
    first = propose(engine, ProposeArgs(seq.state, ord("x"), hiddens(1, 1)[0], 7, 4))
    assert first.tokens == [EOS]  # all the grammar allows after "x"
    done = propose(engine, ProposeArgs(seq.state, EOS, hiddens(1, 2)[0], 8, 4, previous=Verdict(0)))
    assert done.tokens == [] and done.confidence == 0.0
    with pytest.raises(InvalidArgument) as err:
        propose(engine, ProposeArgs(seq.state, 5, hiddens(1, 3)[0], 9, 4, previous=Verdict(0)))
    assert err.value.reason == "TOKEN_REJECTED_BY_GRAMMAR" and err.value.field == "token"
    assert "has ended" in err.value.message


def test_a_token_the_grammar_refuses_fails_its_row_alone_and_changes_nothing(
    engine, ref, own_compiler
):
    a = Sequence(engine, ref, own_compiler, ("regex", REGEX), seed=1)
    b = Sequence(engine, ref, own_compiler, ("regex", REGEX), seed=2)
    a.commit([ord("a")])
    drafts, _ = a.expected(ord("a"), hiddens(1, 7)[0], 3, 0.0)
    step = step_of(
        [
            ProposeArgs(a.state, ord("a"), hiddens(1, 7)[0], 7, 3),
            ProposeArgs(b.state, ord("z"), hiddens(1, 8)[0], 7, 3),
        ],
        engine.step_shape,
    )
    result = engine.step(step)
    assert result.drafts[0, : result.counts[0]].tolist() == drafts
    assert result.errors[1].reason == "TOKEN_REJECTED_BY_GRAMMAR"
    assert engine.states[b.state].pending is None and engine.states[b.state].num_rows == 6
    b.commit([ord("c")])  # b's matcher stayed at the start: "c" is allowed there
    want, _ = b.expected(ord("c"), hiddens(1, 9)[0], 3, 0.0)
    assert propose(engine, ProposeArgs(b.state, ord("c"), hiddens(1, 9)[0], 7, 3)).tokens == want


def test_a_client_bitmask_narrows_the_grammar(engine, ref, own_compiler):
    """The client's bitmask rows and the grammar both hold: their AND masks the logits."""
    seq = Sequence(engine, ref, own_compiler, ("json_schema", SCHEMA), seed=6)
    seq.commit([ord("{")])
    words = (V + 31) // 32
    only = torch.zeros(V, dtype=torch.bool)
    only[[ord(c) for c in ' "\n\tid']] = True
    bitmask = torch.zeros(words * 32, dtype=torch.int64)
    bitmask[:V] = only.long()
    packed = (bitmask.view(words, 32) << torch.arange(32)).sum(1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    hidden = hiddens(1, 12)[0]
    seq.exp.add([ord("{")], hidden)
    want, _, _ = oracle_drafts(
        ref, seq.exp.tokens, seq.exp.hiddens, 5, seq.matcher, extra=only[None]
    )
    got = propose(engine, ProposeArgs(seq.state, ord("{"), hidden, 7, 5, packed[None]))
    assert got.tokens == want
    assert set(got.tokens) <= {ord(c) for c in ' "\n\tid'}


def test_only_grammar_states_pay_the_step_by_step_chain(engine, head, monkeypatch):
    """States without a grammar keep the one-chain path; with a grammar state in the batch
    they are still drafted by it, in one chain of their own."""
    chains = []
    real = head.decode_chain
    monkeypatch.setattr(head, "decode_chain", lambda kv, c, *a: chains.append(c) or real(kv, c, *a))
    free, *_ = start(engine, seed=1)
    propose(engine, ProposeArgs(free, 3, hiddens(1, 1)[0], 7, 4))
    assert [c.steps for c in chains] == [4]
    grammar = engine.grammars.compile(GrammarSpec("regex", "[a-z]{8}"))
    constrained, *_ = start(engine, grammar, seed=2)
    chains.clear()
    rows = [
        ProposeArgs(free, 3, hiddens(1, 2)[0], 8, 4, previous=Verdict(0)),
        ProposeArgs(constrained, ord("q"), hiddens(1, 3)[0], 7, 4),
    ]
    result = engine.step(step_of(rows, engine.step_shape))
    assert not result.errors and result.counts.tolist() == [4, 4]
    assert [(len(c), c.steps) for c in chains] == [(1, 1)] * 4 + [(1, 4)]


def test_grammars_compile_once_and_refuse_bad_ones_by_name(engine):
    grammars = engine.grammars
    spec = GrammarSpec("json_schema", SCHEMA)
    one, two = grammars.compile(spec), grammars.compile(GrammarSpec("json_schema", SCHEMA))
    assert one is two and grammars.compiler.compilations == 1
    for kind, source, words in [
        ("json_schema", "{not json", "Failed to parse JSON"),
        ("ebnf", "root ::= missing", 'Rule "missing" is not defined'),
        ("regex", "[a-", "Unclosed"),
        ("structural_tag", "{}", "format"),
        ("lark", "start: x", "none of json_schema"),
    ]:
        with pytest.raises(InvalidArgument) as err:
            grammars.compile(GrammarSpec(kind, source))
        assert err.value.field == "grammar" and words in err.value.message
        assert err.value.reason == ("GRAMMAR_KIND" if kind == "lark" else "GRAMMAR_INVALID")
        assert ".cc:" not in err.value.message
    assert grammars.compile(GrammarSpec("structural_tag", STRUCTURAL)) is not None


def test_a_slow_compilation_is_refused_in_time_and_cached_when_done(head, checkpoint):
    engine = make_engine(head, checkpoint, grammar_compile_timeout=0.01)
    fields = {f"field_{i}": {"type": "string", "pattern": "[a-z]{3,9}"} for i in range(200)}
    schema = {"type": "object", "properties": fields, "required": list(fields)}
    spec = GrammarSpec("json_schema", json.dumps(schema))  # about 0.5 s to compile
    with pytest.raises(DeadlineExceeded) as err:
        engine.grammars.compile(spec)
    assert err.value.reason == "GRAMMAR_COMPILE_TIMEOUT" and err.value.field == "grammar"
    compiler = engine.grammars.compiler
    assert compiler.cached(spec)
    compiler.timeout = 30.0  # the compilation went on: the same grammar is now cached
    assert compiler.compile(spec) is not None and compiler.compilations == 1


def test_no_tokenizer_no_grammars(head, tmp_path):
    folder = write_random_checkpoint(tmp_path, "mimo", seed=5)
    engine = make_engine(head, folder)
    assert engine.info().grammar_kinds == ()
    with pytest.raises(FailedPrecondition) as err:
        engine.grammars.compile(GrammarSpec("regex", "a"))
    assert err.value.reason == "GRAMMARS_UNAVAILABLE" and "no tokenizer.json" in err.value.message
    shipped = make_engine(head, folder, tokenizer=str(folder.parent))  # no file there either
    assert shipped.info().grammar_kinds == ()


def test_the_default_checkpoint_ships_its_byte_tokenizer():
    from mtpdraft.service.grammar.tokenizer import tokenizer_file, tokenizer_info
    from mtpdraft.service.model.default_model import DEFAULT_CHECKPOINT

    info = tokenizer_info(tokenizer_file(DEFAULT_CHECKPOINT), 256, [])
    assert info.decoded_vocab == [bytes([i]) for i in range(256)]
    assert info.stop_token_ids == []
    assert H == 64


def test_sampled_drafts_are_drawn_from_the_grammars_masked_distribution(engine, own_compiler):
    """A sampled grammar state's drafts obey its grammar and each draft's q holds only
    tokens the grammar allows there (q is the masked distribution), its probabilities
    summing to 1; a greedy state of the same batch answers q as its drafts alone."""
    sampled = Sampling(temperature=1.5, seed=7)
    grammar = engine.grammars.compile(GrammarSpec("json_schema", SCHEMA))
    state = engine.alloc_state("", sampled, grammar=grammar)
    free = engine.alloc_state("")
    for s, seed in ((state, 1), (free, 2)):
        session = engine.begin_prefill(s, 1)
        session.append([1, 2, 3, 4, 5, 6], hiddens(6, seed))
        session.finish()
    matcher = xgrammar.GrammarMatcher(compile_kind(own_compiler, "json_schema", SCHEMA))
    rng = random.Random(3)
    position, previous, token = 7, None, ord("{")
    drawn = 0
    for step in range(6):
        assert matcher.accept_token(token)
        rows = [
            ProposeArgs(state, token, hiddens(1, 50 + step)[0], position, 4, previous=previous),
            ProposeArgs(free, 5, hiddens(1, 60 + step)[0], 7, 2),
        ]
        result = engine.step(step_of(rows, engine.step_shape))
        assert not result.errors
        drafts = result.drafts[0, : result.counts[0]].tolist()
        masks = masks_along(matcher, drafts)
        for j, d in enumerate(drafts):
            support = result.q_probs[0, j] > 0
            assert masks[j, d] and masks[j][result.q_ids[0, j][support]].all()
            assert abs(result.q_probs[0, j].sum() - 1) < 1e-4
            assert result.q_probs[0, j][result.q_ids[0, j] == d].sum() == result.probs[0, j]
        drawn += len(drafts)
        free_count = result.counts[1]
        assert (result.q_probs[1, :free_count, 0] == 1).all()
        assert (result.q_ids[1, :free_count, 0] == result.drafts[1, :free_count]).all()
        engine.free_state(free)
        free = engine.alloc_state("")
        session = engine.begin_prefill(free, 1)
        session.append([1, 2, 3, 4, 5, 6], hiddens(6, 2))
        session.finish()
        a = rng.randint(0, len(drafts))
        for d in drafts[:a]:
            assert matcher.accept_token(d)
        ok = torch.nonzero(allowed(matcher)).flatten().tolist()
        if not ok:
            break
        token, previous, position = rng.choice(ok), Verdict(a), position + a + 1
    assert drawn > 6


def test_the_drafters_own_count_cuts_among_the_grammars_drafts(engine, own_compiler):
    """num_drafts 0: the drafter keeps some of the grammar's drafts (up to draft_cap, fewer
    the dearer a verified token); the state's rows and matcher stay in step through every
    verdict, and the masks end at the first draft not kept."""
    grammar = engine.grammars.compile(GrammarSpec("regex", REGEX))
    matcher = xgrammar.GrammarMatcher(compile_kind(own_compiler, "regex", REGEX))
    state = engine.alloc_state("", grammar=grammar)
    session = engine.begin_prefill(state, 1)
    session.append([1, 2, 3, 4, 5, 6], hiddens(6, 4))
    session.finish()
    rng = random.Random(8)
    position, previous, token, kept = 7, None, ord("a"), []
    for step in range(8):
        assert matcher.accept_token(token)
        cost = rng.choice([0.0, 0.3, 2.0])
        args = ProposeArgs(state, token, hiddens(1, 70 + step)[0], position, 0,
                           previous=previous, draft_cap=5, verify_token_cost=cost)  # fmt: skip
        result = engine.step(step_of([args], engine.step_shape))
        assert not result.errors
        drafts = result.drafts[0, : result.counts[0]].tolist()
        assert len(drafts) <= 5
        assert torch.equal(unpacked(result.grammar_masks[0]), masks_along(matcher, drafts))
        kept.append(len(drafts))
        a = rng.randint(0, len(drafts))
        for d in drafts[:a]:
            assert matcher.accept_token(d)
        ok = torch.nonzero(allowed(matcher)).flatten().tolist()
        if not ok:
            break
        token, previous, position = rng.choice(ok), Verdict(a), position + a + 1
    assert len(set(kept)) > 1  # the count followed the cost


def test_a_retried_step_commits_nothing_more_to_its_grammar(engine, ref, own_compiler):
    """A numbered step sent again while its proposal is pending is answered as it was; its
    token is not committed twice, so the grammar's next step drafts as the oracle says."""
    seq = Sequence(engine, ref, own_compiler, ("ebnf", EBNF), seed=7)
    seq.commit([ord("x")])
    hidden = hiddens(1, 31)[0]
    drafts, _ = seq.expected(ord("x"), hidden, 3, 0.0)
    first = propose(engine, ProposeArgs(seq.state, ord("x"), hidden, 7, 3, step_number=1))
    again = propose(engine, ProposeArgs(seq.state, ord("x"), hidden, 7, 3, step_number=1))
    assert first.tokens == again.tokens == drafts
    a = 0  # the next token follows "x" alone: one the grammar allows there
    seq.exp.verdict(a)
    token = seq.choose_token(random.Random(2))
    seq.commit([token])
    hidden = hiddens(1, 32)[0]
    want, _ = seq.expected(token, hidden, 3, 0.0)
    args = ProposeArgs(seq.state, token, hidden, 8 + a, 3, previous=Verdict(a), step_number=2)
    assert propose(engine, args).tokens == want
