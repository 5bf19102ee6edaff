"""A load test's run: its configuration, its verifiers in one process or several, the
server watched all along, its report; and the ``loadtest`` command's parser."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import math
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import traceback
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from ..async_client import AsyncDrafterClient
from ..command_line import (
    OptionError,
    Security,
    add_security_options,
    add_target_option,
    check_target,
    security_from_args,
)
from ..errors import DrafterError
from ..security import open_channel
from ..tracing import exporting_provider
from ..types import ServerInfo
from .report import build_report, summary, write_json, write_plot
from .verifier import (
    DRAINING,
    HIDDEN_POOL_ROWS,
    MODES,
    Acceptance,
    HiddenPool,
    IntRange,
    Pacer,
    Samples,
    Verifier,
    VerifierSettings,
    WarmUp,
    Window,
)

# The bounds of a run, which --max-duration and --max-verifiers raise.
DEFAULT_MAX_DURATION_S = 600.0
DEFAULT_MAX_VERIFIERS = 1024
MAX_PROCESSES = 64
MAX_PROMPT_LEN = 131_072
DEFAULT_DURATION_S = 10.0
# Steps per verifier before the measured window: past its first prefill, the first
# batches of each size and lazy allocations, short next to a run.
DEFAULT_WARMUP_STEPS = 8
DEFAULT_TARGET = "127.0.0.1:50051"
# GetInfo failing this long means the server is gone: the run ends instead of
# counting a refused connection every ERROR_BACKOFF_S per verifier.
LOST_AFTER_S = 1.0
PROGRESS_S = 1.0
# Exit statuses of the command (see add_loadtest_parser's epilog).
EXIT_CUT_SHORT = 3
EXIT_INTERRUPTED = 130
INTERRUPTED = "interrupted (Ctrl-C)"
# Time the worker processes get to start (spawn imports numpy and grpc) and to
# hand back their samples after the run.
PROCESS_START_TIMEOUT_S = 120.0
PROCESS_RESULT_GRACE_S = 120.0


class LoadTestError(Exception):
    """A configuration the load test refuses, or a server it cannot use."""


@dataclass
class LoadTestConfig:
    """One load test. ``duration`` None: 10 s, or up to ``max_duration`` when ``requests``
    is set; it and ``requests`` count after the warm-up (``warmup_steps`` per verifier)."""

    target: str = DEFAULT_TARGET
    security: Security = field(default_factory=Security)
    mode: str = "stream"
    verifiers: int = 4
    rate: float | None = None
    duration: float | None = None
    requests: int | None = None
    warmup_steps: int = DEFAULT_WARMUP_STEPS
    accept: Acceptance = field(default_factory=lambda: Acceptance("geometric", 0.7))
    prompt_len: IntRange = field(default_factory=lambda: IntRange(128, 128))
    num_drafts: int = 4
    seq_len: int = 64
    refeed: bool = False
    dtype: str = "fp32"
    verify_ms: float = 0.0
    processes: int = 1
    seed: int = 0
    timeout: float = 30.0
    info_interval: float = 0.25
    max_duration: float = DEFAULT_MAX_DURATION_S
    max_verifiers: int = DEFAULT_MAX_VERIFIERS

    @property
    def run_seconds(self) -> float:
        if self.duration is not None:
            return self.duration
        return self.max_duration if self.requests is not None else DEFAULT_DURATION_S

    def validate(self) -> None:
        try:
            check_target(self.target)
        except OptionError as err:
            raise LoadTestError(str(err)) from None
        checks = [
            (self.mode in MODES, f"--mode {self.mode!r}: use one of {', '.join(MODES)}"),
            (
                1 <= self.verifiers <= self.max_verifiers,
                f"--verifiers {self.verifiers}: 1 to {self.max_verifiers} "
                "(--max-verifiers raises the bound)",
            ),
            (
                0 < self.run_seconds <= self.max_duration,
                f"--duration {self.run_seconds:g}: more than 0 and at most "
                f"{self.max_duration:g} s (--max-duration raises the bound)",
            ),
            (self.requests is None or self.requests >= 1, "--requests: at least 1"),
            (self.warmup_steps >= 0, f"--warmup-steps {self.warmup_steps}: 0 or more"),
            (self.rate is None or self.rate > 0, "--rate: more than 0 steps/s"),
            (self.num_drafts >= 1, "--num-drafts: at least 1"),
            (self.seq_len >= 1, "--seq-len: at least 1 step"),
            (self.verify_ms >= 0, "--verify-ms: 0 or more"),
            (self.timeout > 0, "--timeout: more than 0"),
            (
                1 <= self.processes <= min(MAX_PROCESSES, self.verifiers),
                f"--processes {self.processes}: 1 to min({MAX_PROCESSES}, --verifiers)",
            ),
            (self.dtype in ("fp32", "bf16"), f"--dtype {self.dtype!r}: fp32 or bf16"),
        ]
        for ok, message in checks:
            if not ok:
                raise LoadTestError(message)
        if self.dtype == "bf16" and importlib.util.find_spec("torch") is None:
            raise LoadTestError("--dtype bf16 needs torch; install it or use --dtype fp32")

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["security"] = self.security.describe()  # never a key or the token
        out["accept"], out["prompt_len"] = str(self.accept), str(self.prompt_len)
        out["duration"] = self.run_seconds
        return out

    def client(self, channel: grpc.aio.Channel | None = None) -> AsyncDrafterClient:
        """A client of the target (or of ``channel``, already secured)."""
        if channel is not None:
            return AsyncDrafterClient(channel=channel, timeout=self.timeout)
        return AsyncDrafterClient(
            self.target, timeout=self.timeout, **self.security.client_keywords()
        )

    def share(self, index: int) -> LoadTestConfig:
        """This process's part of a ``--processes`` run: verifiers, rate and requests split."""
        n = self.processes
        verifiers = self.verifiers // n + (index < self.verifiers % n)
        fraction = verifiers / self.verifiers
        requests = None
        if self.requests is not None:
            requests = self.requests // n + (index < self.requests % n)
        return dataclasses.replace(
            self,
            verifiers=verifiers,
            rate=None if self.rate is None else self.rate * fraction,
            requests=requests,
            processes=1,
            seed=self.seed * 7919 + index,
        )


