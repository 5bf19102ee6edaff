"""The engine in-process: KV rows, block accounting, leases and draining."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from drafting import Expected, V
from mtp_reference import Reference
from proposing import ProposeArgs, propose, propose_batch, step_of
from torch.overrides import TorchFunctionMode

from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine import admission
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.engine.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from mtpdraft.service.engine.sampling import Sampling
from mtpdraft.service.engine.step import Step, StepResult
from mtpdraft.service.engine.types import Proposal, Verdict
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.mtp_head import MTPHead
from mtpdraft.service.model.synthetic import write_random_checkpoint


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), "mimo", seed=3)


@pytest.fixture(scope="module")
def head(checkpoint: Path) -> MTPHead:
    return MTPHead(load_mtp_weights(checkpoint), torch.device("cpu"))


@pytest.fixture(scope="module")
def ref(checkpoint: Path) -> Reference:
    return Reference(checkpoint)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def engine(head: MTPHead, clock: Clock) -> DraftEngine:
    config = ServeConfig(kv_blocks=64, block_size=4, max_drafts=8, state_ttl=10)
    return DraftEngine(head, config, clock=clock)


# KV rows computed in batches of other sizes: the CPU's GEMM kernels block the sum by the
# batch's rows, differently on each instruction set, so fp32 values near 3 differ by a
# few ulps (1.2e-6 on one AVX-512 Xeon). A wrong row or position differs by far more.
KV_CLOSE = {"atol": 1e-5, "rtol": 1e-5}


def h(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 64, generator=torch.Generator().manual_seed(seed))


def prefill(engine: DraftEngine, tokens: list[int], hiddens: torch.Tensor) -> int:
    state = engine.alloc_state()
    session = engine.begin_prefill(state, 1)
    session.append(tokens, hiddens)
    session.finish()
    return state


def kv_rows(engine: DraftEngine, state_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    state = engine.states[state_id]
    blocks = torch.tensor(state.blocks)
    k = engine.kv.k[blocks].reshape(-1, *engine.kv.k.shape[2:])[: state.num_rows]
    v = engine.kv.v[blocks].reshape(-1, *engine.kv.v.shape[2:])[: state.num_rows]
    return k, v


def assert_accounted(engine: DraftEngine) -> None:
    held = sum(len(s.blocks) for s in engine.states.values())
    held += sum(len(hd.blocks) for hd in engine.handles.values())
    assert held + engine.pool.num_free == engine.pool.num_total
    for s in engine.states.values():
        assert len(s.blocks) == -(-s.num_rows // engine.config.block_size)


@pytest.mark.parametrize("accepted", [0, 2, 4])
def test_refeed_leaves_the_rows_a_fresh_prefill_would(engine: DraftEngine, accepted: int) -> None:
    prompt, hp = [5, 6, 7], h(3, 0)
    state = prefill(engine, prompt, hp)
    proposal = propose(engine, ProposeArgs(state, 8, h(1, 1), 4, 4))
    assert_accounted(engine)
    refeed = h(accepted, 2)
    engine.after_verify(state, Verdict(accepted, refeed))
    assert_accounted(engine)
    rows = [*prompt, 8, *proposal.tokens[:accepted]]
    fresh = prefill(engine, rows, torch.cat([hp, h(1, 1), refeed]))
    assert engine.states[state].num_rows == len(rows)
    for got, want in zip(kv_rows(engine, state), kv_rows(engine, fresh), strict=True):
        torch.testing.assert_close(got, want, **KV_CLOSE)


def test_row_counts_through_every_verdict(engine: DraftEngine) -> None:
    state = prefill(engine, [1, 2, 3, 4, 5], h(5, 3))
    position = 6
    for step, (k, accepted, refeed) in enumerate([(3, 0, False), (3, 3, False), (5, 2, True)]):
        p = propose(engine, ProposeArgs(state, 9, h(1, 10 + step), position, k))
        assert engine.states[state].num_rows == position - 1 + k  # R0 .. R(k-1)
        assert_accounted(engine)
        refeed_hiddens = h(accepted, 20 + step) if refeed else None
        rows = engine.after_verify(state, Verdict(accepted, refeed_hiddens))
        position += accepted + 1
        assert (rows.num_rows, rows.next_position) == (position - 1, position)
        assert p.first_position == position - accepted
        assert_accounted(engine)
    engine.free_state(state)
    assert engine.pool.num_free == engine.pool.num_total


def _threshold_that_cuts(ref: Reference) -> tuple[list[int], list[float], int, float]:
    """The oracle's 8 drafts (and probabilities) for prompt 1..5 (hiddens h(5, 5)) then
    token 2 (hidden h(1, 31)), and a threshold halfway across the largest drop of their
    running minimum after the first draft: the chain keeps `cut` drafts, then stops."""
    drafts, probs, _ = ref.propose([1, 2, 3, 4, 5, 2], torch.cat([h(5, 5), h(1, 31)]), 8)
    running = [min(probs[: i + 1]) for i in range(8)]
    cut = max(range(1, 8), key=lambda i: running[i - 1] - running[i])
    assert running[cut - 1] - running[cut] > 0.01, running  # a drop far beyond fp32's error
    assert 0 < cut < 8 and running[-1] < (running[cut - 1] + running[cut]) / 2
    return drafts, probs, cut, (running[cut - 1] + running[cut]) / 2


def test_a_chain_cut_short_holds_what_it_kept(engine: DraftEngine, ref: Reference) -> None:
    """A threshold stops the chain after `cut` drafts: the proposal awaiting its verdict
    holds those drafts and the rows R0 .. R(cut) (the stopping row computed), the blocks
    past them are returned, and a verdict may accept no more than `cut`."""
    drafts, _, cut, tau = _threshold_that_cuts(ref)
    state = prefill(engine, [1, 2, 3, 4, 5], h(5, 5))
    free = engine.pool.num_free
    got = propose(engine, ProposeArgs(state, 2, h(1, 31), 6, 8, min_confidence=tau))
    assert got.tokens == drafts[:cut]
    held = engine.states[state]
    assert held.pending.drafts == drafts[:cut] and held.pending.rows_computed == cut + 1
    assert held.num_rows == 5 + cut + 1  # R0 is row 5
    blocks_for = engine.table.blocks_for
    assert engine.pool.num_free == free - (blocks_for(5 + cut + 1) - blocks_for(5))
    with pytest.raises(InvalidArgument) as refused:
        engine.after_verify(state, Verdict(cut + 1))
    assert refused.value.reason == "NUM_ACCEPTED_OUT_OF_RANGE"
    assert engine.after_verify(state, Verdict(cut)).num_rows == 5 + cut + 1


def test_batch_mixes_lengths_thresholds_and_masks(engine: DraftEngine, ref: Reference) -> None:
    """One batch of different prompt lengths, K, thresholds and masks equals each alone;
    a threshold stops its chain where the oracle's running minimum first falls below it."""
    mask = torch.zeros(7, dtype=torch.int32)
    mask[1] = 0b1111  # tokens 32..35 only
    drafts, probs, cut, tau = _threshold_that_cuts(ref)
    running = [min(probs[: i + 1]) for i in range(8)]

    def requests(states: list[int]) -> list[ProposeArgs]:
        return [
            ProposeArgs(states[0], 1, h(1, 30), 3, 2),
            ProposeArgs(states[1], 2, h(1, 31), 6, 8, min_confidence=tau),
            ProposeArgs(states[2], 3, h(1, 32), 10, 5, bitmask=mask),
            ProposeArgs(states[3], 2, h(1, 31), 6, 8, min_confidence=0.0),
        ]

    def states() -> list[int]:
        return [prefill(engine, list(range(1, n + 1)), h(n, n)) for n in (2, 5, 9, 5)]

    def accept_all(states: list[int], proposals: list[Proposal]) -> list[ProposeArgs]:
        """Every draft accepted: each next row is (last draft, its chain's last hidden)."""
        return [
            ProposeArgs(s, 4, h(1, 40 + i), p.first_position + len(p.tokens), 3,
                        previous=Verdict(len(p.tokens)))
            for i, (s, p) in enumerate(zip(states, proposals, strict=True))
        ]  # fmt: skip

    batched, single = states(), states()
    together = propose_batch(engine, requests(batched))
    alone = [propose(engine, args) for args in requests(single)]
    assert len(together[0].tokens) == 2
    stopped, unstopped = together[1], together[3]
    assert 0 < cut < 8 and stopped.tokens == drafts[:cut]
    assert stopped.probs == pytest.approx(probs[:cut], abs=1e-4)
    assert stopped.confidence == pytest.approx(running[cut], abs=1e-4) and stopped.confidence < tau
    assert unstopped.tokens == drafts  # the same chain with no threshold: all 8 drafts
    assert unstopped.probs == pytest.approx(probs, abs=1e-4)
    assert unstopped.confidence == pytest.approx(running[-1], abs=1e-4)
    assert set(together[2].tokens) <= {32, 33, 34, 35} and len(together[2].tokens) == 5
    # The chains stopped after different steps: the next proposals read each one's own.
    together += propose_batch(engine, accept_all(batched, together))
    alone += [propose(engine, args) for args in accept_all(single, alone)]
    for one, many in zip(alone, together, strict=True):
        assert one.tokens == many.tokens
        assert one.probs == pytest.approx(many.probs, abs=1e-5)
    assert_accounted(engine)


