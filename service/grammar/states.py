"""The grammars of the states that have one: a matcher per state's slot, at the tokens the
verifier committed.

A state's matcher moves forward only by committed tokens: the drafts a verdict accepts and
the token each Propose brings (the target's own, after them). Drafting moves it on by
each draft to find the next draft's mask and moves it back after the chain (`advance`,
`rollback`), so that between steps it stands where the verifier's sequence does.

The committed tokens each matcher consumed are kept beside it: a state's grammar leaves
with its KV as its spec and those tokens (`take`, HeldGrammar), and the state that takes
the KV, here or on another server, replays them into a matcher of its own (`restore`).
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..engine.errors import DrafterError, FailedPrecondition, InvalidArgument
from . import xgrammar_installed
from .spec import KINDS, CompiledGrammar, GrammarChange, GrammarSpec, HeldGrammar
from .tokenizer import stop_token_ids, tokenizer_file, tokenizer_info

if TYPE_CHECKING:
    import xgrammar

    from .compiler import GrammarCompiler


class StateGrammars:
    """Grammars for the states of one engine, whose model has `vocab_size` tokens.

    `tokenizer` is the tokenizer.json (or its folder) that says which bytes each token id
    stands for: the checkpoint folder's unless given. Grammars are served only where
    xgrammar is installed and that file exists; xgrammar is imported at the first grammar
    (its import takes seconds), not when the server starts.
    """

    def __init__(
        self,
        checkpoint: str | Path,
        vocab_size: int,
        *,
        tokenizer: str | Path | None = None,
        compile_timeout: float = 10.0,
        cache_size: int = 256,
    ) -> None:
        self.checkpoint = Path(checkpoint)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.file = tokenizer_file(tokenizer if tokenizer is not None else checkpoint)
        self.compile_timeout = compile_timeout
        self.cache_size = cache_size
        self.unavailable = (
            "xgrammar is not installed (pip install 'mtpdraft[grammar]')"
            if not xgrammar_installed()
            else None
            if self.file is not None
            else f"no tokenizer.json in {tokenizer if tokenizer is not None else checkpoint}"
        )
        self._compiler: GrammarCompiler | None = None
        self._batch: xgrammar.BatchGrammarMatcher | None = None
        self._loading = threading.Lock()
        self.matchers: dict[int, xgrammar.GrammarMatcher] = {}  # by slot
        self.grammars: dict[int, CompiledGrammar] = {}  # by slot: each matcher's grammar
        # by slot: the committed tokens each matcher consumed, since its grammar began
        self.committed: dict[int, array] = {}

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds of grammar served (none when unavailable)."""
        return () if self.unavailable else KINDS

    @property
    def compiler(self) -> GrammarCompiler:
        """The compiler, made (xgrammar imported, the tokenizer read) at the first use."""
        with self._loading:
            if self._compiler is None:
                import xgrammar

                from .compiler import GrammarCompiler

                info = tokenizer_info(self.file, self.vocab_size, stop_token_ids(self.checkpoint))
                self._batch = xgrammar.BatchGrammarMatcher()
                self._compiler = GrammarCompiler(
                    info, timeout=self.compile_timeout, capacity=self.cache_size
                )
            return self._compiler

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar (compiler.GrammarCompiler.compile); FAILED_PRECONDITION
        (GRAMMARS_UNAVAILABLE) where this server serves none. Safe on any thread: the
        serving loop compiles off the engine's thread."""
        if self.unavailable:
            raise FailedPrecondition(
                f"grammar: this server serves no grammars: {self.unavailable}",
                reason="GRAMMARS_UNAVAILABLE",
            )
        return self.compiler.compile(spec)

    def compile_changes(self, changes: Iterable[GrammarChange | None]) -> None:
        """Compiles the grammars a step's rows give (its grammars column), each change
        keeping its grammar or why it has none (the row is refused with that error)."""
        for change in changes:
            if change is not None and not change.resolved:
                try:
                    change.grammar = self.compile(change.spec)
                except DrafterError as err:
                    change.error = err

    # ---- a state's matcher ---------------------------------------------------

    def attach(self, slot: int, grammar: CompiledGrammar) -> None:
        """The state's grammar from its next token on (a new state's, or a Propose's)."""
        import xgrammar

        self._hold(slot, grammar, xgrammar.GrammarMatcher(grammar.compiled), array("i"))

    def _hold(self, slot: int, grammar: CompiledGrammar, matcher, committed: array) -> None:
        self.matchers[slot], self.grammars[slot] = matcher, grammar
        self.committed[slot] = committed

    def detach(self, slot: int) -> None:
        self.matchers.pop(slot, None)
        self.grammars.pop(slot, None)
        self.committed.pop(slot, None)

    def switch(self, slot: int, grammar: CompiledGrammar | None, token: int, field: str) -> None:
        """The state's grammar from `token` on is `grammar` (None: none): its matcher starts
        anew and consumes `token` first. A token the new grammar refuses is INVALID_ARGUMENT
        (TOKEN_REJECTED_BY_GRAMMAR) and leaves the state's grammar as it was."""
        if grammar is None:
            self.detach(slot)
            return
        import xgrammar

        matcher = xgrammar.GrammarMatcher(grammar.compiled)
        if not matcher.accept_token(int(token)):
            raise InvalidArgument(
                f"{field}: token {token} does not begin the text of the grammar given with it",
                reason="TOKEN_REJECTED_BY_GRAMMAR",
                field=field,
            )
        self._hold(slot, grammar, matcher, array("i", [int(token)]))

    def take(self, slot: int) -> HeldGrammar | None:
        """The state's grammar and committed tokens, which it holds no more (TakeKV)."""
        grammar = self.grammars.get(slot)
        if grammar is None:
            return None
        held = HeldGrammar(grammar.spec, self.committed[slot].tolist(), grammar)
        self.detach(slot)
        return held

    def restore(self, slot: int, held: HeldGrammar, matcher=None) -> None:
        """The state's grammar is `held`'s (compiled), its matcher where `held`'s stood
        (`matcher`, replayed(held)'s, where the caller has it already)."""
        matcher = self.replayed(held) if matcher is None else matcher
        self._hold(slot, held.grammar, matcher, array("i", held.tokens))

    def compile_held(self, held: HeldGrammar) -> None:
        """Compiles the grammar of KV from another server (its header's), the refusal
        naming the field header.grammar: GRAMMARS_UNAVAILABLE where this server serves
        none, so KV whose state has a grammar is refused rather than taken without it."""
        if held.grammar is not None:
            return
        try:
            held.grammar = self.compile(held.spec)
        except DrafterError as err:
            raise type(err)(
                f"the KV's state has a grammar, which is refused here: {err.message}",
                reason=err.reason,
                field="header.grammar",
            ) from None

    def replayed(self, held: HeldGrammar) -> xgrammar.GrammarMatcher:
        """A matcher of `held`'s grammar (compiled) that consumed its tokens.
        FAILED_PRECONDITION (KV_GRAMMAR_MISMATCH) where the grammar refuses one: the KV
        was exported by a server whose tokenizer reads the token ids otherwise."""
        import xgrammar

        matcher = xgrammar.GrammarMatcher(held.grammar.compiled)
        for n, token in enumerate(held.tokens):
            if matcher.is_terminated() or not matcher.accept_token(int(token)):
                raise FailedPrecondition(
                    f"the KV's grammar refuses its committed token {n} ({token}) here: the "
                    "exporting server's tokenizer is not this one's",
                    reason="KV_GRAMMAR_MISMATCH",
                    field="header.grammar_tokens",
                )
        return matcher

    def which(self, slots: np.ndarray) -> np.ndarray:
        """Per slot: whether its state has a grammar."""
        if not self.matchers:
            return np.zeros(len(slots), bool)
        return np.fromiter((s in self.matchers for s in slots.tolist()), bool, len(slots))

    def commit(self, slot: int, tokens: list[int], field: str) -> None:
        """Moves the state's matcher on by committed tokens, all or none: a token the
        grammar does not allow there is INVALID_ARGUMENT (TOKEN_REJECTED_BY_GRAMMAR) and
        leaves the matcher where it was."""
        matcher = self.matchers[slot]
        for n, token in enumerate(tokens):
            if matcher.is_terminated() or not matcher.accept_token(int(token)):
                why = "has ended" if matcher.is_terminated() else "does not allow it there"
                if n:
                    matcher.rollback(n)
                raise InvalidArgument(
                    f"{field}: token {token} does not continue the state's grammar, which {why}",
                    reason="TOKEN_REJECTED_BY_GRAMMAR",
                    field=field,
                )
        self.committed[slot].extend(int(t) for t in tokens)

    # ---- drafting: masks, and a speculative walk undone after the chain --------

    def masks(self, slots: list[int]) -> torch.Tensor:
        """[len(slots), W] int32 on the host: each state's allowed next tokens (all zero
        where its grammar has ended), filled on xgrammar's threads in parallel."""
        out = torch.zeros(len(slots), self.words, dtype=torch.int32)
        if not slots:
            return out
        live = [i for i, s in enumerate(slots) if not self.matchers[s].is_terminated()]
        if live:
            matchers = [self.matchers[slots[i]] for i in live]
            self._batch.batch_fill_next_token_bitmask(matchers, out, live)
        return out

    def advance(self, slots: list[int], tokens: list[int]) -> np.ndarray:
        """Moves each state's matcher on by a draft (drafted under its mask, so allowed);
        whether each matcher has ended after it."""
        ended = np.zeros(len(slots), bool)
        for i, (slot, token) in enumerate(zip(slots, tokens, strict=True)):
            matcher = self.matchers[slot]
            if not matcher.accept_token(int(token)):
                raise RuntimeError(f"a draft ({token}) its grammar's mask allowed was refused")
            ended[i] = matcher.is_terminated()
        return ended

    def rollback(self, slots: list[int], counts: list[int]) -> None:
        """Undoes each state's last `counts[i]` advances."""
        for slot, n in zip(slots, counts, strict=True):
            if n:
                self.matchers[slot].rollback(n)
