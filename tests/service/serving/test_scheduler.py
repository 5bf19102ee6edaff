"""Cross-client batching: merged batches, same results, deadlines, cancellation, queue limit."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from proposing import ProposeArgs, proposals, propose, step_of
from servers import PATIENCE, until

from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine.engine import DraftEngine
from mtpdraft.service.engine.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted
from mtpdraft.service.engine.types import Proposal, Verdict
from mtpdraft.service.model.checkpoint import load_mtp_weights
from mtpdraft.service.model.mtp_head import MTPHead
from mtpdraft.service.model.synthetic import write_random_checkpoint
from mtpdraft.service.serving.runner import EngineRunner
from mtpdraft.service.serving.scheduler import ProposeScheduler


@pytest.fixture(scope="module")
def head(tmp_path_factory) -> MTPHead:
    folder = write_random_checkpoint(tmp_path_factory.mktemp("ckpt"), "mimo", seed=4)
    return MTPHead(load_mtp_weights(folder), torch.device("cpu"))


def h(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 64, generator=torch.Generator().manual_seed(seed))


def make_engine(head: MTPHead) -> DraftEngine:
    return DraftEngine(head, ServeConfig(kv_blocks=256, block_size=4, max_drafts=8, max_batch=8))


def scheduler_of(engine: DraftEngine, runner: EngineRunner, **options) -> ProposeScheduler:
    """A scheduler of `mtpdraft serve`'s defaults but for ServeConfig `options`, and
    ProposeScheduler's `on_batch` and `inline`."""
    kept = {name: options.pop(name) for name in ("on_batch", "inline") if name in options}
    return ProposeScheduler(engine, runner, ServeConfig(**options), **kept)


async def submit(
    scheduler: ProposeScheduler, requests: list[ProposeArgs], timeout: float | None = None
) -> list[Proposal]:
    """One call's requests queued as one Step; their proposals once their batch ran (the
    first failed row's error raised)."""
    step = step_of(requests, scheduler.engine.step_shape)
    return proposals(step, await scheduler.enqueue(step, timeout))


def with_prompts(engine: DraftEngine, count: int) -> list[int]:
    states = []
    for i in range(count):
        state = engine.alloc_state()
        session = engine.begin_prefill(state, 1)
        session.append(list(range(1, 3 + i)), h(2 + i, i))
        session.finish()
        states.append(state)
    return states


def step_args(state: int, i: int, step: int) -> ProposeArgs:
    previous = Verdict(1, h(1, 100 + i)) if step else None
    return ProposeArgs(state, 7, h(1, 50 + 10 * step + i), 3 + i + 2 * step, 3, previous=previous)


def test_concurrent_calls_merge_and_equal_sequential(head: MTPHead) -> None:
    sequential = make_engine(head)
    expected_states = with_prompts(sequential, 12)
    expected = [
        [propose(sequential, step_args(s, i, step)) for i, s in enumerate(expected_states)]
        for step in range(3)
    ]

    async def concurrently() -> tuple[list, list[int]]:
        engine, runner, sizes = make_engine(head), EngineRunner(), []

        def on_batch(run) -> None:
            sizes.append(run.requests)

        scheduler = scheduler_of(engine, runner, on_batch=on_batch)
        scheduler.start()
        states = with_prompts(engine, 12)
        got = []
        for step in range(3):
            calls = [submit(scheduler, [step_args(s, i, step)]) for i, s in enumerate(states)]
            got.append([(await call)[0] for call in [asyncio.ensure_future(c) for c in calls]])
        await scheduler.stop()
        runner.shutdown()
        return got, sizes

    got, sizes = asyncio.run(concurrently())
    assert max(sizes) == 8  # 12 concurrent calls ran as batches of 8 and 4
    assert sum(sizes) == 36
    for step_got, step_expected in zip(got, expected, strict=True):
        for g, e in zip(step_got, step_expected, strict=True):
            assert g.tokens == e.tokens
            assert g.probs == pytest.approx(e.probs, abs=1e-5)


async def _blocked(scheduler: ProposeScheduler) -> tuple[asyncio.Future, threading.Event]:
    """A first batch that computes until the event is set, so that the next calls queue up
    behind it: (its call, the event)."""
    engine = scheduler.engine
    (state,) = with_prompts(engine, 1)
    original = engine.step
    computing, release = threading.Event(), threading.Event()

    def slow(step):
        engine.step = original
        computing.set()
        release.wait(PATIENCE)
        return original(step)

    engine.step = slow
    call = asyncio.ensure_future(submit(scheduler, [ProposeArgs(state, 1, h(1, 0), 3, 1)]))
    await until(computing.is_set, "the slow batch")
    return call, release


