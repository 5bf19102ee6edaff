"""A step whose outcome the verifier never learned, on a served replica.

The replica is stopped (SIGSTOP) while it computes one verifier's step and holds another's
in its queue; both callers' deadlines pass, then it goes on (SIGCONT). The step it was
computing is applied all the same (its forward had begun); the queued one is dropped
unchanged (its deadline passed while it waited). Sent again as they were (numbered,
`retry_step`), both are answered as a replica that never stopped answers them, and the
verifiers go on: nothing wedges. Without step numbers the same resend of the applied step
is refused POSITION_MISMATCH, every time.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
from reliability_support import ManagedServer, server_args, wait_clean
from servers import PATIENCE

from mtpdraft.client import (
    BatchResult,
    DeadlineExceeded,
    DrafterClient,
    DrafterError,
    is_ambiguous,
    reprefill,
    retry_step,
)

H, V, K = 64, 200, 8  # the test checkpoint's hidden size and vocabulary; drafts a step
PROMPT = 40


def _rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng([abs(s) for s in seed])


@dataclass
class Sequence:
    """One sequence as its verifier knows it: tokens x0 .. x[position], the hiddens (drawn
    from its seed), the verdict on its pending proposal (accepted count, refeed rows)."""

    seed: int
    tokens: list[int] = field(default_factory=list)
    verdict: tuple[int, np.ndarray | None] | None = None

    def __post_init__(self) -> None:
        self.tokens = _rng(self.seed).integers(0, V, PROMPT).tolist()

    @property
    def position(self) -> int:
        return len(self.tokens) - 1

    def hiddens(self, first: int, count: int) -> np.ndarray:
        return np.stack([_rng(self.seed, 1, first + i).standard_normal(H) for i in range(count)])

    def accept(self, step: int, drafts: list[int]) -> None:
        g = _rng(self.seed, 2, step)
        a = min(int(g.integers(0, K + 1)), len(drafts))
        p = self.position
        self.tokens += [*drafts[:a], int(g.integers(0, V))]
        self.verdict = (a, self.hiddens(p, a).astype(np.float32) if a else None)


@dataclass
class Lane:
    """A verifier's sequences on their states, stepped together as one ProposeBatch."""

    seeds: list[int]
    states: list[int] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)
    drafts: list[list[list[int]]] = field(default_factory=list)

    def start(self, client: DrafterClient) -> None:
        self.seqs = [Sequence(s) for s in self.seeds]
        for s in self.seqs:
            p = s.position
            hiddens = s.hiddens(0, p - 1).astype(np.float32)
            self.states.append(reprefill(client, s.tokens[1:p], hiddens))

    def send(
        self,
        client: DrafterClient,
        number: int,
        *,
        shift: int = 0,
        timeout: float | None = None,
    ) -> BatchResult:
        """This step of every sequence (numbered `number`, 0: unnumbered); `shift` moves
        every position (a probe that no state accepts)."""
        verdicts = [s.verdict for s in self.seqs]
        refeeds = [v[1] for v in verdicts if v and v[1] is not None]
        return client.propose_batch(
            self.states,
            [s.tokens[s.position] for s in self.seqs],
            [s.position + shift for s in self.seqs],
            np.concatenate([s.hiddens(s.position - 1, 1) for s in self.seqs]).astype(np.float32),
            K,
            num_accepted=[v[0] if v else -1 for v in verdicts],
            refeed_rows=[v[0] if v else 0 for v in verdicts],
            refeed_hiddens=np.concatenate(refeeds) if refeeds else None,
            step_numbers=number,
            timeout=PATIENCE if timeout is None else timeout,
        )

    def take(self, answer: BatchResult) -> None:
        """The verdicts on an answered step (a failed row raises its error)."""
        got = [p.tokens for p in answer.proposals()]
        step = len(self.drafts)
        self.drafts.append(got)
        for s, drafts in zip(self.seqs, got, strict=True):
            s.accept(step, drafts)

    def finish(self, client: DrafterClient) -> None:
        for state in self.states:
            client.free_state(state)


def reasons(answer: BatchResult) -> set[str]:
    return {err.reason for err in answer.errors.values()} if len(answer.errors) else {"none"}


