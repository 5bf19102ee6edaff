"""A scripted verifier for the replica tests: one affinity key, a few sequences stepped
together (one ProposeBatch a step), every verdict refeeding the target's hiddens.

Everything a verifier would know comes from its seed: each position's target hidden,
the bonus tokens, how many drafts the target accepts. The tokens after a step are the
accepted drafts, so two runs that draft alike are alike. With refeed every row a state
holds is committed, (x[j], h[j-1]) for j = 1 .. position - 1, so a lost state is rebuilt
exactly by prefilling those rows (`reprefill`), and the drafts that follow are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mtpdraft.client import (
    DrafterClient,
    DrafterError,
    ProposeArgs,
    Replicas,
    StateLost,
    Verdict,
    recover_state,
    reprefill,
)

H, V = 64, 200  # the test checkpoint's hidden size and vocabulary
K = 3
PROMPT = 9  # tokens x0 .. x8: rows 1 .. 7 prefilled, x8 proposed first


def _random(seed: int, *where: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash((seed, *where)) % 2**62)


@dataclass
class Sequence:
    """One sequence as its verifier keeps it: tokens x0 .. x[position], the last one to
    propose next, and the verdict on the pending proposal."""

    seed: int
    tokens: list[int] = field(default_factory=list)
    state: int = 0
    verdict: Verdict | None = None

    def __post_init__(self) -> None:
        g = _random(self.seed, -1)
        self.tokens = torch.randint(0, V, (PROMPT,), generator=g).tolist()

    @property
    def position(self) -> int:
        return len(self.tokens) - 1

    def hidden(self, position: int) -> torch.Tensor:
        """The target's hidden at `position`."""
        return torch.randn(H, generator=_random(self.seed, 0, position))

    def hiddens(self, first: int, count: int) -> torch.Tensor:
        return torch.stack([self.hidden(first + i) for i in range(count)]).reshape(count, H)

    def committed_rows(self) -> tuple[list[int], torch.Tensor]:
        """The rows its state holds once the pending verdict is applied: (x[j], h[j-1])."""
        p = self.position
        return self.tokens[1:p], self.hiddens(0, p - 1)

    def request(self) -> ProposeArgs:
        p = self.position
        return ProposeArgs(
            self.state, self.tokens[p], self.hidden(p - 1), p, K, previous=self.verdict
        )

    def accept(self, step: int, drafts: list[int]) -> None:
        """The target accepts some drafts, then a bonus token; the next verdict refeeds."""
        g = _random(self.seed, 1, step)
        a = min(int(torch.randint(0, K + 1, (1,), generator=g)), len(drafts))
        p = self.position
        bonus = int(torch.randint(0, V, (1,), generator=g))
        self.tokens += [*drafts[:a], bonus]
        self.verdict = Verdict(a, self.hiddens(p, a) if a else None)


@dataclass
class Verifier:
    """Sequences of one key, stepped together; `drafts` holds every step's drafts."""

    seed: int
    key: str
    sequences: int = 2
    columns: bool = False  # the batch's columns built here, else by the client (propose_many)
    seqs: list[Sequence] = field(default_factory=list)
    drafts: list[list[list[int]]] = field(default_factory=list)
    probs: list[list[list[float]]] = field(default_factory=list)
    recoveries: int = 0
    moves: int = 0  # states recovered by moving them from the replica that held them
    retries: int = 0
    # The replicas' own addresses: a lost state still held by one is moved, not rebuilt
    # (None: every lost state is re-prefilled, its old copy freed through the proxy).
    replicas: Replicas | None = None
    epochs: set[int] = field(default_factory=set)  # the server instances that held its states

    def __post_init__(self) -> None:
        self.seqs = [Sequence(self.seed * 100 + i) for i in range(self.sequences)]

    def start(self, client: DrafterClient) -> None:
        for s in self.seqs:
            s.state = reprefill(client, *s.committed_rows())
            self.epochs.add(s.state >> 43)

    def step(self, client: DrafterClient) -> None:
        """One verify step for every sequence: drafts, then the target's verdict."""
        requests = [s.request() for s in self.seqs]
        if self.columns:
            verdicts = [r.previous for r in requests]
            refeeds = [v.refeed_hiddens for v in verdicts if v and v.refeed_hiddens is not None]
            answer = client.propose_batch(
                [r.state for r in requests],
                [r.token for r in requests],
                [r.position for r in requests],
                torch.stack([r.hidden for r in requests]),
                K,
                num_accepted=[v.num_accepted if v else -1 for v in verdicts],
                refeed_rows=[v.num_accepted if v and v.num_accepted else 0 for v in verdicts],
                refeed_hiddens=torch.cat(refeeds) if refeeds else None,
            )
        else:
            answer = client.propose_many(requests)
        got = [(p.tokens, p.probs) for p in answer.proposals()]  # a failed row's error raised
        step = len(self.drafts)
        self.drafts.append([d for d, _ in got])
        self.probs.append([p for _, p in got])
        for s, (d, _) in zip(self.seqs, got, strict=True):
            s.accept(step, d)

    def run(
        self,
        client: DrafterClient,
        steps: int,
        *,
        between: Callable[[int], None] = lambda step: None,
        retry: Callable[[DrafterError], bool] = lambda err: False,
    ) -> None:
        """`steps` steps (`between(step)` before each). A lost state is rebuilt from the
        sequence's committed rows and the step asked again; an error `retry` accepts
        (a call cut off with its replica) is asked again as it was."""
        self.start(client)
        self.run_more(client, steps, between=between, retry=retry)

    def run_more(
        self,
        client: DrafterClient,
        steps: int,
        *,
        between: Callable[[int], None] = lambda step: None,
        retry: Callable[[DrafterError], bool] = lambda err: False,
    ) -> None:
        """`steps` more steps of a started verifier (see `run`)."""
        for step in range(len(self.drafts), len(self.drafts) + steps):
            between(step)
            while True:
                try:
                    self.step(client)
                    break
                except StateLost:
                    self.recover(client)
                except DrafterError as err:
                    if not retry(err):
                        raise
                    self.retries += 1

    def recover(self, client: DrafterClient) -> None:
        """Every sequence again, on the replica the key reaches now: moved there from the
        replica that holds it (`replicas`), else its committed rows prefilled into a new
        state; the next Propose carries no verdict (it is in the rows)."""
        self.recoveries += 1
        for s in self.seqs:
            if self.replicas is None:
                client.free_state(s.state)  # where the key now goes: usually unknown, harmless
                s.state = reprefill(client, *s.committed_rows())
            else:
                got = recover_state(
                    client, s.state, *s.committed_rows(), replicas=self.replicas, verdict=s.verdict
                )
                s.state, self.moves = got.state, self.moves + got.moved
            s.verdict = None
            self.epochs.add(s.state >> 43)

    def settle(self, client: DrafterClient) -> None:
        """Applies each pending verdict now (AfterVerify): no proposal pending, as TakeKV
        needs; the next Propose carries no verdict."""
        for s in self.seqs:
            if s.verdict is not None:
                client.after_verify(
                    s.state, s.verdict.num_accepted, refeed_hiddens=s.verdict.refeed_hiddens
                )
                s.verdict = None

    def finish(self, client: DrafterClient) -> None:
        for s in self.seqs:
            client.free_state(s.state)