def _step(engine: DraftEngine, requests: list[ProposeArgs]) -> StepResult:
    """The requests as one step of the engine, a row each."""
    return engine.step(step_of(requests, engine.step_shape))


def test_a_failing_row_changes_nothing_and_its_batch_drafts_as_alone(
    engine: DraftEngine,
) -> None:
    """One row of a batch with a NaN hidden is refused alone; the others draft as beside a
    finite row (the refused row may run in the batch's chain, writing nothing: its NaN
    reaches no other row)."""
    nan = h(1, 41)
    nan[0, 5] = float("nan")
    good, bad = prefill(engine, [1, 2, 3], h(3, 40)), prefill(engine, [1, 2, 3], h(3, 40))
    free = engine.pool.num_free
    together = _step(engine, [ProposeArgs(good, 4, h(1, 42), 4, 3), ProposeArgs(bad, 4, nan, 4, 3)])
    refused = together.errors[1]
    assert isinstance(refused, InvalidArgument) and list(together.errors) == [1]
    assert (refused.reason, refused.field) == ("NOT_FINITE", "hidden")
    assert together.counts[1] == 0 and (together.drafts[1] == -1).all()
    assert engine.states[bad].num_rows == 3 and engine.states[bad].pending is None
    assert engine.pool.num_free == free - 1  # good's rows 4..6 took one more block
    assert_accounted(engine)
    again, other = prefill(engine, [1, 2, 3], h(3, 40)), prefill(engine, [1, 2, 3], h(3, 40))
    finite = _step(
        engine, [ProposeArgs(again, 4, h(1, 42), 4, 3), ProposeArgs(other, 4, h(1, 41), 4, 3)]
    )
    got, expected = together.proposal(0, good), finite.proposal(0, again)
    assert (got.tokens, got.probs) == (expected.tokens, expected.probs)


