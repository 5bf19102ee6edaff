"""The simulated verifiers of ``mtpdraft loadtest``, and what they measure.

A verifier plays a target engine that has no model: per sequence it allocates a
drafter state, prefills it with a random prompt (random tokens and hiddens),
then runs verify steps: it asks for K drafts, "verifies" them by drawing the
number accepted from the configured distribution, and sends that verdict with
the next step's request. After ``seq_len`` steps it frees the state and starts
a new sequence. Only the propose round trips are timed; allocation and
prefill are part of the load but not of the latency percentiles.

Steps are paced by a `Pacer`: closed loop (the next step starts when the last
one is answered, after an optional simulated verify time) or open loop
(Poisson arrivals shared by all verifiers of the process: an arrival is served
by whichever verifier is idle, so overload shows as queueing time). The
measured `Window` opens when the `WarmUp` ends, once every verifier is through
its first steps (its first prefill among them, however slow the machine): the
steps scheduled before are counted apart and left out of the figures.
`Pacer.end` ends a run early (the server went away, or Ctrl-C).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from ..async_client import AsyncDrafterClient
from ..errors import DeadlineExceeded, DrafterError
from ..stream import AsyncProposeStream
from ..types import Proposal, Verdict

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

MODES = ("stream", "unary", "split")
# After a failed call, wait a little before the next sequence so that a dead or
# refusing server is not hammered in a tight loop (and the error count stays
# meaningful).
ERROR_BACKOFF_S = 0.01
# Why a run ended early when the server refused a call because it is draining.
DRAINING = "the server is draining"
# Hidden rows generated once per process and sliced for every request: the
# client's own CPU time must stay small next to the round trip it measures.
HIDDEN_POOL_ROWS = 4096


@dataclass(frozen=True)
class Acceptance:
    """How many of a proposal's drafts the simulated target accepts.

    ``geometric:p``: each draft is accepted with probability p until the first
    rejection; ``fixed:n``: n (at most the drafts proposed); ``uniform``: 0..k
    drafts, each count equally likely.
    """

    kind: str
    value: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Acceptance:
        kind, _, value = text.strip().lower().partition(":")
        try:
            if kind == "uniform" and not value:
                return cls("uniform")
            if kind == "geometric":
                p = float(value)
                if 0.0 <= p <= 1.0:
                    return cls("geometric", p)
            elif kind == "fixed":
                n = int(value)
                if n >= 0:
                    return cls("fixed", n)
        except ValueError:
            pass
        raise ValueError(f"--accept {text!r}: use geometric:P (0<=P<=1), fixed:N (N>=0) or uniform")

    def draw(self, rng: random.Random, drafts: int) -> int:
        if self.kind == "fixed":
            return min(int(self.value), drafts)
        if self.kind == "uniform":
            return rng.randint(0, drafts)
        accepted = 0
        while accepted < drafts and rng.random() < self.value:
            accepted += 1
        return accepted

    def __str__(self) -> str:
        if self.kind == "uniform":
            return "uniform"
        value = int(self.value) if self.kind == "fixed" else self.value
        return f"{self.kind}:{value}"


@dataclass(frozen=True)
class IntRange:
    """An inclusive integer range drawn uniformly: ``128`` or ``64:512``."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str, name: str, minimum: int, maximum: int) -> IntRange:
        lo_text, sep, hi_text = text.partition(":")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if sep else lo
        except ValueError:
            raise ValueError(f"{name} {text!r}: use N or LO:HI") from None
        if not minimum <= lo <= hi <= maximum:
            raise ValueError(f"{name} {text!r}: need {minimum} <= LO <= HI <= {maximum}")
        return cls(lo, hi)

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"


def error_code(err: BaseException) -> str:
    """The gRPC status code name of a failed call (else the exception's type name)."""
    if isinstance(err, DrafterError):
        return err.code.name
    if isinstance(err, grpc.RpcError) and callable(getattr(err, "code", None)):
        return err.code().name
    return type(err).__name__


