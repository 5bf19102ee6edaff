"""The scheduler's gathering wait: verifiers due back share a batch, nobody else waits.

The engine here is a stand-in with a fixed step time, since what is tested is
when batches start and what they hold, not what they compute (test_scheduler.py
runs the real engine through the same scheduler). Every time in these tests is a
multiple of a unit: 20 ms, or more where this machine wakes its threads and tasks late.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from mtpdraft.service.config import ServeConfig
from mtpdraft.service.engine.step import Step, StepResult, StepShape, single
from mtpdraft.service.serving.runner import EngineRunner
from mtpdraft.service.serving.scheduler import ProposeScheduler


class TimedEngine:
    """Answers every batch after `step_time` seconds; records the states of each batch."""

    step_shape = StepShape(hidden_size=4, vocab_size=8, max_batch=8)

    def __init__(self, step_time: float) -> None:
        self.step_time = step_time
        self.batches: list[set[int]] = []

    def step(self, step: Step) -> StepResult:
        time.sleep(self.step_time)
        self.batches.append(set(step.state_ids.tolist()))
        ones = np.ones((len(step), 1))
        drafts, probs = ones.astype(np.int64), ones.astype(np.float32)
        return StepResult(drafts, probs, drafts[:, 0], ones[:, 0], step.positions + 1, {})


@pytest.fixture(scope="module")
def unit() -> float:
    """20 ms, or five times the latest wake-up seen (an engine call through the runner
    thread, then a 1 ms sleep on the loop) if the machine is that loaded now; at most
    100 ms, under the second after which the scheduler forgets a state."""

    async def latest() -> float:
        runner, loop, worst = EngineRunner(), asyncio.get_running_loop(), 0.0
        for _ in range(50):
            started = loop.time()
            await runner.call(time.sleep, 0.001)
            await asyncio.sleep(0.001)
            worst = max(worst, loop.time() - started - 0.002)
        runner.shutdown()
        return worst

    return min(max(0.02, 5 * asyncio.run(latest())), 0.1)


def _request(state: int, step: int) -> Step:
    return single(state, 1, torch.zeros(4), step, 1, shape=TimedEngine.step_shape)


async def _verifier(scheduler: ProposeScheduler, state: int, steps: int, think: float) -> None:
    """A verifier in its decode loop: propose, then `think` seconds before the next step."""
    for step in range(steps):
        await scheduler.enqueue(_request(state, step))
        await asyncio.sleep(think)


def _run(engine: TimedEngine, batch_wait: float, verifiers: list[tuple[int, int, float]]) -> float:
    """Runs the verifiers (state, steps, think seconds) together; returns the wall time."""

    async def scenario() -> float:
        runner = EngineRunner()
        config = ServeConfig(batch_wait_us=batch_wait * 1e6)
        scheduler = ProposeScheduler(engine, runner, config)  # type: ignore[arg-type]
        scheduler.start()
        started = time.monotonic()
        await asyncio.gather(*(_verifier(scheduler, *v) for v in verifiers))
        elapsed = time.monotonic() - started
        await scheduler.stop()
        runner.shutdown()
        return elapsed

    return asyncio.run(scenario())


def _staggered(unit: float) -> list[tuple[int, int, float]]:
    """Four verifiers that come back 0, 1, 2 and 3 units after their answers."""
    return [(state, 8, unit * state) for state in range(4)]


def test_verifiers_due_back_share_one_batch(unit: float) -> None:
    engine = TimedEngine(step_time=2.5 * unit)
    _run(engine, batch_wait=25 * unit, verifiers=_staggered(unit))
    # A state's round trip is known from its second call on: the first rounds run as
    # they come (state 0 gets one step ahead), then the batches hold all four.
    assert engine.batches[3:8] == [{0, 1, 2, 3}] * 5, engine.batches
    assert len(engine.batches) <= 10  # 32 steps


def test_without_gathering_the_first_back_runs_alone(unit: float) -> None:
    engine = TimedEngine(step_time=2.5 * unit)
    _run(engine, batch_wait=0.0, verifiers=_staggered(unit))
    assert len(engine.batches) > 10  # split batches: what gathering prevents


def test_a_lone_verifier_never_waits(unit: float) -> None:
    engine = TimedEngine(step_time=0.001)
    elapsed = _run(engine, batch_wait=250 * unit, verifiers=[(0, 6, 0.0)])
    assert elapsed < 100 * unit  # one wait would have taken 250


def test_a_verifier_that_stops_coming_back_holds_nobody(unit: float) -> None:
    # State 1 stops after 3 steps; state 0 goes on for 6. Were state 1 waited for until
    # batch_wait (250 units), state 0's last steps would take that long; 1.5 of state 1's
    # round trip (a few ms) is the most it may hold them.
    engine = TimedEngine(step_time=0.001)
    elapsed = _run(engine, batch_wait=250 * unit, verifiers=[(0, 6, 0.0), (1, 3, 0.0)])
    assert elapsed < 100 * unit


def test_a_verifier_busy_verifying_holds_nobody(unit: float) -> None:
    # State 1 thinks for 30 units between steps (its target model is verifying): its
    # return is not due within batch_wait (10), so state 0 never waits for it.
    engine = TimedEngine(step_time=0.001)

    async def scenario() -> float:
        runner = EngineRunner()
        config = ServeConfig(batch_wait_us=10 * unit * 1e6)
        scheduler = ProposeScheduler(engine, runner, config)  # type: ignore[arg-type]
        scheduler.start()
        slow = asyncio.ensure_future(_verifier(scheduler, 1, 2, 30 * unit))
        await asyncio.sleep(36 * unit)  # state 1 has answered twice: its round trip is known
        started = time.monotonic()
        await _verifier(scheduler, 0, 5, 0.0)
        elapsed = time.monotonic() - started
        await slow
        await scheduler.stop()
        runner.shutdown()
        return elapsed

    assert asyncio.run(scenario()) < 9 * unit  # one wait for state 1 would take 10
