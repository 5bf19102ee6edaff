"""``mtpdraft loadtest``: many simulated verifiers against a drafter on this host.

    mtpdraft loadtest --target 127.0.0.1:50051 --mode stream --verifiers 64 \\
        --duration 10 --accept geometric:0.7 --num-drafts 4 --prompt-len 64:512 \\
        --out report.json --plot report.png

Each verifier (see `loadtest_verifier`) runs sequences of verify steps on its
own state: ``--mode stream`` (one ProposeStream per verifier, the hot path),
``unary`` (Propose carrying the previous verdict: one round trip per step) or
``split`` (AfterVerify then Propose: two). Closed loop by default (each
verifier's next step starts when the last is answered, after ``--verify-ms``);
``--rate R`` makes it open loop: Poisson arrivals at R steps/s in all. The run
lasts ``--duration`` seconds or ``--requests`` steps, whichever comes first.

The report gives propose latency percentiles, drafts and steps per second,
errors by status code name (reported, not fatal unless ``--fail-on-error``),
and the server's batch-size histogram and queue depth over the run.

Tracing: with OTEL_TRACES_EXPORTER set (e.g. otlp, console), every sequence and
verify step gets a span ("loadtest.sequence", "loadtest.step") and the channel
is instrumented, so a trace viewer joins them with the server's spans (the
server continues the W3C trace context). In stream mode gRPC traces the whole
stream as one call, so steps are not parents of server work there; use
``--mode unary`` to see each step's server spans. ``run_load(...,
tracer_provider=...)`` injects a provider instead (tests).

Only loopback targets are accepted (127.0.0.0/8, ::1, localhost): this is a
tool to load one's own server, and it is bounded (600 s, 1024 verifiers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import ipaddress
import multiprocessing
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import grpc

from .async_client import AsyncDrafterClient
from .errors import DrafterError
from .loadtest_report import build_report, summary, write_json, write_plot
from .loadtest_verifier import (
    HIDDEN_POOL_ROWS,
    MODES,
    Acceptance,
    HiddenPool,
    IntRange,
    Pacer,
    Samples,
    Verifier,
    VerifierSettings,
)
from .types import ServerInfo

MAX_DURATION_S = 600.0
MAX_VERIFIERS = 1024
MAX_PROCESSES = 64
MAX_PROMPT_LEN = 131_072
DEFAULT_DURATION_S = 10.0
DEFAULT_TARGET = "127.0.0.1:50051"
# Time the worker processes get to start (spawn imports numpy and grpc) and to
# hand back their samples after the run.
PROCESS_START_TIMEOUT_S = 120.0
PROCESS_RESULT_GRACE_S = 120.0


class LoadTestError(Exception):
    """A configuration the load test refuses, or a server it cannot use."""


def check_loopback(target: str) -> str:
    """``target`` if it names a loopback address and a port; LoadTestError otherwise.

    Accepts ``host:port`` with host 127.x.y.z, ``localhost`` or ``[::1]``, with or
    without gRPC's ``dns:///``, ``ipv4:`` or ``ipv6:`` scheme.
    """
    rest = target.strip()
    for scheme in ("dns:///", "ipv4:", "ipv6:"):
        if rest.startswith(scheme):
            rest = rest[len(scheme) :]
            break
    if rest.startswith("["):
        host, _, port = rest[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = rest.rpartition(":")
    refused = LoadTestError(
        f"refusing target {target!r}: the load test only targets this host "
        "(127.0.0.0/8, [::1] or localhost, with a port, e.g. 127.0.0.1:50051)"
    )
    if not port.isdigit() or not 0 < int(port) < 65536 or any(c in host for c in "/,@"):
        raise refused
    if host.lower() == "localhost":
        return target
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise refused from None
    if not address.is_loopback:
        raise refused
    return target


@dataclass
class LoadTestConfig:
    """One load test. ``duration`` None: 10 s, or up to 600 s when ``requests`` is set."""

    target: str = DEFAULT_TARGET
    mode: str = "stream"
    verifiers: int = 4
    rate: float | None = None
    duration: float | None = None
    requests: int | None = None
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

    @property
    def run_seconds(self) -> float:
        if self.duration is not None:
            return self.duration
        return MAX_DURATION_S if self.requests is not None else DEFAULT_DURATION_S

    def validate(self) -> None:
        check_loopback(self.target)
        checks = [
            (self.mode in MODES, f"--mode {self.mode!r}: use one of {', '.join(MODES)}"),
            (
                1 <= self.verifiers <= MAX_VERIFIERS,
                f"--verifiers {self.verifiers}: 1 to {MAX_VERIFIERS}",
            ),
            (
                0 < self.run_seconds <= MAX_DURATION_S,
                f"--duration {self.run_seconds:g}: more than 0 and at most {MAX_DURATION_S:g} s",
            ),
            (self.requests is None or self.requests >= 1, "--requests: at least 1"),
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
        out["accept"], out["prompt_len"] = str(self.accept), str(self.prompt_len)
        out["duration"] = self.run_seconds
        return out

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
    choice = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if choice in ("", "none") or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None  # without importing OpenTelemetry or the service (and torch) at all
    from mtpdraft.service.telemetry import providers_from_env

    tracer_provider, meter_provider = providers_from_env()
    if meter_provider is not None:
        meter_provider.shutdown()  # the load test records no metrics
    return tracer_provider


def _traced_channel(target: str, tracer_provider: Any) -> grpc.aio.Channel:
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    interceptors = aio_client_interceptors(tracer_provider=tracer_provider)
    return grpc.aio.insecure_channel(target, interceptors=interceptors)


async def _drive(config: LoadTestConfig, info: ServerInfo, tracer_provider: Any) -> Samples:
    """Runs this process's verifiers to the end; returns what they measured."""
    channel = None
    if tracer_provider is not None:
        channel = _traced_channel(config.target, tracer_provider)
    tracer = tracer_provider.get_tracer("mtpdraft.loadtest") if tracer_provider else None
    samples = Samples()
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
    client = AsyncDrafterClient(
        None if channel else config.target, channel=channel, timeout=config.timeout
    )
    try:
        # Connected before the clock starts (no RPC: no stray span in the traces).
        await asyncio.wait_for(client.channel.channel_ready(), config.timeout)
        pacer = Pacer(
            deadline=time.monotonic() + config.run_seconds,
            requests=config.requests,
            rate=config.rate,
            verify_s=config.verify_ms / 1e3,
            verifiers=config.verifiers,
            samples=samples,
            seed=config.seed,
        )
        verifiers = [
            Verifier(i, client, settings, pacer, hiddens, samples, tracer)
            for i in range(config.verifiers)
        ]
        pacer.start()
        try:
            await asyncio.gather(*(v.run() for v in verifiers))
        finally:
            await pacer.stop()
    finally:
        await client.close()
        if channel is not None:
            await channel.close()
    return samples


