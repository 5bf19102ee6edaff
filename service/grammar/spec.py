"""What a request says a state's output must obey: a grammar's kind and its source text."""

from __future__ import annotations

from dataclasses import dataclass

# The kinds a grammar may be given in, as GetInfo names them: a JSON schema, EBNF
# (xgrammar's GBNF dialect), a regular expression, or a structural tag (JSON, xgrammar's
# format: free text with tagged parts that each obey their own grammar).
KINDS = ("json_schema", "ebnf", "regex", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar as a request gives it; equal specs compile to one grammar."""

    kind: str  # one of KINDS
    source: str
