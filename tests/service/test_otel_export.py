"""Telemetry switched on by the standard OTEL_* variables, from a real `mtpdraft serve` process.

An OTLP/gRPC collector in this process receives what the server exports: spans
parented by a traced client's, and every metric, under the resource and at the
endpoint the variables name. The server flushes its telemetry when it stops, so
the checks run on what arrived by then.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest
from drafting import hiddens, tokens
from opentelemetry.instrumentation.grpc import client_interceptor, intercept_channel
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families
from servers import PATIENCE, SERVER_ARGS, ServerProcess, recording_tracer, start_server

from mtpdraft.client import DrafterClient, Verdict

SERVICE = "/mtpdraft.v1.Drafter/"
METRICS = {
    "rpc.server.duration",
    "mtpdraft.batch.size",
    "mtpdraft.drafts.proposed",
    "mtpdraft.drafts.verified",
    "mtpdraft.drafts.accepted",
    "mtpdraft.kv.blocks.free",
    "mtpdraft.kv.blocks.used",
    "mtpdraft.kv.handles",
    "mtpdraft.states.live",
    "mtpdraft.queue.depth",
}


@dataclass
class Collector:
    """An OTLP/gRPC receiver of spans and metrics; keeps every request and its metadata."""

    spans: list = field(default_factory=list)  # (resource attributes, span)
    metric_names: set[str] = field(default_factory=set)
    metric_exports: list[set[str]] = field(default_factory=list)  # each export's names
    resources: list[dict] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> str:
        collector = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                collector.received(request.resource_spans, "scope_spans", context)
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):
                collector.received(request.resource_metrics, "scope_metrics", context)
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        return f"http://127.0.0.1:{port}"

    def received(self, resources, scopes: str, context) -> None:
        with self.lock:
            self.headers.append(dict(context.invocation_metadata()))
            if scopes == "scope_metrics":
                self.metric_exports.append(set())
            for resource in resources:
                attributes = {a.key: a.value.string_value for a in resource.resource.attributes}
                self.resources.append(attributes)
                for scope in getattr(resource, scopes):
                    if scopes == "scope_spans":
                        self.spans += [(attributes, s) for s in scope.spans]
                    else:
                        self.metric_names |= {m.name for m in scope.metrics}
                        self.metric_exports[-1] |= {m.name for m in scope.metrics}

    def named(self, name: str) -> list:
        return [span for _, span in self.spans if span.name == name]


@dataclass
class Exported:
    """What one server exported, and the client's own spans of the same calls."""

    collector: Collector
    client_spans: list
    output: str
    exit_code: int


OTEL_ENV = {
    "OTEL_TRACES_EXPORTER": "otlp",
    "OTEL_METRICS_EXPORTER": "otlp",
    "OTEL_SERVICE_NAME": "drafter-under-test",
    "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=ci",
    "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=verifiers",
}


def _start(mimo_checkpoint, collector: Collector) -> ServerProcess:
    with pytest.MonkeyPatch.context() as env:  # the server process inherits these
        for name, value in OTEL_ENV.items():
            env.setenv(name, value)
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.start())
        return start_server(mimo_checkpoint, *SERVER_ARGS)


def _traced_calls(address: str) -> list:
    """Every call kind from a traced client; returns the client's finished spans."""
    tracer_provider, exporter = recording_tracer()
    channel = intercept_channel(
        grpc.insecure_channel(address), client_interceptor(tracer_provider=tracer_provider)
    )
    with DrafterClient(channel=channel, timeout=30) as c:
        state, other = c.alloc_state(), c.alloc_state()
        c.prefill(state, tokens(5, 1), hiddens(5, 1), 1)
        c.propose(state, 1, hiddens(1, 2)[0], 6, 3)
        with c.stream() as stream:
            stream.propose(state, 2, hiddens(1, 3)[0], 9, 3, previous=Verdict(2))
        c.after_verify(state, 1)
        c.install_kv(other, c.take_kv(state))
        c.free_state(state)
        c.free_state(other)
    channel.close()
    return list(exporter.get_finished_spans())