@pytest.mark.parametrize(("first", "then"), [(1, 3), (4, 2)])
def test_a_refused_hidden_leaves_the_pending_rows_for_another_verdict(
    engine: DraftEngine, first: int, then: int
) -> None:
    """A verdict sent with a NaN hidden, beside a good row, is refused (its hidden is
    checked while its chain runs, the chain writing nothing for it; a verdict of every
    draft computes the last draft's row first, past the pending ones): the pending
    proposal's rows stay as they were, so another verdict then drafts as if the refused
    one never came, its KV rows too."""
    twins = [prefill(engine, [1, 2, 3], h(3, 40)) for _ in range(3)]
    for state in twins:
        propose(engine, ProposeArgs(state, 4, h(1, 41), 4, 4))  # rows 3..6 pending
    refused, untouched, beside = twins
    nan = h(1, 42)
    nan[0, 9] = float("nan")
    free = engine.pool.num_free
    position = 4 + first + 1
    failed = _step(
        engine,
        [ProposeArgs(s, 7, hidden, position, 4, previous=Verdict(first))
         for s, hidden in ((refused, nan), (beside, h(1, 44)))],
    )  # fmt: skip
    assert list(failed.errors) == [0] and failed.errors[0].reason == "NOT_FINITE"
    assert failed.counts[1] == 4
    assert engine.pool.num_free == free - 1  # the block beside's new rows reach
    assert engine.states[refused].pending == engine.states[untouched].pending
    later = [ProposeArgs(s, 8, h(1, 43), 4 + then + 1, 4, previous=Verdict(then))
             for s in (refused, untouched)]  # fmt: skip
    got, expected = (propose(engine, args) for args in later)
    assert (got.tokens, got.probs) == (expected.tokens, expected.probs)
    for a, b in zip(kv_rows(engine, refused), kv_rows(engine, untouched), strict=True):
        assert torch.equal(a, b)
    assert_accounted(engine)


