"""OpenTelemetry for the server: a span per RPC, child spans, and the service's metrics.

Off unless asked for: with OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER unset (or
"none", or OTEL_SDK_DISABLED=true) the tracer and meter are the API's no-ops and
no gRPC interceptor is installed, so tracing costs nothing. Set to "otlp" (the
OTLP/gRPC exporter, configured by the standard OTEL_EXPORTER_OTLP_* variables),
"console", or a comma-separated list of them (each gets its own exporter). A value
that is none of these is refused when the server starts. OTEL_SERVICE_NAME and
OTEL_RESOURCE_ATTRIBUTES name the resource; OTEL_PROPAGATORS picks the propagation
format (W3C trace context by default). `mtpdraft serve --metrics-port` adds a
Prometheus reader of the same metrics (`providers_from_env(prometheus=True)`,
`serve_metrics`), beside any exporter.

An unreachable OTLP collector costs little: the exporter's errors are logged once a
minute at most (not once per export attempt), and at shutdown the last export has
half a second (SHUTDOWN_S), not the exporter's 10 s of retries.

Spans: one server span per RPC (opentelemetry-instrumentation-grpc, parented by
the client's span through the W3C `traceparent` metadata, with the RPC semantic
convention attributes), `mtpdraft.kv.*` under it (Prefill, AfterVerify, TakeKV,
InstallKV, FreeState), and one `mtpdraft.batch` span per batched forward, not per
call: it links the RPC span of every call in the batch and sits under the first,
with the batch's size and how long its oldest call queued. Metrics too are
recorded per batch, so that their cost does not grow with the rows.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import grpc
from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Observation

if TYPE_CHECKING:
    import numpy as np

    from .engine.engine import DraftEngine
    from .serving.scheduler import BatchRun

_BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
_MS_BUCKETS = [0.1, 0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 250, 1000, 5000]


# At shutdown, the most the last export of each signal may take.
SHUTDOWN_S = 0.5
# An unreachable collector: one line of the OTLP exporter's errors this often, at most.
_OTLP_LOG_PERIOD_S = 60.0
_EXPORTERS = ("otlp", "console")


def _exporters(variable: str) -> list[str]:
    """The exporters `variable` names (a comma-separated list; "none" names none), the
    console's first: the OTLP exporter is the one that may be slow to shut down."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    value = os.environ.get(variable, "")
    names = {name.strip().lower() for name in value.split(",")} - {"", "none"}
    unknown = sorted(names - set(_EXPORTERS))
    if unknown:
        raise ValueError(
            f"{variable}={value!r}: unknown exporter {unknown[0]!r} (use otlp, console or "
            "none, comma-separated)"
        )
    return sorted(names, key=lambda name: name != "console")


class _OncePer(logging.Filter):
    """Lets one record through per `period` seconds."""

    def __init__(self, period: float) -> None:
        super().__init__()
        self.period, self.next = period, 0.0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now < self.next:
            return False
        self.next = now + self.period
        return True


def _quiet_otlp_errors() -> None:
    """Without a collector the OTLP exporter logs every attempt of every export (a line a
    second or more while serving): one a minute says as much."""
    logger = logging.getLogger("opentelemetry.exporter.otlp.proto.grpc.exporter")
    if not any(isinstance(f, _OncePer) for f in logger.filters):
        logger.addFilter(_OncePer(_OTLP_LOG_PERIOD_S))


def providers_from_env(prometheus: bool = False) -> tuple[object | None, object | None]:
    """(TracerProvider, MeterProvider) as the OTEL_* variables ask, None where off; a bad
    value raises ValueError naming it. `prometheus`: the meter provider has a Prometheus
    reader too (served by `serve_metrics`)."""
    traces, metric = _exporters("OTEL_TRACES_EXPORTER"), _exporters("OTEL_METRICS_EXPORTER")
    if prometheus:
        metric.insert(metric.count("console"), "prometheus")  # otlp stays last
    if not traces and not metric:
        return None, None
    if "otlp" in traces + metric:
        _quiet_otlp_errors()
    try:
        if traces:
            import opentelemetry.propagate  # noqa: F401 (it reads OTEL_PROPAGATORS)
        from opentelemetry.sdk.resources import Resource

        name = os.environ.get("OTEL_SERVICE_NAME", "mtpdraft")
        resource = Resource.create({"service.name": name})
        return _tracer_provider(traces, resource), _meter_provider(metric, resource)
    except Exception as exc:  # the SDK's: ValueErrors, and a bare Exception for compression
        raise ValueError(f"an OTEL_* variable is refused: {exc}") from exc


