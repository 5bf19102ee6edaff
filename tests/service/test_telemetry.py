"""OpenTelemetry: the client's span parents the server's, child spans, the metrics, and the
OTEL_* variables that switch it on (test_otel_export.py: through server processes)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cli_server import hold_the_engine
from drafting import hiddens, tokens
from opentelemetry.instrumentation.grpc import client_interceptor, intercept_channel
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from servers import InProcessServer, recording_tracer, small_engine

from mtpdraft.client import DrafterClient, Verdict
from mtpdraft.service.serving.scheduler import BatchRun
from mtpdraft.service.telemetry import Telemetry, providers_from_env


@pytest.fixture
def traced(mimo_checkpoint):
    (tracer_provider, exporter), reader = recording_tracer(), InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    server = InProcessServer(
        small_engine(mimo_checkpoint), telemetry=Telemetry(tracer_provider, meter_provider)
    )
    yield server, tracer_provider, exporter, reader
    server.stop()


def _metrics(reader: InMemoryMetricReader) -> dict:
    found = {}
    for resource in reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found[metric.name] = metric.data.data_points
    return found


def _batch_spans(exporter: InMemorySpanExporter, parent=None) -> list:
    """The batched forwards' spans (those under `parent`, if given)."""
    return [
        span
        for span in exporter.get_finished_spans()
        if span.name == "mtpdraft.batch"
        and (parent is None or span.parent.span_id == parent.context.span_id)
    ]


def test_client_span_parents_server_span_and_children(traced) -> None:
    server, tracer_provider, exporter, reader = traced
    channel = intercept_channel(
        grpc.insecure_channel(server.address), client_interceptor(tracer_provider=tracer_provider)
    )
    tracer = tracer_provider.get_tracer("verifier")
    with tracer.start_as_current_span("decode") as root, DrafterClient(channel=channel) as c:
        state = c.alloc_state()
        c.prefill(state, tokens(5, 1), hiddens(5, 1), 1)
        c.propose(state, 1, hiddens(1, 2), 6, 3)
        c.propose(state, 2, hiddens(1, 3), 9, 3, previous=Verdict(2))
        c.after_verify(state, 1)
        c.free_state(state)
    channel.close()
    spans = exporter.get_finished_spans()

    def one(name: str, kind: SpanKind):
        return [s for s in spans if s.name == name and s.kind == kind]

    propose_server = one("/mtpdraft.v1.Drafter/Propose", SpanKind.SERVER)
    propose_client = one("/mtpdraft.v1.Drafter/Propose", SpanKind.CLIENT)
    assert len(propose_server) == len(propose_client) == 2
    for client_span, server_span in zip(propose_client, propose_server, strict=True):
        assert server_span.context.trace_id == root.get_span_context().trace_id
        assert server_span.parent.span_id == client_span.context.span_id
        assert server_span.attributes["rpc.system"] == "grpc"
        assert server_span.attributes["rpc.method"] == "Propose"
    for server_span in propose_server:  # each Propose ran alone: its batch sits under it
        (batch,) = _batch_spans(exporter, server_span)
        assert batch.attributes["mtpdraft.batch.requests"] == 1
        assert batch.attributes["mtpdraft.batch.calls"] == 1
        assert batch.attributes["mtpdraft.batch.queued_ms"] >= 0
        assert [link.context.span_id for link in batch.links] == [server_span.context.span_id]
        assert server_span.start_time <= batch.start_time <= batch.end_time
        assert batch.end_time <= server_span.end_time
    prefill_server = one("/mtpdraft.v1.Drafter/Prefill", SpanKind.SERVER)[0]
    kv = [s for s in spans if s.name == "mtpdraft.kv.prefill"]
    assert kv and kv[0].parent.span_id == prefill_server.context.span_id
    assert any(s.name == "mtpdraft.kv.after_verify" for s in spans)

    metrics = _metrics(reader)
    assert sum(p.count for p in metrics["mtpdraft.batch.size"]) == 2
    assert sum(p.value for p in metrics["mtpdraft.drafts.proposed"]) == 6
    accepted = {
        p.attributes["mtpdraft.draft.position"]: p.value
        for p in metrics["mtpdraft.drafts.accepted"]
    }
    verified = {
        p.attributes["mtpdraft.draft.position"]: p.value
        for p in metrics["mtpdraft.drafts.verified"]
    }
    assert verified == {1: 2, 2: 2, 3: 2} and accepted == {1: 2, 2: 1}  # verdicts 2 and 1
    methods = {p.attributes["rpc.method"] for p in metrics["rpc.server.duration"]}
    assert {"AllocState", "Prefill", "Propose", "AfterVerify", "FreeState"} <= methods
    blocks_free = metrics["mtpdraft.kv.blocks.free"][0].value
    assert blocks_free == 256 and metrics["mtpdraft.states.live"][0].value == 0


