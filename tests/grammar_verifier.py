"""A grammar state as a verifier sees it, through the engine's step: its rows (the
float64 oracle's Expected) and the grammar it gave the state, as a matcher of the tests'
own moved on only by committed tokens."""

from __future__ import annotations

import torch
import xgrammar
from drafting import Expected, hiddens
from grammars import compile_kind, masks_along, oracle_drafts
from proposing import ProposeArgs, step_of

from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.engine.types import Verdict


def make_engine(head, checkpoint, **config) -> DraftEngine:
    defaults = {"kv_blocks": 256, "block_size": 4, "max_drafts": 8, "model": str(checkpoint)}
    return DraftEngine(head, ServeConfig(**{**defaults, **config}))


class Verifier:
    """One state as a verifier sees it: its rows (the oracle's Expected), the grammar it
    says the state has, as a matcher of the tests' own moved on only by committed tokens
    (None: no grammar), and the verdict it owes."""

    def __init__(self, engine, ref, own_compiler, prompt: int = 6, seed: int = 0) -> None:
        self.engine, self.own_compiler = engine, own_compiler
        self.state = engine.alloc_state("")
        toks = torch.randint(0, 128, (prompt,), generator=torch.Generator().manual_seed(seed))
        hid = hiddens(prompt, seed)
        session = engine.begin_prefill(self.state, 1)
        session.append(toks.tolist(), hid)
        session.finish()
        self.exp = Expected(ref)
        self.exp.add(toks.tolist(), hid)
        self.matcher: xgrammar.GrammarMatcher | None = None
        self.previous: Verdict | None = None

    def restart(self, grammar: tuple[str, str] | None) -> None:
        """The grammar the verifier gives the state from its next token on."""
        self.matcher = None
        if grammar is not None:
            self.matcher = xgrammar.GrammarMatcher(compile_kind(self.own_compiler, *grammar))

    def args(self, token: int, k: int, seed: int, **extra) -> ProposeArgs:
        hidden = hiddens(1, seed)[0]
        return ProposeArgs(
            self.state, token, hidden, self.exp.next_position, k, previous=self.previous, **extra
        )

    def expect(self, args: ProposeArgs) -> tuple[list[int], torch.Tensor | None]:
        """The oracle's drafts for `args` (its token committed) and the grammar's masks
        along them (None: no grammar)."""
        self.exp.add([args.token], args.hidden)
        if self.matcher is None:
            drafts, _, outs = self.exp.ref.propose(
                self.exp.tokens, self.exp.hiddens, args.num_drafts
            )
            self.exp.last = (drafts, outs)
            return drafts, None
        assert self.matcher.accept_token(args.token)
        drafts, _, outs = oracle_drafts(
            self.exp.ref, self.exp.tokens, self.exp.hiddens, args.num_drafts, self.matcher
        )
        self.exp.last = (drafts, outs)
        return drafts, masks_along(self.matcher, drafts)

    def judge(self, drafts: list[int], accepted: int) -> None:
        """The verdict on the last proposal, owed with the next Propose."""
        self.exp.verdict(accepted)
        if self.matcher is not None:
            for d in drafts[:accepted]:
                assert self.matcher.accept_token(d)
        self.previous = Verdict(accepted)


def run(engine, args: list[ProposeArgs]):
    return engine.step(step_of(args, engine.step_shape))
