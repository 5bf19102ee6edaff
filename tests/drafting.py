"""A verifier's view of one state for the tests: what rows the server must hold.

`Expected` mirrors a state's rows (token, hidden) as DESIGN.md ("The contract") defines them and
asks the float64 oracle what the next proposal must be, so a test can pin every
AfterVerify case by the drafts that follow it. `prompts` and `all_drafts` feed the
oracles' own tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from mtp_reference import Reference

H = 64  # hidden size of the test checkpoints
V = 200  # their vocabulary


def hiddens(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prompts(n: int = 4, length: int = 6, hidden: int = 64) -> list[tuple[list[int], torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randint(0, 256, (length,), generator=g).tolist(),
            torch.randn(length, hidden, generator=g, dtype=torch.float64),
        )
        for _ in range(n)
    ]


def all_drafts(ref, k: int = 3) -> list[list[int]]:
    """An oracle's drafts for the same prompts: its own tests compare them across
    checkpoint spellings, shardings and dtypes."""
    return [ref.propose(t, h, k)[0] for t, h in prompts()]


@dataclass
class Expected:
    ref: Reference
    tokens: list[int] = field(default_factory=list)
    hiddens: torch.Tensor = field(default_factory=lambda: torch.empty(0, H, dtype=torch.float64))
    last: tuple | None = None  # the pending proposal: (drafts, chain hiddens m0..)

    @property
    def next_position(self) -> int:
        return len(self.tokens) + 1

    def add(self, toks: list[int], hid: torch.Tensor) -> None:
        self.tokens += list(toks)
        self.hiddens = torch.cat([self.hiddens, hid.double().reshape(-1, H)])

    def propose(self, token: int, hidden: torch.Tensor, k: int, allowed=None):
        """The oracle's drafts for Propose(token, hidden) on these rows; records R0."""
        self.add([token], hidden)
        drafts, probs, outs = self.ref.propose(self.tokens, self.hiddens, k, allowed)
        self.last = (drafts, outs)
        return drafts, probs

    def verdict(self, accepted: int, refeed: torch.Tensor | None = None) -> None:
        drafts, outs = self.last
        self.last = None
        for i in range(accepted):
            hid = refeed[i] if refeed is not None else outs[i]
            self.add([drafts[i]], hid)