def applied(lane: Lane, client: DrafterClient, number: int) -> bool:
    """Whether the lane's step `number`, whose answer never came, was applied: the step
    sent again at positions no state accepts is refused either way, and changes nothing:
    STALE_STEP once it was applied (its number is the states' last), POSITION_MISMATCH
    while it was not."""
    probe = lane.send(client, number, shift=1)
    assert len(probe.errors) == len(lane.states), probe.errors
    (reason,) = reasons(probe)
    assert reason in {"STALE_STEP", "POSITION_MISMATCH"}
    return reason == "STALE_STEP"


def stopped_during(
    replica: ManagedServer, client: DrafterClient, number: int, forward: float, **lanes: Lane
) -> dict[str, BatchResult | DrafterError]:
    """Each lane's step `number` sent from a thread of its own, the first while the one
    before it computes (`forward`: how long a step of the first takes), then the replica
    stopped until every caller's deadline has passed: what each caller got."""
    outcome: dict[str, BatchResult | DrafterError] = {}

    def call(name: str, lane: Lane) -> None:
        try:
            outcome[name] = lane.send(client, number, timeout=forward + 0.5)
        except DrafterError as err:
            outcome[name] = err

    threads = [threading.Thread(target=call, args=item) for item in lanes.items()]
    threads[0].start()
    time.sleep(forward / 3)  # the first lane's forward is under way
    for t in threads[1:]:
        t.start()
    time.sleep(min(forward / 6, 0.05))  # the other lanes' calls are read, and queued
    os.kill(replica.pid, signal.SIGSTOP)
    try:
        for t in threads:
            t.join(PATIENCE)
    finally:
        os.kill(replica.pid, signal.SIGCONT)
    return outcome


@pytest.fixture
def replica(mimo_checkpoint):
    server = ManagedServer(
        mimo_checkpoint,
        *server_args(600, max_batch=64, max_states=128, kv_blocks=8192, block_size=16),
    )
    yield server
    server.stop()


def test_a_step_cut_off_by_a_stopped_replica_is_retried_and_nothing_wedges(replica) -> None:
    busy, queued = Lane(list(range(100, 148))), Lane([200])  # 48 states: a long forward
    twins = Lane(busy.seeds), Lane(queued.seeds)  # the same steps where nothing stops
    with DrafterClient(replica.address, timeout=PATIENCE) as client:
        for lane in (busy, queued, *twins):
            lane.start(client)
        started = time.monotonic()
        busy.take(busy.send(client, 1))
        forward = time.monotonic() - started
        queued.take(queued.send(client, 1))
        for twin in twins:
            twin.take(twin.send(client, 1))

        cut = {}
        for number in range(2, 6):  # until a stop lands on the busy lane's forward
            outcome = stopped_during(replica, client, number, forward, busy=busy, queued=queued)
            late = {name: isinstance(got, DeadlineExceeded) for name, got in outcome.items()}
            for got in outcome.values():
                assert isinstance(got, BatchResult) or is_ambiguous(got), got
            if late["busy"]:
                cut = {"busy": applied(busy, client, number)}
                if late["queued"]:
                    cut["queued"] = applied(queued, client, number)
            if cut.get("busy"):
                # Without its number, the applied step sent again fits no state any more:
                # the loop that wedged verifiers (and a refused call changes nothing).
                assert reasons(busy.send(client, 0)) == {"POSITION_MISMATCH"}
            for name, lane in (("busy", busy), ("queued", queued)):
                got = outcome[name]
                if isinstance(got, DrafterError):
                    got = retry_step(lambda lane=lane, n=number: lane.send(client, n))
                lane.take(got)
            for twin in twins:
                twin.take(twin.send(client, number))
            if cut.get("busy"):
                print(f"forward {forward:.3f} s; the stop of step {number} landed on it")
                break
        assert cut.get("busy"), "no stop landed on the busy lane's forward in four tries"
        assert cut.get("queued") is False, "the queued call ran after its deadline"

        for later in range(number + 1, number + 3):  # and the verifiers go on
            for lane in (busy, queued, *twins):
                lane.take(lane.send(client, later))
        for lane, twin in zip((busy, queued), twins, strict=True):
            assert lane.drafts == twin.drafts
        for lane in (busy, queued, *twins):
            lane.finish(client)
    wait_clean(replica, timeout=PATIENCE)
    replica.assert_no_traceback()
