"""OpenTelemetry: the client's span parents the server's, child spans, and the metrics."""

from __future__ import annotations

import grpc
import pytest
from drafting import hiddens, tokens
from opentelemetry.instrumentation.grpc import client_interceptor, intercept_channel
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from servers import InProcessServer, small_engine

from mtpdraft.client import DrafterClient, Verdict
from mtpdraft.service.telemetry import Telemetry


@pytest.fixture
def traced(mimo_checkpoint):
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
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


def _job_spans(parent, exporter: InMemorySpanExporter) -> dict[str, list]:
    """The queue and forward spans under `parent`, by name."""
    found: dict[str, list] = {"mtpdraft.queue": [], "mtpdraft.forward": []}
    for span in exporter.get_finished_spans():
        if span.name in found and span.parent.span_id == parent.context.span_id:
            found[span.name].append(span)
    return found


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
    for server_span in propose_server:
        children = _job_spans(server_span, exporter)
        (queue,), (forward,) = children["mtpdraft.queue"], children["mtpdraft.forward"]
        assert forward.attributes["mtpdraft.batch.requests"] == 1
        assert server_span.start_time <= queue.start_time <= queue.end_time
        assert queue.end_time == forward.start_time <= forward.end_time <= server_span.end_time
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
    children = _job_spans(stream_span, exporter)  # a queue and a forward span per message
    assert len(children["mtpdraft.queue"]) == len(children["mtpdraft.forward"]) == 2
    methods = {p.attributes["rpc.method"] for p in _metrics(reader)["rpc.server.duration"]}
    assert "ProposeStream" in methods