def _tracer_provider(exporters: list[str], resource):
    if not exporters:
        return None
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    class BoundedBatchSpanProcessor(BatchSpanProcessor):
        """Its shutdown gives the last export SHUTDOWN_S: past it the exporter is shut down,
        which ends its retries (the SDK would wait them out, 10 s without a collector)."""

        def shutdown(self) -> None:
            flushing = threading.Thread(target=super().shutdown, daemon=True)
            flushing.start()
            flushing.join(SHUTDOWN_S)
            if flushing.is_alive():
                self.span_exporter.shutdown()
                flushing.join()

    provider = TracerProvider(resource=resource)
    for name in exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        else:
            exporter = ConsoleSpanExporter()
        provider.add_span_processor(BoundedBatchSpanProcessor(exporter))
    return provider


def _meter_provider(exporters: list[str], resource):
    if not exporters:
        return None
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        ConsoleMetricExporter,
        PeriodicExportingMetricReader,
    )

    readers = []
    for name in exporters:
        if name == "prometheus":
            from opentelemetry.exporter.prometheus import PrometheusMetricReader

            readers.append(PrometheusMetricReader())
            continue
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            exporter = OTLPMetricExporter()
        else:
            exporter = ConsoleMetricExporter()
        readers.append(PeriodicExportingMetricReader(exporter))
    return MeterProvider(resource=resource, metric_readers=readers)


def serve_metrics(host: str, port: int):
    """Serves the Prometheus reader's metrics at http://HOST:PORT/metrics from a daemon
    thread (port 0: a free one); returns the HTTP server (`server_port`, `shutdown()`)."""
    from prometheus_client import start_http_server

    server, _ = start_http_server(port, addr=host)
    return server