def _worker(config: LoadTestConfig, info: ServerInfo, start: Any, results: Any) -> None:
    """A ``--processes`` worker: waits for the others, runs its share, sends its samples."""
    try:
        tracer_provider = _env_tracer_provider()
        start.wait(PROCESS_START_TIMEOUT_S)
        try:
            samples = asyncio.run(_drive(config, info, tracer_provider))
        finally:
            if tracer_provider is not None:
                tracer_provider.shutdown()
        results.put(samples)
    except BaseException:
        results.put(traceback.format_exc())
        raise


async def _run_processes(config: LoadTestConfig, info: ServerInfo) -> Samples:
    ctx = multiprocessing.get_context("spawn")  # no fork of a process holding gRPC threads
    start, results = ctx.Barrier(config.processes + 1), ctx.Queue()
    workers = [
        ctx.Process(target=_worker, args=(config.share(i), info, start, results), daemon=True)
        for i in range(config.processes)
    ]
    for w in workers:
        w.start()
    try:
        try:
            await asyncio.to_thread(start.wait, PROCESS_START_TIMEOUT_S)
        except threading.BrokenBarrierError:
            try:
                failure = results.get(True, 5)
            except queue.Empty:
                failure = "(no traceback)"
            raise LoadTestError(f"a load test process did not start:\n{failure}") from None
        timeout = config.run_seconds + PROCESS_RESULT_GRACE_S
        samples = Samples()
        for _ in workers:
            got = await asyncio.to_thread(results.get, True, timeout)
            if isinstance(got, str):
                raise LoadTestError(f"a load test process failed:\n{got}")
            samples.merge(got)
        return samples
    finally:
        for w in workers:
            w.join(5)
            if w.is_alive():
                w.terminate()


async def _watch_queue(client: AsyncDrafterClient, every: float, out: list) -> None:
    """Samples the server's queue depth (GetInfo.queued_calls) during the run."""
    while True:
        with contextlib.suppress(DrafterError):
            info = await client.info()
            out.append((time.monotonic(), info.queued_calls))
        await asyncio.sleep(every)