@dataclass
class LoadTestResult:
    report: dict[str, Any]
    samples: Samples


def _check_server(config: LoadTestConfig, info: ServerInfo) -> list[str]:
    """Refuses what cannot work; warns about what will produce errors."""
    if config.num_drafts > info.max_drafts:
        raise LoadTestError(
            f"--num-drafts {config.num_drafts}: the server allows {info.max_drafts}"
        )
    wire = {"fp32": "float32", "bf16": "bfloat16"}[config.dtype]
    if info.hidden_dtypes and wire not in info.hidden_dtypes:
        raise LoadTestError(f"--dtype {config.dtype}: the server accepts {info.hidden_dtypes}")
    warnings = []
    if info.draining:
        warnings.append("the server is draining: new states are refused")
    if config.verifiers + info.live_states > info.max_states:
        warnings.append(
            f"{config.verifiers} verifiers but {info.max_states - info.live_states} free state "
            "slots: expect RESOURCE_EXHAUSTED"
        )
    rows = config.prompt_len.hi + config.seq_len * (config.num_drafts + 1)
    blocks = -(-rows // max(info.kv_block_size, 1)) * config.verifiers
    if blocks > info.kv_blocks_free:
        warnings.append(
            f"up to {blocks} KV blocks needed, {info.kv_blocks_free} free: "
            "expect RESOURCE_EXHAUSTED"
        )
    if config.verifiers > info.max_batch:
        warnings.append(
            f"{config.verifiers} verifiers but batches of at most {info.max_batch}: "
            "calls will queue"
        )
    return warnings


def _env_tracer_provider() -> Any:
    """A TracerProvider from the OTEL_* variables, or None (tracing then costs nothing)."""
    return exporting_provider("mtpdraft")


def _traced_channel(config: LoadTestConfig, tracer_provider: Any) -> grpc.aio.Channel:
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    interceptors = aio_client_interceptors(tracer_provider=tracer_provider)
    keywords = config.security.client_keywords()
    options = keywords.pop("options")
    return open_channel(grpc.aio, config.target, options, interceptors, **keywords)


@dataclass
class _Signals:
    """What a process's verifiers share with the run's coordinator."""

    window: Window  # the measured run, opened when every verifier is warm
    begin: Callable[[], Awaitable[float]]  # waits for the start, returns it (time.monotonic())
    stop: Any  # an Event (threading or multiprocessing): set, the run ends now


async def _drive(
    config: LoadTestConfig,
    info: ServerInfo,
    tracer_provider: Any,
    samples: Samples,
    warmup: WarmUp,
    signals: _Signals,
) -> None:
    """Runs this process's verifiers to the end, or until ``signals.stop`` is set.

    Connected, it waits for ``signals.begin``; the window opens then when there is no
    warm-up, else once ``warmup`` has ended (its ``ended`` opens it or has it opened)."""
    channel = None
    if tracer_provider is not None:
        channel = _traced_channel(config, tracer_provider)
    tracer = tracer_provider.get_tracer("mtpdraft.loadtest") if tracer_provider else None
    rows = min(config.prompt_len.hi, HIDDEN_POOL_ROWS) + config.num_drafts
    hiddens = HiddenPool(info.hidden_size, rows, config.dtype, config.seed)
    settings = VerifierSettings(
        mode=config.mode,
        num_drafts=config.num_drafts,
        seq_len=config.seq_len,
        prompt_len=config.prompt_len,
        accept=config.accept,
        refeed=config.refeed,
        vocab_size=info.vocab_size,
        timeout=config.timeout,
        seed=config.seed,
    )
    client = config.client(channel)
    try:
        # Connected before the clock starts (no RPC: no stray span in the traces).
        await asyncio.wait_for(client.channel.channel_ready(), config.timeout)
        started = await signals.begin()
        if warmup.steps == 0:
            signals.window.open(started)
        pacer = Pacer(
            window=signals.window,
            requests=config.requests,
            rate=config.rate,
            verify_s=config.verify_ms / 1e3,
            verifiers=config.verifiers,
            samples=samples,
            seed=config.seed,
        )
        # Each verifier its own affinity key: through a proxy in front of replicas
        # (deploy/), its calls reach one replica and the verifiers spread over them all.
        verifiers = [
            Verifier(
                i, client.keyed(f"loadtest-{os.getpid()}-{i}"), settings, pacer, hiddens,
                samples, tracer, warmup,
            )
            for i in range(config.verifiers)
        ]  # fmt: skip
        pacer.start()
        ender = asyncio.create_task(_end_when_set(signals.stop, pacer))
        try:
            await asyncio.gather(*(v.run() for v in verifiers))
        finally:
            ender.cancel()
            await pacer.stop()
    finally:
        samples.warmup_until = signals.window.opens
        await client.close()
        if channel is not None:
            await channel.close()


async def _end_when_set(stop: Any, pacer: Pacer) -> None:
    # Polled: ``stop`` may be a multiprocessing Event, which has no awaitable wait.
    while not stop.is_set():
        await asyncio.sleep(0.05)
    pacer.end()


@dataclass
class Tally:
    """One process's progress, for the live line: totals, its verifiers through their
    warm-up, and the Propose round trips (seconds) since its last tally."""

    steps: int
    drafts: int
    errors: int
    warmup_steps: int
    warm: int
    recent: array


class _Tallier:
    def __init__(self, samples: Samples, warmup: WarmUp) -> None:
        self.samples, self.warmup, self.seen = samples, warmup, 0

    def take(self) -> Tally:
        s = self.samples
        recent, self.seen = s.propose[self.seen :], len(s.propose)
        errors = sum(s.errors.values())
        return Tally(len(s.sent), s.drafts, errors, s.warmup_steps, self.warmup.through, recent)


class Progress:
    """The live progress line, from every process's latest tally."""

    def __init__(self, config: LoadTestConfig, window: Window) -> None:
        self.verifiers, self.warmup_steps = config.verifiers, config.warmup_steps
        self.window = window
        self.begun = False  # set when the run begins
        self.tallies: dict[int, Tally] = {}
        self.recent = array("f")
        self._last_time, self._last_drafts = 0.0, 0

    def add(self, source: int, tally: Tally) -> None:
        self.tallies[source] = tally
        self.recent.extend(tally.recent)

    def line(self, now: float) -> str | None:
        if not self.begun:
            return None

        def total(name: str) -> int:
            return sum(getattr(t, name) for t in self.tallies.values())

        errors, opened = total("errors"), self.window.opens
        if now < opened:
            return (
                f"mtpdraft loadtest: warm-up: {total('warmup_steps')} steps, {total('warm')} of "
                f"{self.verifiers} verifiers through their {self.warmup_steps}, errors {errors}"
            )
        drafts, since = total("drafts"), max(self._last_time, opened)
        rate = (drafts - self._last_drafts) / (now - since) if now > since else 0.0
        p50 = f"{np.median(self.recent) * 1e3:.3f} ms" if len(self.recent) else "-"
        self._last_time, self._last_drafts, self.recent = now, drafts, array("f")
        return (
            f"mtpdraft loadtest: {now - opened:5.1f} s: steps {total('steps')}, "
            f"drafts/s {rate:.0f}, p50 {p50}, errors {errors}"
        )


def _worker(
    index: int,
    config: LoadTestConfig,
    info: ServerInfo,
    start: Any,
    stop: Any,
    opens: Any,
    results: Any,
) -> None:
    """A ``--processes`` worker: runs its share once all are connected, sends tallies
    while it runs, "warm" when its verifiers are through their warm-up, and its samples
    at the end. ``opens``: the run's shared Window value."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the coordinator's (via ``stop``)
    try:
        tracer_provider = _env_tracer_provider()
        samples = Samples()
        warmup = WarmUp(
            config.verifiers, config.warmup_steps, lambda: results.put(("warm", index, None))
        )

        async def work() -> None:
            async def begin() -> float:
                await asyncio.to_thread(start.wait, PROCESS_START_TIMEOUT_S)
                return time.monotonic()

            async def send_tallies() -> None:
                tallier = _Tallier(samples, warmup)
                while True:
                    await asyncio.sleep(PROGRESS_S / 2)
                    results.put(("tally", index, tallier.take()))

            sender = asyncio.create_task(send_tallies())
            signals = _Signals(Window(config.run_seconds, opens), begin, stop)
            try:
                await _drive(config, info, tracer_provider, samples, warmup, signals)
            finally:
                sender.cancel()

        try:
            asyncio.run(work())
        finally:
            if tracer_provider is not None:
                tracer_provider.shutdown()
        results.put(("samples", index, samples))
    except BaseException:
        results.put(("failed", index, traceback.format_exc()))
        raise


async def _run_processes(config: LoadTestConfig, info: ServerInfo, run: _Run) -> Samples:
    ctx = multiprocessing.get_context("spawn")  # no fork of a process holding gRPC threads
    start, results = ctx.Barrier(config.processes + 1), ctx.Queue()
    workers = [
        ctx.Process(
            target=_worker,
            args=(i, config.share(i), info, start, run.stop_event, run.opens, results),
            daemon=True,
        )
        for i in range(config.processes)
    ]
    for w in workers:
        w.start()
    try:
        try:
            await asyncio.to_thread(start.wait, PROCESS_START_TIMEOUT_S)
        except threading.BrokenBarrierError:
            try:
                failure = results.get(True, 5)[2]
            except queue.Empty:
                failure = "(no traceback)"
            raise LoadTestError(f"a load test process did not start:\n{failure}") from None
        await run.begin()
        samples, pending, warm = Samples(), set(range(config.processes)), set()
        while pending:
            try:
                kind, index, got = await asyncio.to_thread(results.get, True, 0.2)
            except queue.Empty:
                if time.monotonic() > run.window.closes + PROCESS_RESULT_GRACE_S:
                    raise LoadTestError("a load test process did not finish") from None
                continue
            if kind == "failed":
                raise LoadTestError(f"a load test process failed:\n{got}")
            if kind == "tally":
                run.progress.add(index, got)
            elif kind == "warm":
                warm.add(index)
                if len(warm) == config.processes:  # every verifier of every process
                    run.warmed_up()
            else:
                samples.merge(got)
                pending.discard(index)
        return samples
    finally:
        for w in workers:
            w.join(5)
            if w.is_alive():
                w.terminate()


class _Run:
    """One run's coordination: the end signal, the measured window, the monitor of the
    server (GetInfo: queue depth, its state at the warm-up's end and last seen, draining
    or gone) and progress."""

    def __init__(self, config: LoadTestConfig, client: AsyncDrafterClient) -> None:
        self.config, self.client = config, client
        spawn = None if config.processes == 1 else multiprocessing.get_context("spawn")
        self.stop_event: Any = threading.Event() if spawn is None else spawn.Event()
        # Shared with the --processes workers: each opens it, or sees it opened.
        self.opens = None if spawn is None else spawn.Value("d", math.inf)
        self.window = Window(config.run_seconds, self.opens)
        self.cut_short: str | None = None
        self.depth: list[tuple[float, int]] = []
        self.began: float | None = None
        self.baseline: ServerInfo | None = None  # GetInfo at the warm-up's end
        self.last: ServerInfo | None = None  # the last GetInfo answered
        self.progress = Progress(config, self.window)
        self._tasks: list[asyncio.Task] = []

    def stop(self, reason: str) -> None:
        """Ends the run early (the first reason given is the one reported)."""
        if self.cut_short is None:
            self.cut_short = reason
            self.stop_event.set()

    def signals(self) -> _Signals:
        """The single-process run's signals."""
        return _Signals(self.window, self.begin, self.stop_event)

    async def begin(self) -> float:
        self.began = time.monotonic()
        self.progress.begun = True
        return self.began

    def warmed_up(self) -> None:
        """Every verifier is through its warm-up: the window opens now."""
        self.window.open(time.monotonic())
        self._tasks.append(asyncio.create_task(self._take_baseline()))

    @property
    def warmup_seconds(self) -> float | None:
        """How long the warm-up took (None if the window never opened)."""
        if self.config.warmup_steps == 0:
            return 0.0
        if self.began is None or math.isinf(self.window.opens):
            return None
        return max(0.0, self.window.opens - self.began)

    async def _take_baseline(self) -> None:
        with contextlib.suppress(DrafterError):
            self.baseline = await self.client.info()

    async def _monitor(self) -> None:
        answered = time.monotonic()
        while True:
            try:
                info = await self.client.info()
            except DrafterError as err:
                if time.monotonic() - answered >= LOST_AFTER_S:
                    self.stop(f"the server stopped answering ({err.code.name})")
            else:
                answered = time.monotonic()
                self.last = info
                self.depth.append((answered, info.queued_calls))
                if info.draining:
                    self.stop(DRAINING)
            await asyncio.sleep(self.config.info_interval)

    async def _print_progress(self, write: Callable[[str], None], pull: _Tallier | None) -> None:
        while True:
            await asyncio.sleep(PROGRESS_S)
            if pull is not None:
                self.progress.add(0, pull.take())
            line = self.progress.line(time.monotonic())
            if line is not None:
                write(line)

    @contextlib.asynccontextmanager
    async def watching(
        self, write: Callable[[str], None] | None, pull: _Tallier | None
    ) -> AsyncIterator[None]:
        """The monitor, the progress lines (from ``pull`` when the verifiers run in this
        process) and Ctrl-C's handler, for the time of the run."""
        self._tasks.append(asyncio.create_task(self._monitor()))
        if write is not None:
            self._tasks.append(asyncio.create_task(self._print_progress(write, pull)))
        restore = self._catch_sigint()
        try:
            yield
        finally:
            restore()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _catch_sigint(self) -> Callable[[], None]:
        """The first Ctrl-C ends the run as a lost server would; a second interrupts."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        loop, previous = asyncio.get_running_loop(), signal.getsignal(signal.SIGINT)

        def first() -> None:
            self.stop(INTERRUPTED)
            loop.remove_signal_handler(signal.SIGINT)
            signal.signal(signal.SIGINT, signal.default_int_handler)

        loop.add_signal_handler(signal.SIGINT, first)

        def restore() -> None:
            loop.remove_signal_handler(signal.SIGINT)
            signal.signal(signal.SIGINT, previous)

        return restore


async def run_load_async(
    config: LoadTestConfig,
    *,
    tracer_provider: Any = None,
    progress: Callable[[str], None] | None = None,
) -> LoadTestResult:
    """Runs one load test. ``tracer_provider``: use this provider (not the env's) and leave
    it open; single-process runs only (``--processes`` workers build theirs from the env).
    ``progress``: called with a line of progress about every second.

    Raises LoadTestError for a configuration or server it refuses, and DrafterError
    when the server cannot be reached at the start; errors during the run are counted,
    and a server that drains or stops answering ends it early (``report["cut_short"]``).
    """
    config.validate()
    owned = None
    if tracer_provider is None and config.processes == 1:
        tracer_provider = owned = _env_tracer_provider()
    # GetInfo travels on its own, untraced channel: the monitor's calls are not load.
    info_client = config.client()
    run = _Run(config, info_client)
    try:
        before = await info_client.info()
        warnings = _check_server(config, before)
        if config.processes == 1:
            samples = Samples()
            warmup = WarmUp(config.verifiers, config.warmup_steps, run.warmed_up)
            async with run.watching(progress, _Tallier(samples, warmup)):
                await _drive(config, before, tracer_provider, samples, warmup, run.signals())
        else:
            async with run.watching(progress, None):
                samples = await _run_processes(config, before, run)
        try:
            after, answered = await info_client.info(), True
        except DrafterError:
            # Gone: the batches are counted up to the last GetInfo it answered.
            after, answered = run.last or before, False
    finally:
        await info_client.close()
        if owned is not None:
            owned.shutdown()  # flushes the spans
        elif tracer_provider is not None:
            tracer_provider.force_flush()
    report = build_report(
        config.as_dict(),
        run.baseline or before,
        after,
        samples,
        run.depth,
        warnings,
        # A refusal for draining explains more than the silence that may follow it.
        cut_short=samples.cut_short or run.cut_short,
        answered_after=answered,
        warmup_seconds=run.warmup_seconds,
    )
    return LoadTestResult(report, samples)


def run_load(
    config: LoadTestConfig,
    *,
    tracer_provider: Any = None,
    progress: Callable[[str], None] | None = None,
) -> LoadTestResult:
    """`run_load_async` in a new event loop."""
    return asyncio.run(run_load_async(config, tracer_provider=tracer_provider, progress=progress))


# --- the command line --------------------------------------------------------------------------

LOADTEST_HELP = "load a drafter with simulated verifiers"
_DEFAULTS = LoadTestConfig()


def _arg(parse: Any) -> Any:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _option(p: Any, flag: str, help: str, *, shown: Any = None, **kwargs: Any) -> None:
    """An option whose help ends with its default, as `mtpdraft serve --help` shows them:
    LoadTestConfig's field of the flag's name, unless ``default`` is given."""
    field_name = flag.removeprefix("--").replace("-", "_")
    if "default" not in kwargs and hasattr(_DEFAULTS, field_name):
        kwargs["default"] = getattr(_DEFAULTS, field_name)
    shown = kwargs.get("default") if shown is None else shown
    p.add_argument(flag, help=f"{help} (default: {shown})", **kwargs)


def add_loadtest_parser(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``loadtest`` to the ``mtpdraft`` command's subcommands."""
    p = subparsers.add_parser(
        "loadtest",
        help=LOADTEST_HELP,
        description="Simulated verifiers against a drafter: propose latency, drafts/s, errors "
        "and the server's batch sizes. After a warm-up of --warmup-steps steps per verifier, "
        "the run lasts --duration seconds or --requests steps; the report says why its "
        "measured window is not --duration long when it is not.",
        epilog="Exit status: 0 the run ended as planned (failed calls are counted, not fatal); "
        "1 a call failed and --fail-on-error, or no server at the start; 2 a refused "
        f"configuration; {EXIT_CUT_SHORT} the run was cut short because the server drained "
        f"or stopped answering; {EXIT_INTERRUPTED} interrupted (Ctrl-C; a second one exits "
        "at once). Cut short or interrupted, the report and plot hold what was measured "
        "up to then.",
    )
    add_target_option(p, DEFAULT_TARGET)
    _option(
        p, "--mode", "stream: ProposeStream (a batch of one a step); unary: Propose(previous=...); "
        "split: "
        "AfterVerify+Propose", choices=MODES,
    )  # fmt: skip
    _option(
        p, "--verifiers", "simulated verifiers, each on a state of its own", type=int, metavar="N"
    )
    _option(
        p,
        "--rate",
        "open loop: Poisson steps/s in all",
        type=float,
        metavar="STEPS_PER_S",
        shown="closed loop",
    )
    _option(
        p, "--duration", "seconds measured, after the warm-up", type=float, metavar="SECONDS",
        shown=f"{DEFAULT_DURATION_S:g}; with --requests, up to --max-duration",
    )  # fmt: skip
    _option(
        p, "--requests", "stop after this many measured steps", type=int, metavar="N", shown="none"
    )
    _option(
        p, "--warmup-steps", "steps per verifier before the measured window opens (its first "
        "prefill among them), left out of the figures; in open loop about N times the "
        "verifiers' arrivals; 0: none", type=int, metavar="N",
    )  # fmt: skip
    _option(
        p, "--max-duration", "the longest duration allowed, a guard against a typing slip",
        type=float, metavar="SECONDS",
    )  # fmt: skip
    _option(p, "--max-verifiers", "the most verifiers allowed", type=int, metavar="N")
    _option(
        p, "--accept", "drafts accepted per step: geometric:P, fixed:N or uniform", metavar="SPEC",
        type=_arg(Acceptance.parse),
    )  # fmt: skip
    _option(
        p, "--prompt-len", "prompt tokens: N or LO:HI", metavar="N|LO:HI",
        type=_arg(lambda t: IntRange.parse(t, "--prompt-len", 1, MAX_PROMPT_LEN)),
    )  # fmt: skip
    _option(p, "--num-drafts", "K, drafts asked per step", type=int, metavar="K")
    _option(p, "--seq-len", "steps per sequence", type=int, metavar="N")
    _option(p, "--refeed", "send the target hiddens of accepts", action="store_true", shown="off")
    _option(p, "--dtype", "the hiddens' dtype", choices=("fp32", "bf16"))
    _option(p, "--verify-ms", "closed loop: the target's time per step", type=float, metavar="MS")
    _option(p, "--processes", "spread the verifiers over processes", type=int, metavar="N")
    _option(p, "--seed", "of the random prompts, hiddens and verdicts", type=int, metavar="N")
    _option(p, "--timeout", "deadline of each call", type=float, metavar="SECONDS")
    _option(p, "--out", "write the JSON report here", metavar="FILE", default=None, shown="none")
    _option(
        p,
        "--plot",
        "write a PNG plot here (needs matplotlib)",
        metavar="FILE",
        default=None,
        shown="none",
    )
    _option(p, "--fail-on-error", "exit 1 if any call failed", action="store_true", shown="off")
    _option(
        p, "--quiet", "no progress on stderr, no summary on stdout", action="store_true",
        shown="off",
    )  # fmt: skip
    add_security_options(p)


def config_from_args(args: argparse.Namespace) -> LoadTestConfig:
    """The LoadTestConfig of parsed ``loadtest`` arguments; OptionError for a security
    option that cannot be used."""
    return LoadTestConfig(
        target=args.target,
        security=security_from_args(args),
        mode=args.mode,
        verifiers=args.verifiers,
        rate=args.rate,
        duration=args.duration,
        requests=args.requests,
        warmup_steps=args.warmup_steps,
        accept=args.accept,
        prompt_len=args.prompt_len,
        num_drafts=args.num_drafts,
        seq_len=args.seq_len,
        refeed=args.refeed,
        dtype=args.dtype,
        verify_ms=args.verify_ms,
        processes=args.processes,
        seed=args.seed,
        timeout=args.timeout,
        max_duration=args.max_duration,
        max_verifiers=args.max_verifiers,
    )


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_loadtest(args: argparse.Namespace) -> int:
    """The ``loadtest`` command; its exit statuses are in its parser's epilog."""
    security = Security()
    try:
        config = config_from_args(args)
        security = config.security
        config.validate()
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise LoadTestError("--plot needs matplotlib: pip install 'mtpdraft[loadtest]'")
        result = run_load(config, progress=None if args.quiet else _stderr)
    except (LoadTestError, OptionError) as err:
        _stderr(f"mtpdraft loadtest: {err}")
        return 2
    except DrafterError as err:
        hint = security.hint()
        _stderr(f"mtpdraft loadtest: cannot use the server at {args.target}: {err}{hint}")
        return 1
    except KeyboardInterrupt:  # the second Ctrl-C
        _stderr("mtpdraft loadtest: interrupted again; exiting now, no report")
        return EXIT_INTERRUPTED
    report = result.report
    if args.out:
        write_json(report, args.out)
    if args.plot:
        write_plot(report, result.samples, args.plot)
    if not args.quiet:
        print(summary(report))
    cut_short = report["cut_short"]
    if cut_short is not None:
        # Said even with --quiet: the figures cover less than was asked for.
        files = ", ".join(f for f in (args.out, args.plot) if f)
        written = f"; written to {files}" if files else ""
        _stderr(
            f"mtpdraft loadtest: cut short, {cut_short}: {report['steps']} steps measured in "
            f"{report['elapsed_s']:.1f} s, {report['error_count']} errors{written}"
        )
        return EXIT_INTERRUPTED if cut_short == INTERRUPTED else EXIT_CUT_SHORT
    return 1 if args.fail_on_error and report["error_count"] else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m mtpdraft.client.loadtest ...``, before the ``mtpdraft`` command has it."""
    parser = argparse.ArgumentParser(prog="mtpdraft")
    add_loadtest_parser(parser.add_subparsers(dest="command", required=True))
    argv = sys.argv[1:] if argv is None else argv
    return run_loadtest(parser.parse_args(["loadtest", *argv]))