class Telemetry:
    """The server's tracer and instruments; API no-ops where no provider is given."""

    def __init__(self, tracer_provider=None, meter_provider=None) -> None:
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self.tracing = tracer_provider is not None
        # Off, the histogram is a no-op, but building its attributes per RPC is not
        # free: 0.55 us a call, 0.24 us with this check (call included).
        self.metering = meter_provider is not None
        self.tracer = (
            tracer_provider.get_tracer("mtpdraft")
            if tracer_provider is not None
            else trace.NoOpTracer()
        )
        meter = (
            meter_provider.get_meter("mtpdraft")
            if meter_provider is not None
            else metrics.NoOpMeter("mtpdraft")
        )
        self.rpc_duration = meter.create_histogram(
            "rpc.server.duration",
            unit="ms",
            description="Duration of each RPC, by method and status code",
            explicit_bucket_boundaries_advisory=_MS_BUCKETS,
        )
        self.batch_size = meter.create_histogram(
            "mtpdraft.batch.size",
            unit="{request}",
            description="Requests in each batched forward",
            explicit_bucket_boundaries_advisory=_BATCH_BUCKETS,
        )
        self.drafts = meter.create_counter(
            "mtpdraft.drafts.proposed", unit="{token}", description="Draft tokens returned"
        )
        self.verified = meter.create_counter(
            "mtpdraft.drafts.verified",
            unit="{token}",
            description="Drafts a verdict was given on, by draft position",
        )
        self.accepted = meter.create_counter(
            "mtpdraft.drafts.accepted",
            unit="{token}",
            description="Drafts accepted by the verifier, by draft position",
        )
        self._meter = meter

    def observe_engine(self, engine: DraftEngine, queued: Callable[[], int]) -> None:
        """Gauges read from the engine at each collection, and the verdict hook."""

        def gauge(name: str, unit: str, description: str, read: Callable[[], int]) -> None:
            def callback(_: CallbackOptions) -> Iterator[Observation]:
                yield Observation(read())

            self._meter.create_observable_gauge(
                name, callbacks=[callback], unit=unit, description=description
            )

        pool = engine.pool
        gauge("mtpdraft.kv.blocks.free", "{block}", "Free KV blocks", lambda: pool.num_free)
        gauge(
            "mtpdraft.kv.blocks.used",
            "{block}",
            "KV blocks held by states and handles",
            lambda: pool.num_total - pool.num_free,
        )
        gauge("mtpdraft.states.live", "{state}", "Live drafter states", lambda: len(engine.states))
        gauge(
            "mtpdraft.kv.handles",
            "{handle}",
            "KV handles awaiting install",
            lambda: len(engine.handles),
        )
        gauge("mtpdraft.queue.depth", "{call}", "Propose calls waiting for a batch", queued)
        engine.on_verdicts = self.record_verdicts

    def record_verdicts(self, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        """The verdicts of a batch, counted per draft position: one add per position."""
        if not self.metering or not len(num_drafts):
            return
        for position in range(1, int(num_drafts.max()) + 1):
            attrs = {"mtpdraft.draft.position": position}
            self.verified.add(int((num_drafts >= position).sum()), attrs)
            if accepted := int((num_accepted >= position).sum()):
                self.accepted.add(accepted, attrs)

    def record_rpc(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        if not self.metering:
            return
        self.rpc_duration.record(
            seconds * 1e3,
            {
                "rpc.system": "grpc",
                "rpc.service": "mtpdraft.v1.Drafter",
                "rpc.method": method,
                "rpc.grpc.status_code": code.value[0],
            },
        )

    def span_context(self) -> trace.SpanContext | None:
        """The current RPC's span, for the batch that will run its call (None when off)."""
        if not self.tracing:
            return None
        context = trace.get_current_span().get_span_context()
        return context if context.is_valid else None

    def record_batch(self, run: BatchRun) -> None:
        """One batched forward: its size and drafts, and its span (see the docstring)."""
        if self.metering:
            self.batch_size.record(run.requests)
            self.drafts.add(run.drafts)
        if not self.tracing:
            return
        links = [trace.Link(context) for context in run.callers if context is not None]
        # With no traced caller to sit under, a root span, whichever context this runs in.
        parent = Context()
        if links:
            parent = trace.set_span_in_context(trace.NonRecordingSpan(links[0].context))
        span = self.tracer.start_span(
            "mtpdraft.batch",
            context=parent,
            links=links,
            start_time=run.started_ns,
            attributes={
                "mtpdraft.batch.requests": run.requests,
                "mtpdraft.batch.calls": run.calls,
                "mtpdraft.batch.queued_ms": (run.started_ns - run.queued_ns) / 1e6,
            },
        )
        span.end(end_time=run.done_ns)

    @contextmanager
    def kv_span(self, operation: str) -> Iterator[None]:
        if not self.tracing:
            yield
            return
        with self.tracer.start_as_current_span(f"mtpdraft.kv.{operation}"):
            yield

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        if not self.tracing:
            return []
        from opentelemetry.instrumentation.grpc import aio_server_interceptor

        return [aio_server_interceptor(tracer_provider=self.tracer_provider)]

    def shutdown(self) -> None:
        """Flushes and stops both providers at once, each in about SHUTDOWN_S at most (the
        metric readers share it: the OTLP one, the slow one, comes last)."""
        stopping = []
        if self.tracer_provider is not None:
            stopping.append(threading.Thread(target=self.tracer_provider.shutdown))
        if self.meter_provider is not None:
            stop = self.meter_provider.shutdown
            stopping.append(threading.Thread(target=stop, args=(SHUTDOWN_S * 1e3,)))
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()
