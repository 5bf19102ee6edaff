"""The grammars of the states that have one: a matcher per state's slot, at the tokens the
verifier committed.

A state's matcher moves forward only by committed tokens: the drafts a verdict accepts and
the token each Propose brings (the target's own, after them). Drafting moves it on by
each draft to find the next draft's mask and moves it back after the chain (`advance`,
`rollback`), so that between steps it stands where the verifier's sequence does.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..engine.errors import FailedPrecondition, InvalidArgument
from . import xgrammar_installed
from .spec import KINDS, GrammarSpec
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

    def compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        """The compiled grammar (compiler.GrammarCompiler.compile); FAILED_PRECONDITION
        (GRAMMARS_UNAVAILABLE) where this server serves none. Safe on any thread: the
        serving loop compiles off the engine's thread."""
        if self.unavailable:
            raise FailedPrecondition(
                f"grammar: this server serves no grammars: {self.unavailable}",
                reason="GRAMMARS_UNAVAILABLE",
            )
        return self.compiler.compile(spec)

    # ---- a state's matcher ---------------------------------------------------

    def attach(self, slot: int, grammar: xgrammar.CompiledGrammar) -> None:
        import xgrammar

        self.matchers[slot] = xgrammar.GrammarMatcher(grammar)

    def detach(self, slot: int) -> None:
        self.matchers.pop(slot, None)

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
