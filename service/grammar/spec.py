"""What a request says a state's output must obey: a grammar's kind and its source text;
the grammar compiled; a propose row's change of grammar; and a state's grammar as it
travels with its KV."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar

    from ..engine.errors import DrafterError

# The kinds a grammar may be given in, as GetInfo names them: a JSON schema, EBNF
# (xgrammar's GBNF dialect), a regular expression, or a structural tag (JSON, xgrammar's
# format: free text with tagged parts that each obey their own grammar).
KINDS = ("json_schema", "ebnf", "regex", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar as a request gives it; equal specs compile to one grammar."""

    kind: str  # one of KINDS
    source: str


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A grammar compiled for the checkpoint's tokenizer, with the spec it was compiled
    from (what a state's KV carries to another server, which compiles it again)."""

    spec: GrammarSpec
    compiled: xgrammar.CompiledGrammar


@dataclass
class GrammarChange:
    """A propose row's grammar from its step on: `spec`, or none (None). The serving loop
    compiles it before the engine's thread sees it (`grammar`), or keeps why it could not
    (`error`): the row is refused with that error and its state keeps its grammar."""

    spec: GrammarSpec | None
    grammar: CompiledGrammar | None = None
    error: DrafterError | None = None

    @property
    def resolved(self) -> bool:
        """Whether nothing is left to compile (none asked, compiled, or refused)."""
        return self.spec is None or self.grammar is not None or self.error is not None


@dataclass
class HeldGrammar:
    """A state's grammar as it leaves with the state's KV (TakeKV, ExportKV): the grammar
    and the tokens its matcher consumed, committed since the grammar began, so that the
    state that takes the KV has its matcher where the first one stood. `grammar` is None
    where the spec is yet to be compiled (an import's, from another server)."""

    spec: GrammarSpec
    tokens: list[int]
    grammar: CompiledGrammar | None = None