def test_a_batch_no_caller_traced_is_a_root_span_whatever_span_is_current() -> None:
    tracer_provider, exporter = recording_tracer()
    telemetry = Telemetry(tracer_provider)
    run = BatchRun(
        requests=1, calls=1, queued_ns=1, started_ns=2, done_ns=3, drafts=2, callers=[None]
    )
    # Recorded where some other span is current: the batch does not sit under it.
    with tracer_provider.get_tracer("test").start_as_current_span("handler"):
        telemetry.record_batch(run)
    (batch,) = _batch_spans(exporter)
    assert batch.parent is None and not batch.links


def test_telemetry_is_off_by_default(mimo_checkpoint) -> None:
    telemetry = Telemetry()
    assert not telemetry.tracing and telemetry.server_interceptors() == []
    server = InProcessServer(small_engine(mimo_checkpoint))
    try:
        with DrafterClient(server.address, timeout=30) as c:
            state = c.alloc_state()
            assert len(c.propose(state, 1, hiddens(1, 0), 1, 2).tokens) == 2
            c.after_verify(state, 0)
            c.free_state(state)
    finally:
        server.stop()


def test_streams_work_and_are_traced_with_tracing_on(traced) -> None:
    server, _, exporter, reader = traced
    with DrafterClient(server.address, timeout=30) as c:
        state = c.alloc_state()
        with c.stream() as stream:
            assert len(stream.propose(state, 1, hiddens(1, 0), 1, 2).tokens) == 2
            assert len(stream.propose(state, 2, hiddens(1, 1), 3, 2, previous=Verdict(1)).tokens)
        c.after_verify(state, 0)
        c.free_state(state)
    (stream_span,) = [
        s for s in exporter.get_finished_spans() if s.name == "/mtpdraft.v1.Drafter/ProposeStream"
    ]
    assert len(_batch_spans(exporter, stream_span)) == 2  # one batch per message
    methods = {p.attributes["rpc.method"] for p in _metrics(reader)["rpc.server.duration"]}
    assert "ProposeStream" in methods


def test_a_batch_call_and_each_stream_message_batch_under_their_call(traced) -> None:
    server, _, exporter, _ = traced
    with DrafterClient(server.address, timeout=30) as c:
        a, b = c.alloc_state(), c.alloc_state()
        for state, seed in ((a, 0), (b, 1)):
            c.prefill(state, tokens(3, seed), hiddens(3, seed), 1)
        c.propose_batch([a, b], [1, 1], [4, 4], hiddens(2, 2), 2)
        with c.stream() as stream:
            for position in (6, 8):  # each message carries the last one's verdicts (1 each)
                got = stream.step([a, b], [1, 1], [position] * 2, hiddens(2, position), 2,
                                  num_accepted=[1, 1])  # fmt: skip
                assert not got.errors and got.counts.tolist() == [2, 2]
        for state in (a, b):
            c.free_state(state)
    (unary,) = _server_span(exporter, "ProposeBatch")
    (stream_span,) = _server_span(exporter, "ProposeStream")
    assert len(_batch_spans(exporter, unary)) == 1
    assert len(_batch_spans(exporter, stream_span)) == 2  # one batch per message
    for batch in _batch_spans(exporter, stream_span):
        assert [link.context.span_id for link in batch.links] == [stream_span.context.span_id]