def test_a_nan_refeed_in_a_batch_refuses_its_row_alone(engine: DraftEngine) -> None:
    """Refeed hiddens are checked with the batch's hiddens: a NaN among them refuses
    only the row that sent it, and leaves its state's proposal pending."""
    good, bad = prefill(engine, [1, 2, 3], h(3, 40)), prefill(engine, [1, 2, 3], h(3, 40))
    for state in (good, bad):
        propose(engine, ProposeArgs(state, 4, h(1, 41), 4, 4))
    rows = {s: engine.states[s].num_rows for s in (good, bad)}
    nan = h(2, 43)
    nan[1, 7] = float("nan")
    together = _step(
        engine,
        [
            ProposeArgs(good, 5, h(1, 44), 7, 3, previous=Verdict(2, h(2, 43))),
            ProposeArgs(bad, 5, h(1, 44), 7, 3, previous=Verdict(2, nan)),
        ],
    )
    refused = together.errors[1]
    assert isinstance(refused, InvalidArgument) and list(together.errors) == [1]
    assert (refused.reason, refused.field) == ("NOT_FINITE", "previous.refeed_hiddens")
    assert engine.states[bad].num_rows == rows[bad]
    assert engine.states[bad].pending is not None  # its verdict can still come
    drafted = together.proposal(0, good)
    assert len(drafted.tokens) == 3 and drafted.first_position == 8
    assert_accounted(engine)