def test_deadline_cancellation_and_queue_limit(head: MTPHead) -> None:
    async def scenario() -> None:
        engine, runner = make_engine(head), EngineRunner()
        scheduler = scheduler_of(engine, runner, max_queue=3)
        scheduler.start()
        a, b, c = with_prompts(engine, 3)
        busy, release = await _blocked(scheduler)
        late = asyncio.ensure_future(submit(scheduler, [ProposeArgs(a, 1, h(1, 1), 3, 2)], 0.1))
        gone = asyncio.ensure_future(submit(scheduler, [ProposeArgs(b, 1, h(1, 2), 4, 2)]))
        kept = asyncio.ensure_future(submit(scheduler, [ProposeArgs(c, 1, h(1, 3), 5, 2)]))
        await until(lambda: scheduler.queued == 3, "three queued calls")
        with pytest.raises(ResourceExhausted):  # three calls wait: the queue is full
            await submit(scheduler, [ProposeArgs(a, 1, h(1, 1), 3, 2)])
        gone.cancel()
        await asyncio.sleep(0.1)  # the late call's deadline passes while it waits
        release.set()
        await busy
        with pytest.raises(DeadlineExceeded):
            await late
        assert len((await kept)[0].tokens) == 2
        # Neither the late nor the cancelled call touched its state: both propose afresh.
        for state, position in ((a, 3), (b, 4)):
            assert engine.states[state].pending is None
            (p,) = await submit(scheduler, [ProposeArgs(state, 1, h(1, 4), position, 2)])
            assert p.first_position == position + 1
        await scheduler.stop()
        runner.shutdown()

    asyncio.run(scenario())


def test_a_taken_call_whose_deadline_passes_before_its_forward_changes_nothing(
    head: MTPHead,
) -> None:
    """A call taken into a batch that then waits for the engine thread (busy with another
    call: a Prefill chunk, a stalled device) is dropped unchanged if its deadline passes
    before the forward starts: DeadlineExceeded, its state as it was."""

    async def scenario() -> None:
        engine, runner = make_engine(head), EngineRunner()
        scheduler = scheduler_of(engine, runner)
        scheduler.start()
        (state,) = with_prompts(engine, 1)
        rows = engine.states[state].num_rows
        stalled, release = threading.Event(), threading.Event()

        def stall() -> None:
            stalled.set()
            release.wait(PATIENCE)

        busy = asyncio.ensure_future(runner.call(stall))
        await until(stalled.is_set, "the engine thread stalled")
        late = asyncio.ensure_future(submit(scheduler, [ProposeArgs(state, 1, h(1, 1), 3, 2)], 0.1))
        # Taken out of the queue into a batch, which waits for the engine thread.
        await until(lambda: scheduler.queued == 0 and scheduler._running, "the batch taken")
        await asyncio.sleep(0.2)
        release.set()
        await busy
        with pytest.raises(DeadlineExceeded):
            await late
        assert engine.states[state].pending is None
        assert engine.states[state].num_rows == rows
        await scheduler.stop()
        runner.shutdown()

    asyncio.run(scenario())


def test_a_bad_call_fails_alone(head: MTPHead) -> None:
    async def scenario() -> None:
        engine, runner = make_engine(head), EngineRunner()
        scheduler = scheduler_of(engine, runner)
        scheduler.start()
        a, b = with_prompts(engine, 2)
        busy, release = await _blocked(scheduler)
        good = asyncio.ensure_future(submit(scheduler, [ProposeArgs(a, 1, h(1, 1), 3, 2)]))
        bad = asyncio.ensure_future(submit(scheduler, [ProposeArgs(b, 1, h(1, 2), 9, 2)]))
        twice = asyncio.ensure_future(submit(scheduler, [ProposeArgs(a, 1, h(1, 1), 3, 2)]))
        await until(lambda: scheduler.queued == 3, "three queued calls")
        release.set()
        await busy
        assert len((await good)[0].tokens) == 2
        with pytest.raises(InvalidArgument):
            await bad
        # `a` again waited for the next batch, where its proposal was pending.
        with pytest.raises(Exception, match="awaiting its verdict"):
            await twice
        await scheduler.stop()
        runner.shutdown()

    asyncio.run(scenario())