def _gauges(reader: InMemoryMetricReader) -> dict[str, int]:
    """The engine's gauges as read now, by name without the `mtpdraft.` prefix."""
    names = ("kv.blocks.used", "kv.blocks.free", "kv.handles", "states.live", "queue.depth")
    found = _metrics(reader)
    return {name: found[f"mtpdraft.{name}"][0].value for name in names}


def _server_span(exporter: InMemorySpanExporter, method: str) -> list:
    name = f"/mtpdraft.v1.Drafter/{method}"
    return [s for s in exporter.get_finished_spans() if s.name == name]


def test_kv_gauges_follow_the_states_and_kv_calls_have_spans(traced) -> None:
    server, _, exporter, reader = traced

    def used() -> tuple[int, int]:
        gauges = _gauges(reader)
        return gauges["kv.blocks.used"], gauges["kv.blocks.free"]

    def counts() -> tuple[int, int]:
        gauges = _gauges(reader)
        return gauges["states.live"], gauges["kv.handles"]

    assert used() == (0, 256) and counts() == (0, 0)
    with DrafterClient(server.address, timeout=30) as c:
        donor, taker = c.alloc_state(), c.alloc_state()
        assert used() == (0, 256) and counts() == (2, 0)  # no KV until rows arrive
        c.prefill(donor, tokens(9, 1), hiddens(9, 1), 1)  # 9 rows in blocks of 4
        assert used() == (3, 253)
        handle = c.take_kv(donor)
        assert used() == (3, 253) and counts() == (2, 1)  # the handle holds the blocks
        c.install_kv(taker, handle)
        assert used() == (3, 253) and counts() == (2, 0)
        c.free_state(donor)
        assert used() == (3, 253) and counts() == (1, 0)  # the donor was empty
        c.free_state(taker)
        assert used() == (0, 256) and counts() == (0, 0)
    for method, operation in (("TakeKV", "take"), ("InstallKV", "install"), ("FreeState", "free")):
        parents = {s.context.span_id for s in _server_span(exporter, method)}
        kv = [s for s in exporter.get_finished_spans() if s.name == f"mtpdraft.kv.{operation}"]
        assert parents and {s.parent.span_id for s in kv} == parents, method


def test_queued_calls_show_in_the_depth_and_run_as_one_batch_span_linking_them(traced) -> None:
    server, _, exporter, reader = traced

    def depth() -> int:
        return _gauges(reader)["queue.depth"]

    with DrafterClient(server.address, timeout=60) as c, ThreadPoolExecutor(3) as pool:
        states = [c.alloc_state() for _ in range(3)]
        entered, release = hold_the_engine(server.server.engine)

        def propose(i: int):
            return c.propose(states[i], 1, hiddens(1, i)[0], 1, 2)

        try:
            calls = [pool.submit(propose, 0)]
            assert entered.wait(30), "the first call never reached the engine"
            assert depth() == 0  # computing, not waiting
            calls += [pool.submit(propose, i) for i in (1, 2)]
            deadline = time.monotonic() + 30
            while depth() != 2:
                assert time.monotonic() < deadline, "the two calls never showed as queued"
                time.sleep(0.02)
        finally:
            release.set()
        assert all(len(call.result(60).tokens) == 2 for call in calls)
        assert depth() == 0
        for state in states:
            c.after_verify(state, 0)
            c.free_state(state)
    # The two queued calls ran together: one span for their batch, linking both RPCs.
    queued = sorted(_server_span(exporter, "Propose"), key=lambda s: s.start_time)[1:]
    batches = _batch_spans(exporter)
    assert len(batches) == 2
    (together,) = [b for b in batches if b.attributes["mtpdraft.batch.calls"] == 2]
    linked = {link.context.span_id for link in together.links}
    assert linked == {s.context.span_id for s in queued}
    assert together.parent.span_id in linked
    assert together.attributes["mtpdraft.batch.requests"] == 2


# --- the OTEL_* variables ----------------------------------------------------------------


