"""tracing=True: the clients' calls get client spans that the server's spans join, with the
tracer set up from the OTEL_* variables by the client itself (each case in a process of
its own, since the tracer provider is global)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from opentelemetry.trace import SpanKind
from servers import InProcessServer, recording_tracer, small_engine

from mtpdraft.service.telemetry import Telemetry

# Two calls, blocking and asyncio, each through a client made with tracing=True and no
# tracer set up by the script; the console exporter prints the client spans as JSON.
CALLS = """
import asyncio, sys
from opentelemetry import trace
from mtpdraft.client import AsyncDrafterClient, DrafterClient

with DrafterClient(sys.argv[1], tracing=True) as c:
    c.info()

async def main():
    async with AsyncDrafterClient(sys.argv[1], tracing=True) as c:
        await c.alloc_state()

asyncio.run(main())
trace.get_tracer_provider().force_flush()
"""


@pytest.fixture(scope="module")
def served(mimo_checkpoint):
    provider, exporter = recording_tracer()
    server = InProcessServer(small_engine(mimo_checkpoint), telemetry=Telemetry(provider))
    yield server, exporter
    server.stop()


def _run(address: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | env
    return subprocess.run(
        [sys.executable, "-c", CALLS, address],
        capture_output=True,
        text=True,
        timeout=120,
        env=environ,
    )


def _console_spans(out: str) -> list[dict]:
    """The console exporter's spans: JSON objects, one after another."""
    decoder, spans, at = json.JSONDecoder(), [], 0
    while (start := out.find("{", at)) != -1:
        span, at = decoder.raw_decode(out, start)
        spans.append(span)
    return spans


def test_client_spans_from_the_env_and_the_server_spans_join_them(served) -> None:
    server, exporter = served
    done = _run(server.address, OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME="verifier")
    assert done.returncode == 0, done.stderr
    client = [s for s in _console_spans(done.stdout) if s["kind"] == "SpanKind.CLIENT"]
    assert [s["name"] for s in client] == [
        "/mtpdraft.v1.Drafter/GetInfo",
        "/mtpdraft.v1.Drafter/AllocState",
    ]
    assert all(s["resource"]["attributes"]["service.name"] == "verifier" for s in client)
    served_spans = {
        (format(s.context.trace_id, "#034x"), format(s.parent.span_id, "#018x")): s
        for s in exporter.get_finished_spans()
        if s.kind == SpanKind.SERVER and s.parent is not None
    }
    for span in client:  # each call's server span is the client span's child
        key = (span["context"]["trace_id"], span["context"]["span_id"])
        assert served_spans[key].name == span["name"]


def test_without_an_exporter_the_context_still_travels(served) -> None:
    server, exporter = served
    before = len(exporter.get_finished_spans())
    done = _run(server.address)  # no OTEL_* variable: nothing exported, context sent
    assert done.returncode == 0, done.stderr
    assert not _console_spans(done.stdout)
    new = exporter.get_finished_spans()[before:]
    parented = [s for s in new if s.kind == SpanKind.SERVER and s.parent is not None]
    assert {s.name for s in parented} == {
        "/mtpdraft.v1.Drafter/GetInfo",
        "/mtpdraft.v1.Drafter/AllocState",
    }


def test_a_bad_exporter_is_one_clear_error(served) -> None:
    server, _ = served
    done = _run(server.address, OTEL_TRACES_EXPORTER="otlp,bogus")
    assert done.returncode != 0
    assert "ValueError: OTEL_TRACES_EXPORTER: 'bogus' is not an exporter here" in done.stderr