@dataclass
class Samples:
    """One process's raw measurements; `merge` adds another process's.

    Per successful measured step: ``sent`` (time.monotonic() when the step
    started; CLOCK_MONOTONIC is shared by all processes of the host), and three
    latencies in seconds: ``propose`` (the Propose round trip, from the send),
    ``step`` (the step's round trips: AfterVerify + Propose in split mode, else =
    propose) and ``waited`` (from the step's scheduled arrival to its answer:
    open loop queueing included, so coordinated omission is corrected; closed
    loop = step); and ``drafts_per_step``. Steps scheduled before the measured
    window opened (``warmup_until``, set at the end) only count in ``warmup_steps``;
    errors count all along (``error_times``: when each happened).
    """

    sent: array = field(default_factory=lambda: array("d"))
    propose: array = field(default_factory=lambda: array("f"))
    step: array = field(default_factory=lambda: array("f"))
    waited: array = field(default_factory=lambda: array("f"))
    drafts_per_step: array = field(default_factory=lambda: array("H"))
    error_times: array = field(default_factory=lambda: array("d"))
    drafts: int = 0
    accepted: int = 0
    verdicts: int = 0
    sequences: int = 0
    errors: Counter = field(default_factory=Counter)  # status code name -> count
    errors_by_rpc: Counter = field(default_factory=Counter)  # "Rpc CODE" -> count
    arrivals_dropped: int = 0  # open loop: arrivals refused because the backlog was full
    arrivals_unserved: int = 0  # open loop: arrivals still queued when the time was up
    cut_short: str | None = None  # why the verifiers ended the run early, if they did
    warmup_until: float = -math.inf
    warmup_steps: int = 0
    started: float = math.inf
    finished: float = -math.inf

    def record(
        self,
        *,
        scheduled: float,
        started: float,
        sent: float,
        done: float,
        drafts: int,
        accepted: int,
        verdict: bool,
        first: bool,
        measured: bool = True,
    ) -> None:
        """One answered step: its scheduled arrival, start, Propose send and answer times;
        ``measured`` False for a warm-up step."""
        if not measured:
            self.warmup_steps += 1
            return
        self.sent.append(started)
        self.drafts_per_step.append(drafts)
        self.propose.append(done - sent)
        self.step.append(done - started)
        self.waited.append(done - min(scheduled, started))
        self.drafts += drafts
        self.accepted += accepted
        self.verdicts += verdict
        self.sequences += first  # sequences that ran at least one measured step
        self.started = min(self.started, started)
        self.finished = max(self.finished, done)

    def error(self, rpc: str, err: BaseException) -> None:
        code = error_code(err)
        self.errors[code] += 1
        self.errors_by_rpc[f"{rpc} {code}"] += 1
        self.error_times.append(time.monotonic())

    def merge(self, other: Samples) -> None:
        for name in ("sent", "propose", "step", "waited", "drafts_per_step", "error_times"):
            getattr(self, name).extend(getattr(other, name))
        for name in ("drafts", "accepted", "verdicts", "sequences"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.arrivals_dropped += other.arrivals_dropped
        self.arrivals_unserved += other.arrivals_unserved
        self.warmup_steps += other.warmup_steps
        self.warmup_until = max(self.warmup_until, other.warmup_until)
        self.cut_short = self.cut_short or other.cut_short
        self.errors.update(other.errors)
        self.errors_by_rpc.update(other.errors_by_rpc)
        self.started = min(self.started, other.started)
        self.finished = max(self.finished, other.finished)


class Window:
    """The measured run: it opens when the warm-up ends (a time.monotonic(); inf until
    then) and closes ``seconds`` later. ``shared``: a multiprocessing Value("d") through
    which the processes of a ``--processes`` run open one window together."""

    def __init__(self, seconds: float, shared: Any = None) -> None:
        self.seconds = seconds
        self._shared = shared
        self._opens = math.inf

    @property
    def opens(self) -> float:
        return self._opens if self._shared is None else self._shared.value

    @property
    def closes(self) -> float:
        return self.opens + self.seconds

    def open(self, at: float) -> None:
        """Opens it at ``at``, unless it opened earlier."""
        if self._shared is None:
            self._opens = min(self._opens, at)
            return
        with self._shared.get_lock():
            self._shared.value = min(self._shared.value, at)


class WarmUp:
    """Each verifier's first ``steps`` verify steps, answered or failed (a failed sequence
    counts as one): ``ended`` is called once every verifier is through them."""

    def __init__(self, verifiers: int, steps: int, ended: Callable[[], None]) -> None:
        self.steps = steps
        self.verifiers = verifiers
        self.through = 0  # verifiers through their warm-up
        self._ended = ended

    def verifier_through(self) -> None:
        self.through += 1
        if self.through == self.verifiers:
            self._ended()


class Pacer:
    """When each verify step may start; None once the run is over.

    Closed loop: now, after ``verify_s`` of simulated target work between the
    steps of a sequence, until the window closes or until ``requests`` tickets are
    taken. Open loop: Poisson arrivals at ``rate`` per second for the whole
    process, handed to idle verifiers in order; the step's scheduled time is
    returned so that queueing behind busy verifiers counts in its latency.
    Steps scheduled before the window opens take no ticket of ``requests``.
    """

    def __init__(
        self,
        *,
        window: Window,
        requests: int | None,
        rate: float | None,
        verify_s: float,
        verifiers: int,
        samples: Samples,
        seed: int,
    ) -> None:
        self.window = window
        self.remaining = requests
        self.rate = rate
        self.verify_s = verify_s
        self.verifiers = verifiers
        self.samples = samples
        self._ended = math.inf  # when `end` ended the run
        self._rng = random.Random(seed)
        self._arrivals: asyncio.Queue[float | None] = asyncio.Queue()
        # A bounded backlog keeps memory bounded when the server cannot keep up;
        # refused arrivals are reported, not hidden.
        self._max_backlog = max(1000, 16 * verifiers)
        self._generator: asyncio.Task | None = None

    @property
    def deadline(self) -> float:
        """No step starts from then on: the window's close (inf during the warm-up)."""
        return min(self.window.closes, self._ended)

    def measures(self, scheduled: float) -> bool:
        """Whether a step scheduled then is measured (else it is the warm-up's)."""
        return scheduled >= self.window.opens

    def start(self) -> None:
        if self.rate is not None:
            self._generator = asyncio.create_task(self._generate())

    def end(self) -> None:
        """Ends the run now: no step starts after this; queued arrivals go unserved."""
        self._ended = min(self._ended, time.monotonic())
        if self._generator is not None:
            self._generator.cancel()  # its finally wakes the waiting verifiers

    async def stop(self) -> None:
        if self._generator is not None:
            self._generator.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._generator

    async def _generate(self) -> None:
        assert self.rate is not None
        next_at = time.monotonic()
        try:
            while self.remaining is None or self.remaining > 0:
                next_at += self._rng.expovariate(self.rate)
                if next_at >= self.deadline:
                    break
                delay = next_at - time.monotonic()
                if delay > 0:  # late arrivals go out at once, keeping their scheduled time
                    await asyncio.sleep(delay)
                if self.remaining is not None and self.measures(next_at):
                    self.remaining -= 1
                if self._arrivals.qsize() >= self._max_backlog:
                    self.samples.arrivals_dropped += 1
                else:
                    self._arrivals.put_nowait(next_at)
        finally:
            for _ in range(self.verifiers):  # wakes every verifier waiting for work
                self._arrivals.put_nowait(None)

    def over(self) -> bool:
        """True once no more steps will be handed out (checked between sequences)."""
        if time.monotonic() >= self.deadline:
            return True
        if self.rate is None:
            return self.remaining is not None and self.remaining <= 0
        return self._generator is not None and self._generator.done() and self._arrivals.empty()

    async def next_step(self, first_in_sequence: bool) -> float | None:
        if self.rate is None:
            if self.verify_s > 0 and not first_in_sequence:
                await asyncio.sleep(self.verify_s)
            now = time.monotonic()
            if now >= self.deadline:
                return None
            if self.remaining is not None and self.measures(now):
                if self.remaining <= 0:
                    return None
                self.remaining -= 1
            return now
        scheduled = await self._arrivals.get()
        if scheduled is not None and time.monotonic() >= self.deadline:
            # The time is up: what is still queued is counted, not served, so
            # that an overloaded run ends on time.
            self.samples.arrivals_unserved += 1
            while scheduled is not None:
                try:
                    scheduled = self._arrivals.get_nowait()
                except asyncio.QueueEmpty:
                    break
                self.samples.arrivals_unserved += scheduled is not None
            scheduled = None
        if scheduled is None:
            self._arrivals.put_nowait(None)  # leaves the stop mark for the other verifiers
        return scheduled


class HiddenPool:
    """Random target hiddens, generated once and sliced: numpy fp32 or torch bf16."""

    def __init__(self, hidden_size: int, rows: int, dtype: str, seed: int) -> None:
        self.rows = max(rows, 64)
        if dtype == "bf16":
            import torch

            gen = torch.Generator().manual_seed(seed)
            self.data: Any = torch.randn(self.rows, hidden_size, generator=gen).to(torch.bfloat16)
        else:
            rng = np.random.default_rng(seed)
            self.data = rng.standard_normal((self.rows, hidden_size), dtype=np.float32)

    def block(self, rng: random.Random, n: int) -> Any:
        """n rows, [n, hidden]: a slice of the pool (copied by tiling when n is larger)."""
        if n <= self.rows:
            start = rng.randint(0, self.rows - n)
            return self.data[start : start + n]
        reps = -(-n // self.rows)
        if isinstance(self.data, np.ndarray):
            return np.tile(self.data, (reps, 1))[:n]
        return self.data.repeat(reps, 1)[:n]

    def row(self, rng: random.Random) -> Any:
        return self.data[rng.randrange(self.rows)]


@dataclass
class VerifierSettings:
    """What every verifier of a process does (the run's configuration, resolved)."""

    mode: str
    num_drafts: int
    seq_len: int
    prompt_len: IntRange
    accept: Acceptance
    refeed: bool
    vocab_size: int
    timeout: float
    seed: int


class Verifier:
    """One simulated verifier: sequences of verify steps on one state at a time."""

    def __init__(
        self,
        index: int,
        client: AsyncDrafterClient,
        settings: VerifierSettings,
        pacer: Pacer,
        hiddens: HiddenPool,
        samples: Samples,
        tracer: Tracer | None,
        warmup: WarmUp | None = None,
    ) -> None:
        self.index = index
        self.client = client
        self.s = settings
        self.pacer = pacer
        self.hiddens = hiddens
        self.samples = samples
        self.tracer = tracer
        self.warmup = warmup
        self.attempts = 0  # steps answered and sequences failed, for the warm-up
        self.rng = random.Random(settings.seed * 1_000_003 + index)
        self._stream: AsyncProposeStream | None = None
        self._done = False

    def _attempted(self) -> None:
        self.attempts += 1
        if self.warmup is not None and self.attempts == self.warmup.steps:
            self.warmup.verifier_through()

    def _span(self, name: str, **attributes: Any) -> contextlib.AbstractContextManager:
        if self.tracer is None:
            return contextlib.nullcontext()
        attributes["mtpdraft.loadtest.verifier"] = self.index
        attributes["mtpdraft.loadtest.mode"] = self.s.mode
        return self.tracer.start_as_current_span(name, attributes=attributes)

    async def run(self) -> None:
        try:
            while not self._done and not self.pacer.over():
                if self.s.mode == "stream" and self._stream is None:
                    # Opened outside any sequence's span: the stream outlives
                    # sequences, and gRPC traces a stream as one call.
                    self._stream = self.client.stream(timeout=None)
                try:
                    await self._sequence()
                except (DrafterError, grpc.RpcError):
                    # Counted where it was raised. The stream that carried it is
                    # replaced, since a broken stream fails every later message.
                    self._attempted()
                    await self._close_stream()
                    await asyncio.sleep(ERROR_BACKOFF_S)
        finally:
            await self._close_stream()

    async def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            # A stream the server dropped fails its close with grpc's internal
            # errors (ExecuteBatchError): its failure was counted when it broke.
            with contextlib.suppress(Exception):
                await stream.close()

    async def _call(self, rpc: str, coro: Any) -> Any:
        try:
            return await coro
        except (DrafterError, grpc.RpcError) as err:
            self.samples.error(rpc, err)
            if isinstance(err, DrafterError) and err.reason == "DRAINING":
                # The server is going away: end here rather than count its refusals.
                self.samples.cut_short = self.samples.cut_short or DRAINING
                self.pacer.end()
            raise

    async def _sequence(self) -> None:
        n = self.s.prompt_len.draw(self.rng)
        with self._span("loadtest.sequence", **{"mtpdraft.loadtest.prompt_len": n}):
            state = await self._call("AllocState", self.client.alloc_state())
            try:
                await self._steps(state, n)
            finally:
                # Shielded: a cancelled run still frees its state (nothing leaks
                # until the lease would reclaim it).
                with contextlib.suppress(DrafterError, grpc.RpcError):
                    await asyncio.shield(self._call("FreeState", self.client.free_state(state)))

    async def _steps(self, state: int, n: int) -> None:
        s, rng = self.s, self.rng
        if n > 1:  # rows x1..x(n-1) with hiddens h0..h(n-2), from position 1
            tokens = [rng.randrange(s.vocab_size) for _ in range(n - 1)]
            prefill = self.client.prefill(state, tokens, self.hiddens.block(rng, n - 1), 1)
            await self._call("Prefill", prefill)
        position, verdict = n, None
        for step in range(s.seq_len):
            scheduled = await self.pacer.next_step(first_in_sequence=step == 0)
            if scheduled is None:
                self._done = True
                return
            with self._span("loadtest.step", **{"mtpdraft.loadtest.position": position}) as span:
                proposal, started, sent, done = await self._step(state, position, verdict)
                accepted = s.accept.draw(rng, len(proposal.tokens))
                if span is not None:
                    span.set_attribute("mtpdraft.loadtest.drafts", len(proposal.tokens))
                    span.set_attribute("mtpdraft.loadtest.accepted", accepted)
            self.samples.record(
                scheduled=scheduled,
                started=started,
                sent=sent,
                done=done,
                drafts=len(proposal.tokens),
                accepted=accepted,
                verdict=verdict is not None,
                first=step == 0,
                measured=self.pacer.measures(scheduled),
            )
            self._attempted()
            refeed = self.hiddens.block(rng, accepted) if s.refeed and accepted else None
            verdict = Verdict(accepted, refeed_hiddens=refeed)
            position += accepted + 1  # the bonus token's position

    async def _step(
        self, state: int, position: int, verdict: Verdict | None
    ) -> tuple[Proposal, float, float, float]:
        """One step's round trips: its proposal, and when it started, sent Propose, was answered."""
        s = self.s
        token, hidden = self.rng.randrange(s.vocab_size), self.hiddens.row(self.rng)
        started = time.monotonic()
        if s.mode == "split" and verdict is not None:
            verify = self.client.after_verify(
                state, verdict.num_accepted, refeed_hiddens=verdict.refeed_hiddens
            )
            await self._call("AfterVerify", verify)
            verdict = None
        sent = time.monotonic()
        if self._stream is not None:
            # A stream message has no deadline of its own: the verifier bounds
            # its wait as a unary call's deadline would.
            call = self._stream_propose(state, token, hidden, position, verdict)
        else:
            call = self.client.propose(
                state, token, hidden, position, s.num_drafts, previous=verdict
            )
        proposal: Proposal = await self._call("Propose", call)
        return proposal, started, sent, time.monotonic()

    async def _stream_propose(
        self, state: int, token: int, hidden: Any, position: int, verdict: Verdict | None
    ) -> Proposal:
        assert self._stream is not None
        answer = self._stream.propose(
            state, token, hidden, position, self.s.num_drafts, previous=verdict
        )
        try:
            return await asyncio.wait_for(answer, self.s.timeout)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no answer on the stream within {self.s.timeout:g} s",
            ) from None