@pytest.fixture
def otel_env(monkeypatch):
    """No OTEL_* variable set, whatever the environment of the run holds."""
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"},
        {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_METRICS_EXPORTER": "console",
            "OTEL_SDK_DISABLED": "true",
        },
    ],
    ids=["unset", "none", "sdk-disabled"],
)
def test_telemetry_is_off_unless_an_exporter_is_named(otel_env, env) -> None:
    for name, value in env.items():
        otel_env.setenv(name, value)
    assert providers_from_env() == (None, None)
    telemetry = Telemetry(*providers_from_env())
    assert not telemetry.tracing and not telemetry.metering
    assert telemetry.server_interceptors() == []  # no per-call cost


def test_each_exporter_variable_switches_on_its_own_signal(otel_env) -> None:
    otel_env.setenv("OTEL_TRACES_EXPORTER", "console")
    tracer_provider, meter_provider = providers_from_env()
    assert tracer_provider is not None and meter_provider is None
    otel_env.delenv("OTEL_TRACES_EXPORTER")
    otel_env.setenv("OTEL_METRICS_EXPORTER", "CONSOLE")
    tracer_provider, meter_provider = providers_from_env()
    assert tracer_provider is None and meter_provider is not None
    meter_provider.shutdown()


@pytest.mark.parametrize("variable", ["OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER"])
@pytest.mark.parametrize("value", ["zipkin", "otlp,zipkin", "console, zipkin"])
def test_an_unknown_exporter_is_refused_by_name(otel_env, variable: str, value: str) -> None:
    otel_env.setenv(variable, value)
    message = f"{variable}='{value}': unknown exporter 'zipkin' \\(use otlp, console or none"
    with pytest.raises(ValueError, match=message):
        providers_from_env()


@pytest.mark.parametrize(
    ("value", "exporters"),
    [
        ("otlp,console", ["ConsoleSpanExporter", "OTLPSpanExporter"]),
        (" Console , otlp,none", ["ConsoleSpanExporter", "OTLPSpanExporter"]),
        ("console,console", ["ConsoleSpanExporter"]),
        ("none,console", ["ConsoleSpanExporter"]),
    ],
)
def test_an_exporter_list_names_each_exporter_once(otel_env, value, exporters) -> None:
    otel_env.setenv("OTEL_TRACES_EXPORTER", value)
    otel_env.setenv("OTEL_METRICS_EXPORTER", value)
    tracer_provider, meter_provider = providers_from_env()
    processors = tracer_provider._active_span_processor._span_processors
    assert [type(p.span_exporter).__name__ for p in processors] == exporters
    readers = meter_provider._metric_readers
    assert [type(r._exporter).__name__ for r in readers] == [
        name.replace("Span", "Metric") for name in exporters
    ]
    Telemetry(tracer_provider, meter_provider).shutdown()


def test_shutdown_without_a_collector_takes_half_a_second(otel_env) -> None:
    otel_env.setenv("OTEL_TRACES_EXPORTER", "otlp,console")
    otel_env.setenv("OTEL_METRICS_EXPORTER", "otlp")
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # refused
    telemetry = Telemetry(*providers_from_env())
    with telemetry.tracer.start_as_current_span("pending"):
        telemetry.rpc_duration.record(1.0)
    started = time.monotonic()
    telemetry.shutdown()
    assert time.monotonic() - started < 2.0  # 0.5 s each, at once; 14 s of retries before


def test_the_resource_is_named_by_the_otel_variables(otel_env) -> None:
    otel_env.setenv("OTEL_TRACES_EXPORTER", "console")
    tracer_provider, _ = providers_from_env()
    assert tracer_provider.resource.attributes["service.name"] == "mtpdraft"  # the default
    otel_env.setenv("OTEL_SERVICE_NAME", "drafter-eu")
    otel_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging")
    tracer_provider, _ = providers_from_env()
    attributes = tracer_provider.resource.attributes
    assert attributes["service.name"] == "drafter-eu"
    assert attributes["deployment.environment"] == "staging"