def test_two_calls_on_one_state_are_served_in_arrival_order(head: MTPHead) -> None:
    """A call too large for the batch being filled waits; a later, smaller call on one of
    its states waits behind it rather than taking the room left (its verdict is on the
    proposal the first call makes)."""

    async def scenario() -> None:
        engine, runner, sizes = make_engine(head), EngineRunner(), []
        scheduler = scheduler_of(engine, runner, on_batch=lambda run: sizes.append(run.requests))
        scheduler.start()
        states = with_prompts(engine, 10)

        def first(i: int) -> ProposeArgs:
            return ProposeArgs(states[i], 1, h(1, i), 3 + i, 2)

        busy, release = await _blocked(scheduler)
        six = asyncio.ensure_future(submit(scheduler, [first(i) for i in range(6)]))
        three = asyncio.ensure_future(submit(scheduler, [first(i) for i in (6, 7, 8)]))
        verdict = ProposeArgs(states[6], 2, h(1, 20), 10, 2, previous=Verdict(0))
        then = asyncio.ensure_future(submit(scheduler, [verdict]))
        await until(lambda: scheduler.queued == 3, "three queued calls")
        release.set()
        await busy
        assert [len(p) for p in await asyncio.gather(six, three)] == [6, 3]
        (p,) = await then  # NO_PENDING_PROPOSAL had it overtaken the call of three
        assert p.first_position == 11
        assert sizes == [1, 6, 3, 1]
        await scheduler.stop()
        runner.shutdown()

    asyncio.run(scenario())


def _placed(engine: DraftEngine) -> list[str]:
    """Where each of the engine's batches runs from now on: "loop" or "engine" thread."""
    loop_thread, original, where = threading.get_ident(), engine.step, []

    def recorded(step):
        where.append("loop" if threading.get_ident() == loop_thread else "engine")
        return original(step)

    engine.step = recorded
    return where


def test_a_batch_nobody_else_is_due_for_runs_on_the_loop_with_the_same_result(
    head: MTPHead,
) -> None:
    sequential = make_engine(head)
    expected_states = with_prompts(sequential, 6)
    expected = [propose(sequential, step_args(s, i, step)) for step in range(2)
                for i, s in enumerate(expected_states[:4])]  # fmt: skip
    expected += [propose(sequential, step_args(s, i, 0)) for i, s in enumerate(expected_states)
                 if i >= 4]  # fmt: skip

    async def scenario(inline: bool) -> tuple[list, list[str]]:
        engine, runner = make_engine(head), EngineRunner()
        where = _placed(engine)
        scheduler = scheduler_of(engine, runner, inline=inline)
        scheduler.start()
        states = with_prompts(engine, 6)
        got = []
        for step in range(2):  # one verifier of 4 states, alone, back every 0.2 s
            if step:
                await asyncio.sleep(0.2)
            got += await submit(
                scheduler, [step_args(s, i, step) for i, s in enumerate(states[:4])]
            )
        # A second verifier's first step, at once: the first one's are due back meanwhile.
        got += await submit(scheduler, [step_args(s, i + 4, 0) for i, s in enumerate(states[4:])])
        await scheduler.stop()
        runner.shutdown()
        return got, where

    for inline, places in ((True, ["loop", "loop", "engine"]), (False, ["engine"] * 3)):
        got, where = asyncio.run(scenario(inline))
        assert where == places
        for g, e in zip(got, expected, strict=True):
            assert g.tokens == e.tokens
            assert g.probs == pytest.approx(e.probs, abs=1e-5)


def test_a_batch_waits_for_the_engine_threads_call_rather_than_overtake_it(
    head: MTPHead,
) -> None:
    async def scenario() -> None:
        engine, runner = make_engine(head), EngineRunner()
        where = _placed(engine)
        scheduler = scheduler_of(engine, runner, inline=True)
        scheduler.start()
        (state,) = with_prompts(engine, 1)
        release = threading.Event()
        busy = asyncio.ensure_future(runner.call(release.wait, PATIENCE))
        await asyncio.sleep(0.05)  # the engine thread is inside it
        call = asyncio.ensure_future(submit(scheduler, [ProposeArgs(state, 1, h(1, 0), 3, 2)]))
        await asyncio.sleep(0.05)
        assert not call.done() and not where
        release.set()
        await busy
        assert len((await call)[0].tokens) == 2
        assert where == ["engine"]
        await scheduler.stop()
        runner.shutdown()

    asyncio.run(scenario())
