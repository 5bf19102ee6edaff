"""``mtpdraft loadtest``: many simulated verifiers against a drafter.

    mtpdraft loadtest --target drafter.internal:50051 --mode stream --verifiers 64 \\
        --duration 10 --accept geometric:0.7 --num-drafts 4 --prompt-len 64:512 \\
        --out report.json --plot report.png

The target is any server a client reaches: HOST:PORT or unix:PATH, over TLS or
mutual TLS and with a bearer token as the clients' options say (``--tls-ca``,
``--tls-cert`` / ``--tls-key``, ``--token-file``; see `mtpdraft.client.command_line`).

Each verifier (see `verifier`) runs sequences of verify steps on its
own state: ``--mode stream`` (one ProposeStream per verifier, the hot path: a
message a step, its state a batch of one), ``unary`` (Propose carrying the
previous verdict: one round trip per step) or ``split`` (AfterVerify then
Propose: two). Closed loop by default (each
verifier's next step starts when the last is answered, after ``--verify-ms``);
``--rate R`` makes it open loop: Poisson arrivals at R steps/s in all. The
warm-up lasts until every verifier is through its first ``--warmup-steps``
steps (its first prefill among them, however slow the machine); they are counted
apart. Then the run lasts ``--duration`` seconds or ``--requests`` steps,
whichever comes first, and the report says why its measured window is not
``--duration`` long when it is not.

The report gives propose latency percentiles (from the send and, in open loop,
from the scheduled arrival), drafts and steps per second, errors by status code
name (reported, not fatal unless ``--fail-on-error``), and the server's
batch-size histogram and queue depth over the run. A line of progress goes to
stderr every second.

A server that drains (a call refused for it, or GetInfo, polled all along,
says so) or stops answering (GetInfo failing for ``LOST_AFTER_S``) ends the run
early, as does Ctrl-C: the report then holds what was measured, says why it
ended, and the command exits 3 (130 for Ctrl-C).

Tracing: with OTEL_TRACES_EXPORTER set (e.g. otlp, console), every sequence and
verify step gets a span ("loadtest.sequence", "loadtest.step") and the channel
is instrumented, so a trace viewer joins them with the server's spans (the
server continues the W3C trace context). In stream mode gRPC traces the whole
stream as one call, so steps are not parents of server work there; use
``--mode unary`` to see each step's server spans. ``run_load(...,
tracer_provider=...)`` injects a provider instead (tests).

A run is bounded, against a typing slip: ``--max-duration`` (600 s) and
``--max-verifiers`` (1024) raise the bounds.
"""

from .run import (
    EXIT_CUT_SHORT,
    EXIT_INTERRUPTED,
    LOADTEST_HELP,
    LoadTestConfig,
    LoadTestError,
    LoadTestResult,
    add_loadtest_parser,
    config_from_args,
    main,
    run_load,
    run_load_async,
    run_loadtest,
)

__all__ = [
    "EXIT_CUT_SHORT",
    "EXIT_INTERRUPTED",
    "LOADTEST_HELP",
    "LoadTestConfig",
    "LoadTestError",
    "LoadTestResult",
    "add_loadtest_parser",
    "config_from_args",
    "main",
    "run_load",
    "run_load_async",
    "run_loadtest",
]