async def run_load_async(config: LoadTestConfig, *, tracer_provider: Any = None) -> LoadTestResult:
    """Runs one load test. ``tracer_provider``: use this provider (not the env's) and leave
    it open; single-process runs only (``--processes`` workers build theirs from the env).

    Raises LoadTestError for a configuration or server it refuses, and DrafterError
    when the server cannot be reached at all; errors during the run are counted.
    """
    config.validate()
    owned = None
    if tracer_provider is None and config.processes == 1:
        tracer_provider = owned = _env_tracer_provider()
    # GetInfo travels on its own, untraced channel: the monitor's calls are not load.
    info_client = AsyncDrafterClient(config.target, timeout=config.timeout)
    try:
        before = await info_client.info()
        warnings = _check_server(config, before)
        depth: list[tuple[float, int]] = []
        watcher = asyncio.create_task(_watch_queue(info_client, config.info_interval, depth))
        try:
            if config.processes == 1:
                samples = await _drive(config, before, tracer_provider)
            else:
                samples = await _run_processes(config, before)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        after = await info_client.info()
    finally:
        await info_client.close()
        if owned is not None:
            owned.shutdown()  # flushes the spans
        elif tracer_provider is not None:
            tracer_provider.force_flush()
    report = build_report(config.as_dict(), before, after, samples, depth, warnings)
    return LoadTestResult(report, samples)


def run_load(config: LoadTestConfig, *, tracer_provider: Any = None) -> LoadTestResult:
    """`run_load_async` in a new event loop."""
    return asyncio.run(run_load_async(config, tracer_provider=tracer_provider))


# --- the command line --------------------------------------------------------------------------


def _arg(parse: Any) -> Any:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def add_loadtest_parser(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``loadtest`` to the ``mtpdraft`` command's subcommands."""
    p = subparsers.add_parser(
        "loadtest",
        help="load a drafter on this host with simulated verifiers",
        description="Simulated verifiers against a drafter on this host: propose latency, "
        "drafts/s, errors and the server's batch sizes.",
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help="loopback host:port")
    p.add_argument(
        "--mode",
        choices=MODES,
        default="stream",
        help="stream: ProposeStream; unary: Propose(previous=...); split: AfterVerify+Propose",
    )
    p.add_argument("--verifiers", type=int, default=4, help=f"at most {MAX_VERIFIERS}")
    p.add_argument("--rate", type=float, help="open loop: Poisson steps/s in all (default closed)")
    p.add_argument(
        "--duration", type=float, help=f"seconds (default {DEFAULT_DURATION_S:g}, at most 600)"
    )
    p.add_argument("--requests", type=int, help="stop after this many steps")
    p.add_argument(
        "--accept",
        type=_arg(Acceptance.parse),
        default=Acceptance("geometric", 0.7),
        help="drafts accepted per step: geometric:P, fixed:N or uniform (default geometric:0.7)",
    )
    p.add_argument(
        "--prompt-len",
        type=_arg(lambda t: IntRange.parse(t, "--prompt-len", 1, MAX_PROMPT_LEN)),
        default=IntRange(128, 128),
        help="prompt tokens: N or LO:HI (default 128)",
    )
    p.add_argument("--num-drafts", type=int, default=4, help="K per step")
    p.add_argument("--seq-len", type=int, default=64, help="steps per sequence")
    p.add_argument("--refeed", action="store_true", help="send the target hiddens of accepts")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="hiddens' dtype")
    p.add_argument("--verify-ms", type=float, default=0.0, help="closed loop: target time/step")
    p.add_argument("--processes", type=int, default=1, help="spread verifiers over processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help="deadline of each call, seconds")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    p.add_argument("--fail-on-error", action="store_true", help="exit 1 if any call failed")
    p.add_argument("--quiet", action="store_true", help="no summary on stdout")


def config_from_args(args: argparse.Namespace) -> LoadTestConfig:
    return LoadTestConfig(
        target=args.target,
        mode=args.mode,
        verifiers=args.verifiers,
        rate=args.rate,
        duration=args.duration,
        requests=args.requests,
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
    )


def run_loadtest(args: argparse.Namespace) -> int:
    """The ``loadtest`` command: 0 when it ran, 1 on errors with --fail-on-error or no
    server, 2 for a refused configuration."""
    try:
        config = config_from_args(args)
        config.validate()
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise LoadTestError("--plot needs matplotlib: pip install 'mtpdraft[loadtest]'")
        result = run_load(config)
    except LoadTestError as err:
        print(f"mtpdraft loadtest: {err}", file=sys.stderr)
        return 2
    except DrafterError as err:
        print(f"mtpdraft loadtest: cannot use the server at {args.target}: {err}", file=sys.stderr)
        return 1
    if args.out:
        write_json(result.report, args.out)
    if args.plot:
        write_plot(result.report, result.samples, args.plot)
    if not args.quiet:
        print(summary(result.report))
    return 1 if args.fail_on_error and result.report["error_count"] else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m mtpdraft.client.loadtest ...``, before the ``mtpdraft`` command has it."""
    parser = argparse.ArgumentParser(prog="mtpdraft")
    add_loadtest_parser(parser.add_subparsers(dest="command", required=True))
    argv = sys.argv[1:] if argv is None else argv
    return run_loadtest(parser.parse_args(["loadtest", *argv]))


if __name__ == "__main__":
    sys.exit(main())