def test_non_finite_hiddens_fail_their_own_request_checked_once_a_batch(
    engine: DraftEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch's hiddens are checked for NaN and inf in one call, its refeeds in one
    more; a request with a bad hidden or refeed fails alone, naming the field."""
    checked: list[int] = []
    find = admission.finite_rows
    monkeypatch.setattr(
        admission, "finite_rows", lambda rows: checked.append(len(rows)) or find(rows)
    )
    states = [prefill(engine, [1, 2, 3], h(3, 40)) for _ in range(3)]
    propose(engine, ProposeArgs(states[2], 4, h(1, 41), 4, 2))
    checked.clear()
    nan_hidden, inf_refeed = h(1, 42), h(1, 43)
    nan_hidden[0, 5], inf_refeed[0, 1] = float("nan"), float("inf")
    together = _step(
        engine,
        [
            ProposeArgs(states[0], 4, h(1, 42), 4, 3),
            ProposeArgs(states[1], 4, nan_hidden, 4, 3),
            ProposeArgs(states[2], 5, h(1, 44), 6, 3, previous=Verdict(1, inf_refeed)),
        ],
    )
    assert sorted(checked) == [1, 3]  # the three hiddens in one call, the refeed row in one
    assert together.counts[0] == 3 and 0 not in together.errors
    for row, field in ((1, "hidden"), (2, "previous.refeed_hiddens")):
        refused = together.errors[row]
        assert isinstance(refused, InvalidArgument)
        assert (refused.reason, refused.field) == ("NOT_FINITE", field)
    assert engine.states[states[2]].pending is not None  # unchanged: its verdict can come
    assert_accounted(engine)


def test_a_usual_step_checks_its_hiddens_while_its_chain_runs(
    engine: DraftEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hiddens' NaN/inf check of a step whose rows change nothing before their chain
    is made once the chain is queued (its before_wait), not before; a step that refeeds
    makes it before."""
    events: list[str] = []
    find, chain = admission.finite_rows, engine.head.decode_chain
    monkeypatch.setattr(admission, "finite_rows", lambda r: events.append("check") or find(r))

    def queued(kv, inputs, before_wait=None):
        events.append("chain")
        return chain(kv, inputs, before_wait)

    monkeypatch.setattr(engine.head, "decode_chain", queued)
    states = [prefill(engine, [1, 2, 3], h(3, 40 + i)) for i in range(2)]
    _step(engine, [ProposeArgs(s, 4, h(1, 50), 4, 3) for s in states])
    assert events == ["chain", "check"]
    events.clear()
    refeed = [ProposeArgs(s, 5, h(1, 51), 6, 3, previous=Verdict(1, h(1, 52))) for s in states]
    _step(engine, refeed)
    assert events[:2] == ["check", "check"] and events[-1] == "chain"


class _TorchCalls(TorchFunctionMode):
    """Counts the torch calls that do work (not metadata reads), the MTP head's own aside."""

    _METADATA = frozenset({"dim", "is_floating_point", "size", "numel", "__get__"})

    def __init__(self) -> None:
        super().__init__()
        self.count, self.in_head = 0, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if not self.in_head and name not in self._METADATA:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_batch_makes_no_torch_call_per_request(
    engine: DraftEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Around the head's forward, a batch's host work makes as many torch calls for 6
    one-request calls as for 2 (each call made a Step as it arrived): on a serving
    engine thread every torch call hands the GIL to the event loop, and winning it back
    can take a switch interval."""
    counter = _TorchCalls()
    decode_chain = engine.head.decode_chain

    def uncounted(*args):
        counter.in_head = True
        try:
            return decode_chain(*args)
        finally:
            counter.in_head = False

    monkeypatch.setattr(engine.head, "decode_chain", uncounted)
    counts = []
    for n in (2, 6):
        states = [prefill(engine, [1, 2, 3], h(3, 40 + i)) for i in range(n)]
        calls = [
            step_of([ProposeArgs(s, 4, h(1, 50 + i)[0], 4, 3)], engine.step_shape)
            for i, s in enumerate(states)
        ]
        with counter:
            before = counter.count
            result = engine.step(Step.concat(calls))
            counts.append(counter.count - before)
        assert result.counts.tolist() == [3] * n and not result.errors
    assert counts[0] == counts[1], counts


def test_leases_expire_idle_states_and_handles(engine: DraftEngine, clock: Clock) -> None:
    idle = prefill(engine, [1, 2, 3], h(3, 0))
    busy = engine.alloc_state()
    session = engine.begin_prefill(busy, 1)  # a live stream renews its lease per chunk
    silent = engine.alloc_state()
    engine.begin_prefill(silent, 1)  # a stream whose client vanished: no more chunks
    donor = prefill(engine, [4, 5], h(2, 1))
    handle = engine.take_kv(donor).handle_id
    clock.now = 9.0
    session.append([1], h(1, 2))
    assert engine.reap_expired() == (0, 0)
    clock.now = 10.5
    engine.free_state(donor)
    assert engine.reap_expired() == (2, 1)
    assert idle not in engine.states and silent not in engine.states and busy in engine.states
    with pytest.raises(NotFound):
        engine.install_kv(busy, handle)
    session.append([2], h(1, 3))
    session.finish()
    engine.free_state(busy)
    assert engine.pool.num_free == engine.pool.num_total


def test_prefill_abort_restores_the_state(engine: DraftEngine) -> None:
    state = prefill(engine, [1, 2, 3], h(3, 0))
    before = [t.clone() for t in kv_rows(engine, state)]
    session = engine.begin_prefill(state, 4)
    session.append([4, 5, 6, 7, 8], h(5, 1))
    with pytest.raises(FailedPrecondition):
        propose(engine, ProposeArgs(state, 1, h(1, 2), 9, 2))  # the stream is open
    session.abort()
    assert engine.states[state].num_rows == 3
    for got, want in zip(kv_rows(engine, state), before, strict=True):
        assert torch.equal(got, want)
    assert_accounted(engine)


def test_close_frees_everything_and_refuses_new_states(engine: DraftEngine) -> None:
    prefill(engine, [1, 2, 3], h(3, 0))
    engine.take_kv(prefill(engine, [1], h(1, 1)))
    assert engine.close() == 2
    assert engine.pool.num_free == engine.pool.num_total and not engine.handles
    with pytest.raises(Unavailable):
        engine.alloc_state()


def test_a_batch_mixing_recomputed_and_chained_first_drafts_equals_one_by_one(
    head: MTPHead,
) -> None:
    """Refeed (rows recomputed, first draft from a forward), all accepted (one row
    recomputed), none accepted (chained from R0) and a first proposal, in one batch:
    the same drafts and KV rows as each state served alone."""
    verdicts = [Verdict(2, h(2, 7)), Verdict(3), Verdict(0), None]
    config = ServeConfig(kv_blocks=64, block_size=4, max_drafts=8)
    engines = [DraftEngine(head, config) for _ in range(2)]
    states: list[list[int]] = []
    for engine in engines:
        states.append([prefill(engine, [5 + i] * (6 + i), h(6 + i, i)) for i in range(4)])
        for i, verdict in enumerate(verdicts):
            if verdict is not None:  # a pending proposal of 3 drafts to judge
                propose(engine, ProposeArgs(states[-1][i], 9, h(1, 20 + i)[0], 7 + i, 3))

    def request(i: int, state: int) -> ProposeArgs:
        position = 7 + i + (0 if verdicts[i] is None else 1 + verdicts[i].num_accepted)
        return ProposeArgs(state, 11 + i, h(1, 30 + i)[0], position, 4, previous=verdicts[i])

    batched = propose_batch(engines[0], [request(i, s) for i, s in enumerate(states[0])])
    alone = [propose(engines[1], request(i, s)) for i, s in enumerate(states[1])]
    for got, want in zip(batched, alone, strict=True):
        assert got.tokens == want.tokens
        assert got.probs == pytest.approx(want.probs, abs=1e-5)
    for a, b in zip(states[0], states[1], strict=True):
        ka, va = kv_rows(engines[0], a)
        kb, vb = kv_rows(engines[1], b)
        torch.testing.assert_close(ka, kb, **KV_CLOSE)
        torch.testing.assert_close(va, vb, **KV_CLOSE)


def test_several_states_refeed_in_one_step_as_the_oracle_says(
    engine: DraftEngine, ref: Reference
) -> None:
    """Four states of different lengths in one step, each with a verdict that refeeds a
    different number of rows (1 to 4): each state's drafts are the float64 oracle's for its
    own refed rows (one state handed another's rows would draft otherwise), and its KV holds
    the rows a fresh prefill of its committed rows would."""
    states, oracles, requests, wanted = [], [], [], []
    for i, n in enumerate((3, 6, 10, 15)):
        tokens, hiddens = [(7 * i + j) % V for j in range(n)], h(n, 50 + i)
        state, oracle = prefill(engine, tokens, hiddens), Expected(ref)
        oracle.add(tokens, hiddens)
        x, hx = 20 + i, h(1, 60 + i)
        drafts, _ = oracle.propose(x, hx, 4)
        assert propose(engine, ProposeArgs(state, x, hx, n + 1, 4)).tokens == drafts
        accepted, refeed = i + 1, h(i + 1, 70 + i)
        oracle.verdict(accepted, refeed)
        x, hx = 30 + i, h(1, 80 + i)
        previous = Verdict(accepted, refeed)
        requests.append(ProposeArgs(state, x, hx, oracle.next_position, 3, previous=previous))
        wanted.append(oracle.propose(x, hx, 3))
        states.append(state)
        oracles.append(oracle)
    for got, (drafts, probs) in zip(propose_batch(engine, requests), wanted, strict=True):
        assert got.tokens == drafts
        assert got.probs == pytest.approx(probs, abs=1e-4)
    for state, oracle in zip(states, oracles, strict=True):
        fresh = prefill(engine, oracle.tokens, oracle.hiddens.float())
        rows = len(oracle.tokens)  # the committed rows, R0 of the last proposal included
        for got, want in zip(kv_rows(engine, state), kv_rows(engine, fresh), strict=True):
            torch.testing.assert_close(got[:rows], want, **KV_CLOSE)
    assert_accounted(engine)


def test_a_retried_step_is_answered_as_it_was_and_runs_once(engine: DraftEngine) -> None:
    """A numbered step sent again (its client never saw the answer) gets the answer its
    proposal was given and changes nothing: it drafts no second time, nor applies its
    verdict twice. Its twin, never retried, drafts the same all along."""
    retried, twin = (prefill(engine, [1, 2, 3], h(3, 50)) for _ in range(2))
    steps = [
        ProposeArgs(0, 4, h(1, 51), 4, 3, step_number=1),
        ProposeArgs(0, 9, h(1, 52), 6, 4, previous=Verdict(1, h(1, 53)), step_number=2),
        ProposeArgs(0, 7, h(1, 54), 9, 2, previous=Verdict(2), step_number=5),
    ]

    def sent(args: ProposeArgs, state: int) -> ProposeArgs:
        return replace(args, state_id=state)

    for args in steps:
        answer = propose(engine, sent(args, retried))
        rows, pending = engine.states[retried].num_rows, engine.states[retried].pending
        free = engine.pool.num_free
        for _ in range(2):
            assert propose(engine, sent(args, retried)) == answer
            assert engine.states[retried].num_rows == rows
            assert engine.states[retried].pending == pending
            assert engine.pool.num_free == free
        assert propose(engine, sent(args, twin)) == replace(answer, state_id=twin)
    # Step 5 is pending: an older number, or 5 at another position, is stale.
    for stale in [replace(steps[1], step_number=2), replace(steps[2], position=8)]:
        with pytest.raises(FailedPrecondition) as err:
            propose(engine, sent(stale, retried))
        assert err.value.reason == "STALE_STEP"
    # Once the proposal has its verdict, its step is over: sent again, it is stale too.
    engine.after_verify(retried, Verdict(0))
    with pytest.raises(FailedPrecondition) as err:
        propose(engine, sent(steps[2], retried))
    assert err.value.reason == "STALE_STEP"
    assert_accounted(engine)


def test_a_retry_in_a_batch_is_answered_beside_new_steps(engine: DraftEngine) -> None:
    """A retried row and new ones in one step: the retry is answered from its pending
    proposal, even where it asks fewer drafts, and the others draft as alone."""
    a, b, alone = (prefill(engine, [1, 2, 3], h(3, 60)) for _ in range(3))
    first = propose(engine, ProposeArgs(a, 4, h(1, 61), 4, 4, step_number=7))
    step = [
        ProposeArgs(a, 4, h(1, 61), 4, 2, step_number=7),  # K 2: answered its 4 drafts
        ProposeArgs(b, 4, h(1, 62), 4, 3, step_number=7),
    ]
    together = _step(engine, step)
    assert not together.errors and together.drafts.shape[1] == 4
    assert together.proposal(0, a) == first
    by_itself = propose(engine, ProposeArgs(alone, 4, h(1, 62), 4, 3))
    assert together.proposal(1, b) == replace(by_itself, state_id=b)  # one row ran
    assert_accounted(engine)


def test_a_step_leaves_the_callers_tensors_as_they_were(engine: DraftEngine) -> None:
    """The recomputed first draft's hidden feeds the chain; it must not be written into
    the caller's hidden (in process, the caller keeps using its tensors)."""
    state = prefill(engine, [1, 2, 3], h(3, 90))
    first = propose(engine, ProposeArgs(state, 4, h(1, 91), 4, 3))
    hidden, refeed = h(1, 92), h(2, 93)
    kept = hidden.clone(), refeed.clone()
    previous = Verdict(2, refeed)
    propose(engine, ProposeArgs(state, 5, hidden, first.first_position + 2, 3, previous=previous))
    assert torch.equal(hidden, kept[0]) and torch.equal(refeed, kept[1])


def test_a_retried_sampled_step_answers_its_q_as_it_was(engine: DraftEngine) -> None:
    """A sampled proposal's retry answers each draft's q as first answered, alone or beside
    a greedy row run anew (whose q is then its draft alone, as in any sampled batch)."""
    sampled = engine.alloc_state(sampling=Sampling(1.0, 0, 1.0, 0.0, 7))
    session = engine.begin_prefill(sampled, 1)
    session.append([1, 2, 3], h(3, 70))
    session.finish()
    greedy = prefill(engine, [1, 2, 3], h(3, 71))
    args = ProposeArgs(sampled, 4, h(1, 72), 4, 3, step_number=1)
    first = propose(engine, args)
    assert first.q_ids is not None and len(first.q_ids[0]) > 1  # a sampled q
    assert propose(engine, args) == first
    alone = propose(engine, ProposeArgs(greedy, 4, h(1, 73), 4, 3, step_number=1))
    assert alone.q_ids is None  # a greedy batch answers no q
    engine.after_verify(greedy, Verdict(0))
    later = ProposeArgs(greedy, 5, h(1, 74), 5, 2)
    again, fresh = propose_batch(engine, [args, later])
    assert again == first
    assert [q[0] for q in fresh.q_ids] == fresh.tokens
    assert [sorted(p, reverse=True)[:2] for p in fresh.q_probs] == [[1.0, 0.0]] * 2
    assert_accounted(engine)