@pytest.fixture(scope="module")
def exported(mimo_checkpoint) -> Exported:
    """A server exporting to a collector of its own, every call kind made to it, stopped
    (which flushes)."""
    collector = Collector()
    server = _start(mimo_checkpoint, collector)
    try:
        client_spans = _traced_calls(server.address)
    finally:
        server.process.terminate()
        exit_code = server.process.wait(60)
        collector.server.stop(0)
    output = "".join(server.lines) + server.process.stdout.read()
    return Exported(collector, client_spans, output, exit_code)


def test_otlp_goes_to_the_endpoint_with_the_headers_and_resource_named(exported) -> None:
    assert exported.exit_code == 0, exported.output
    assert exported.collector.headers, "nothing was exported"
    assert all(h.get("x-tenant") == "verifiers" for h in exported.collector.headers)
    for resource in exported.collector.resources:
        assert resource["service.name"] == "drafter-under-test"
        assert resource["deployment.environment"] == "ci"


def test_each_rpc_has_a_server_span_parented_by_the_clients(exported) -> None:
    client = [s for s in exported.client_spans if s.kind == SpanKind.CLIENT]
    methods = ["AllocState", "Prefill", "Propose", "ProposeStream", "AfterVerify", "TakeKV"]
    methods += ["InstallKV", "FreeState"]
    assert {s.name for s in client} == {SERVICE + m for m in methods}
    served = {s.span_id: s for _, s in exported.collector.spans if s.name.startswith(SERVICE)}
    assert len(served) == len(client) == 10
    for span in client:
        (server_span,) = [s for s in served.values() if s.parent_span_id == span_id(span)]
        assert server_span.name == span.name
        assert server_span.trace_id == span.context.trace_id.to_bytes(16, "big")


def span_id(span) -> bytes:
    return span.context.span_id.to_bytes(8, "big")


def test_batch_and_kv_spans_sit_under_their_rpc(exported) -> None:
    collector = exported.collector

    def parents(name: str) -> list[str]:
        by_id = {s.span_id: s.name for _, s in collector.spans}
        return sorted(by_id[s.parent_span_id] for s in collector.named(name))

    proposing = [SERVICE + "Propose", SERVICE + "ProposeStream"]
    assert parents("mtpdraft.batch") == proposing  # one call in each batch: under it
    for batch in collector.named("mtpdraft.batch"):
        (size,) = [a.value.int_value for a in batch.attributes if a.key.endswith("requests")]
        assert size == 1
    for operation, rpc in [
        ("prefill", "Prefill"),
        ("after_verify", "AfterVerify"),
        ("take", "TakeKV"),
        ("install", "InstallKV"),
    ]:
        assert parents(f"mtpdraft.kv.{operation}") == [SERVICE + rpc]
    assert parents("mtpdraft.kv.free") == [SERVICE + "FreeState"] * 2


def test_every_metric_is_exported(exported) -> None:
    assert exported.collector.metric_names >= METRICS


def test_the_rpc_metrics_and_the_engines_share_one_meter(exported) -> None:
    """One process, one meter: an export carries the RPCs' metrics (their duration, the
    drafts they returned) and the engine's together."""
    rpc_metrics = {"rpc.server.duration", "mtpdraft.drafts.proposed"}
    assert any(
        names & rpc_metrics and names & (METRICS - rpc_metrics)
        for names in exported.collector.metric_exports
    )


def _output_of_one_call(checkpoint) -> str:
    """A server started in this environment, one AllocState and FreeState: all it printed."""
    server = start_server(checkpoint, *SERVER_ARGS)
    try:
        with DrafterClient(server.address, timeout=30) as c:
            c.free_state(c.alloc_state())
    finally:
        assert server.stop() == 0
    return "".join(server.lines) + server.process.stdout.read()


def test_console_exporters_print_spans_and_metrics(mimo_checkpoint, monkeypatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "console")
    out = _output_of_one_call(mimo_checkpoint)
    for name in (SERVICE + "AllocState", SERVICE + "FreeState", "mtpdraft.kv.free"):
        assert f'"name": "{name}"' in out
    for name in ("mtpdraft.states.live", "rpc.server.duration"):
        assert f'"name": "{name}"' in out


