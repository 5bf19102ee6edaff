"""Merges concurrent Propose calls from many clients into batched forwards.

Each call (a Propose, a ProposeBatch, a message of a ProposeStream) is a job: the
Step the converter made of it, one row per state. The loop takes the queued jobs
in arrival order, as many as fit in one batch (at most max_batch rows, each state
at most once), joins their Steps and runs them as one `engine.step` call: one
batched forward per draft position. Each job's future holds its rows of the
answer (a StepResult), every row answered or failed on its own. A job whose state
is already in the batch, or in a job that waits, waits for the next one: two
calls on one state are served in arrival order, and no client is skipped twice
in a row. While a batch computes, new jobs queue up; the next
batch takes them all (continuous batching).

A verifier in its decode loop comes back one round trip after its answer. Were
the next batch to start with the first one back, the rest would wait a whole
step for the one after, and closed-loop verifiers would settle into batches that
alternate halves, each paying the step's fixed cost. So the loop learns each
state's round trip (answer to its next call; the states of one call share the
longest) and, before starting a batch, waits
for the states due back soon, but never longer than `batch_wait`, and for no
state past 1.5 of its round trip. A lone verifier never waits; a state whose
verifier is busy verifying (its round trip is long) holds nobody.

A batch runs on the engine's thread (runner.py), so that the loop reads and queues
the next calls while it computes. But a batch that holds every verifier in its
decode loop (no state answered earlier is due back: one verifier, or several in
lockstep) has nobody's next call to overlap, and there the two thread hand-offs are
pure wait on the verifier's step: with `inline` (a GPU engine, whose step is short)
such a batch runs on the loop's own thread when the engine thread is idle. Other
calls that arrive meanwhile (a new client, a health check) wait for that step.

A job whose caller was cancelled is dropped before compute; one whose deadline
has passed is dropped with DeadlineExceeded; a full queue refuses new jobs with
ResourceExhausted. Results are the same as serving the jobs one by one.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from ..engine.engine import DraftEngine
from ..engine.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from ..engine.step import Step, StepResult
from .runner import EngineRunner

if TYPE_CHECKING:
    from ..config import ServeConfig


@dataclass
class BatchRun:
    """One batched forward as the scheduler ran it (time.time_ns), for telemetry."""

    requests: int  # rows
    calls: int
    queued_ns: int  # when the oldest of its calls was queued
    started_ns: int
    done_ns: int
    drafts: int  # draft tokens it made
    callers: list  # each call's `caller` (see ProposeScheduler.enqueue), in the batch's order


@dataclass
class _Job:
    step: Step
    future: asyncio.Future  # the StepResult of its rows
    deadline: float | None  # loop time
    queued_ns: int  # time.time_ns
    caller: object  # handed back with the batch's BatchRun
    round_trip: float | None  # its states' answer-to-this-call time (the longest), if known
    states: set[int] = field(init=False)

    def __post_init__(self) -> None:
        self.states = set(self.step.state_ids.tolist())

    def __len__(self) -> int:
        return len(self.step)


# A state answered at loop time `at` whose last round trip took `round_trip` (None: its
# first answer, or the first since it was late): plain tuples, a batch's worth at a time.
_Answered = tuple[float, float | None]


def _late(at: float, round_trip: float | None) -> float:
    """Half a round trip of jitter past its expected return: a state later than that is
    off doing something else (verifying, or gone)."""
    return at + (_FORGET_S if round_trip is None else 1.5 * round_trip)


# A state never seen back within a second is forgotten, so that the table of
# answered states holds only verifiers in their decode loop.
_FORGET_S = 1.0


def _deadline_passed() -> DeadlineExceeded:
    return DeadlineExceeded("the deadline passed while queued", reason="DEADLINE")


BatchObserver = Callable[[BatchRun], None]
T = TypeVar("T")


class ProposeScheduler:
    """Batches `engine.step` calls on `runner`'s thread, as `config` says (`max_queue`,
    `batch_wait`); `inline`: a batch nobody else is due for may run on the loop's thread."""

    def __init__(
        self,
        engine: DraftEngine,
        runner: EngineRunner,
        config: ServeConfig,
        *,
        on_batch: BatchObserver | None = None,
        inline: bool = False,
    ) -> None:
        self.engine = engine
        self.runner = runner
        self.max_batch = engine.step_shape.max_batch
        self.max_queue = config.max_queue
        self.batch_wait = config.batch_wait
        self.inline = inline
        self.on_batch = on_batch
        self.batch_sizes: Counter[int] = Counter()  # requests per batch -> batches run
        self._queue: deque[_Job] = deque()
        self._running = False  # a batch is computing
        self.closing = False  # set by a drain: no new calls, queued ones still run
        self._wake = asyncio.Event()
        self._answered: dict[int, _Answered] = {}  # states answered, not yet back
        self._awaited: set[int] = set()  # the states the gathering wait waits for
        self._gathered = asyncio.Event()  # set once they are all queued, or a batch is
        self._pruned_at = 0.0
        self._task: asyncio.Task | None = None

    @property
    def queued(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="propose-scheduler")

    async def settle(self, timeout: float) -> None:
        """Waits (at most `timeout` seconds) until every queued call has been answered."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (self._queue or self._running) and loop.time() < deadline:
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for job in self._queue:
            if not job.future.done():
                job.future.cancel()
        self._queue.clear()

    def enqueue(
        self, step: Step, timeout: float | None = None, caller: object = None
    ) -> asyncio.Future[StepResult]:
        """Queues one call's step; the future holds its rows' StepResult once their batch
        ran, and cancelling it (the caller went away) takes the call out of the queue.
        `caller` comes back in the BatchRun of the batch that ran the call (telemetry's
        span)."""
        if len(step) > self.max_batch:  # the converter's bounds: never taken into a batch
            raise ValueError(f"a step of {len(step)} rows; a batch holds {self.max_batch}")
        if self.closing:
            raise Unavailable("the server is stopping", reason="DRAINING")
        if len(self._queue) >= self.max_queue:
            raise ResourceExhausted(
                f"the propose queue is full ({self.max_queue} calls waiting)",
                reason="QUEUE_FULL",
            )
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadline = None if timeout is None else now + timeout
        pop = self._answered.pop
        answered = [a[0] for s in step.state_ids.tolist() if (a := pop(s, None)) is not None]
        round_trip = now - min(answered) if answered else None
        future = loop.create_future()
        job = _Job(step, future, deadline, time.time_ns(), caller, round_trip)
        self._queue.append(job)
        self._wake.set()
        if self._awaited:
            self._awaited -= job.states
            if not self._awaited or len(self._queue) >= self.max_batch:
                self._gathered.set()
        return job.future

    def _take(self) -> list[_Job]:
        now = asyncio.get_running_loop().time()
        taken: list[_Job] = []
        deferred: list[_Job] = []
        # The states of the jobs taken and of those deferred: a later job naming one of
        # them waits too, so that two calls on one state are served in arrival order.
        size, states = 0, set()
        while self._queue and size < self.max_batch:
            job = self._queue.popleft()
            if job.future.done():  # cancelled while queued
                continue
            if job.deadline is not None and now >= job.deadline:
                job.future.set_exception(_deadline_passed())
                continue
            fits = size + len(job) <= self.max_batch and not job.states & states
            states |= job.states
            if not fits:
                deferred.append(job)
                continue
            taken.append(job)
            size += len(job)
        self._queue.extendleft(reversed(deferred))  # they keep their place in line
        return taken

    def _due_back(self, now: float, until: float) -> tuple[set[int], float]:
        """The states not queued that are expected back before `until`, and when the
        last of them is late. Forgets the states that are late already."""
        self._forget_late(now)
        queued = {state for job in self._queue for state in job.states}
        awaited, last = set(), now
        for state, (at, round_trip) in self._answered.items():
            if round_trip is not None and at + round_trip <= until and state not in queued:
                awaited.add(state)
                last = max(last, _late(at, round_trip))
        return awaited, last

    def _forget_late(self, now: float) -> None:
        self._pruned_at = now
        late = [state for state, answered in self._answered.items() if now >= _late(*answered)]
        for state in late:
            del self._answered[state]

    async def _gather(self) -> None:
        """Waits for the states due back soon (see the module docstring)."""
        if sum(len(job) for job in self._queue) >= self.max_batch:
            return
        now = asyncio.get_running_loop().time()
        until = now + self.batch_wait
        awaited, last = self._due_back(now, until)
        if not awaited:
            return
        self._awaited = awaited  # enqueue() strikes them off as they come
        self._gathered.clear()
        try:
            await asyncio.wait_for(self._gathered.wait(), min(until, last) - now)
        except asyncio.TimeoutError:  # the builtin TimeoutError from Python 3.11 on
            pass
        finally:
            self._awaited = set()

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            if self.batch_wait > 0:
                await self._gather()
            batch = self._take()
            if not self._queue:
                self._wake.clear()
            if not batch:
                continue
            self._running = True
            try:
                await self._run(batch)
            finally:
                self._running = False

    async def _run(self, batch: list[_Job]) -> None:
        started = time.time_ns()
        live, result = await self._compute(lambda: self._forward(batch))
        self._answer(batch, live, result, started)

    def _forward(self, batch: list[_Job]) -> tuple[list[_Job], StepResult | BaseException | None]:
        """The batch's forward, on the thread that runs it: a job whose caller went away
        or whose deadline passed while the batch waited for that thread is left out, so
        that a failed call changes nothing. (future.done() read from the engine thread is
        a plain flag read; the loop alone ever sets it.)"""
        now = time.monotonic()  # the clock of loop.time()
        live = [
            job
            for job in batch
            if not job.future.done() and (job.deadline is None or now < job.deadline)
        ]
        if not live:
            return live, None
        try:
            return live, self.engine.step(Step.concat([job.step for job in live]))
        except Exception as exc:  # a bug in the forward: fail the batch, keep serving
            return live, exc

    def _answer(
        self,
        batch: list[_Job],
        live: list[_Job],
        result: StepResult | BaseException | None,
        started: int,
    ) -> None:
        """Settles every job of the batch (the live ones from `result`) and records it."""
        done = time.time_ns()
        requests = sum(len(job) for job in live)
        if live:
            self.batch_sizes[requests] += 1
            if self.on_batch is not None:
                drafted = int(result.counts.sum()) if isinstance(result, StepResult) else 0
                self.on_batch(
                    BatchRun(
                        requests=requests,
                        calls=len(live),
                        queued_ns=min(job.queued_ns for job in live),
                        started_ns=started,
                        done_ns=done,
                        drafts=drafted,
                        callers=[job.caller for job in live],
                    )
                )
        outcome, lo = {}, 0
        for job in live:
            rows = result if isinstance(result, BaseException) else result.rows(lo, lo + len(job))
            outcome[id(job)] = rows
            lo += len(job)
        for job in batch:
            if job.future.done():  # cancelled (left out, or during compute: its effect stands)
                continue
            result = outcome.get(id(job))
            if result is None:
                job.future.set_exception(_deadline_passed())
            elif isinstance(result, BaseException):
                job.future.set_exception(result)
            else:
                job.future.set_result(result)
                if self.batch_wait > 0 or self.inline:
                    self._remember_answered(job)

    async def _compute(self, compute: Callable[[], T]) -> T:
        """The batch's compute: on the loop's own thread when nobody else is due and the
        engine thread is idle (see the module docstring), else on the engine thread."""
        if self.inline and self._nobody_due():
            with self.runner.exclusive() as idle:
                if idle:
                    return compute()
        return await self.runner.call(compute)

    def _nobody_due(self) -> bool:
        """No state answered earlier is due back (the late ones forgotten)."""
        if self._answered:
            self._forget_late(asyncio.get_running_loop().time())
        return not self._answered

    def _remember_answered(self, job: _Job) -> None:
        now = asyncio.get_running_loop().time()
        self._answered.update(dict.fromkeys(job.states, (now, job.round_trip)))
        if now - self._pruned_at > _FORGET_S:  # the gathering wait prunes too, when it runs
            self._forget_late(now)