def test_comma_separated_exporters_each_get_everything(mimo_checkpoint, monkeypatch) -> None:
    """`otlp,console`: both exporters, as the OpenTelemetry specification says."""
    collector = Collector()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp, console")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "console,OTLP")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.start())
    try:
        out = _output_of_one_call(mimo_checkpoint)
    finally:
        collector.server.stop(0)
    assert f'"name": "{SERVICE}AllocState"' in out  # the console's spans
    assert '"name": "mtpdraft.states.live"' in out  # and metrics
    assert collector.named(SERVICE + "AllocState")  # the collector's
    assert collector.metric_names >= {"mtpdraft.states.live", "rpc.server.duration"}


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("OTEL_TRACES_EXPORTER", "bogus", "OTEL_TRACES_EXPORTER='bogus': unknown exporter"),
        ("OTEL_METRICS_EXPORTER", "otlp,zipkin", "unknown exporter 'zipkin'"),
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "soon", "could not convert string to float: 'soon'"),
        ("OTEL_PROPAGATORS", "bogus", "Propagator bogus not found"),
    ],
)
def test_a_bad_otel_value_is_one_line_at_start(variable, value, message) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env |= {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp", variable: value}
    cmd = [sys.executable, "-m", "mtpdraft", "serve", "--port", "0", "--device", "cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=PATIENCE)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert "serving" not in done.stdout  # refused before the model loads


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_collector_neither_floods_the_log_nor_holds_the_shutdown(
    mimo_checkpoint, monkeypatch
) -> None:
    """Exports every 0.1 s to a port nobody listens on: the exporter retries each for its
    10 s timeout, logging every attempt, and the SDK's shutdown would wait the retries out."""
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "100")
    server = start_server(mimo_checkpoint, *SERVER_ARGS, "--grace-period", "0")
    try:
        with DrafterClient(server.address, timeout=30) as c:
            for _ in range(40):  # 4 s of calls, of exports, of failures
                c.free_state(c.alloc_state())
                time.sleep(0.1)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(PATIENCE) == 0
        shutdown = time.monotonic() - started
    finally:
        server.stop()
    out = "".join(server.lines) + server.process.stdout.read()
    logged = [line for line in out.splitlines() if "opentelemetry" in line]
    assert len(logged) <= 1, "\n".join(logged)
    assert shutdown < 3.0  # 0.5 s of the drain, 0.5 s for the last exports; 14 s before


def _scrape(url: str) -> dict[str, list]:
    """The samples of a Prometheus scrape, by metric family."""
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        text = response.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def test_metrics_port_serves_the_metrics_for_prometheus(mimo_checkpoint, monkeypatch) -> None:
    """--metrics-port: the service's metrics at /metrics, with no OTEL_* variable set."""
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    server = start_server(mimo_checkpoint, *SERVER_ARGS, "--metrics-port", "0")
    try:
        (url,) = [line.split(" at ")[1].strip() for line in server.lines if "Prometheus" in line]
        with DrafterClient(server.address, timeout=30) as c:
            state = c.alloc_state()
            c.prefill(state, tokens(5, 1), hiddens(5, 1), 1)
            c.propose(state, 1, hiddens(1, 2)[0], 6, 3)
            held = _scrape(url)
            c.free_state(state)
        freed = _scrape(url)
    finally:
        assert server.stop() == 0
    duration = held["rpc_server_duration_milliseconds"]
    (count,) = [
        s.value
        for s in duration
        if s.name.endswith("_count") and s.labels["rpc_method"] == "AllocState"
    ]
    assert count == 1
    assert [s.value for s in held["mtpdraft_states_live"]] == [1]
    assert [s.value for s in freed["mtpdraft_states_live"]] == [0]
    free = held["mtpdraft_kv_blocks_free"][0].value
    used = held["mtpdraft_kv_blocks_used"][0].value
    assert used == 2 and free == 256 - used  # 6 rows in blocks of 4, of 256 blocks
    assert sum(s.value for s in held["mtpdraft_drafts_proposed"]) == 3
