"""OpenTelemetry for the server: a span per RPC, child spans, and the service's metrics.

Off unless asked for: with OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER unset (or
"none", or OTEL_SDK_DISABLED=true) the tracer and meter are the API's no-ops and
no gRPC interceptor is installed, so tracing costs nothing. Set to "otlp" (the
OTLP/gRPC exporter, configured by the standard OTEL_EXPORTER_OTLP_* variables)
or "console". OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES name the resource;
OTEL_PROPAGATORS picks the propagation format (W3C trace context by default).

Spans: one server span per RPC (opentelemetry-instrumentation-grpc, parented by
the client's span through the W3C `traceparent` metadata, with the RPC semantic
convention attributes), `mtpdraft.kv.*` under it (Prefill, AfterVerify, TakeKV,
InstallKV, FreeState), and one `mtpdraft.batch` span per batched forward, not per
call: it links the RPC span of every call in the batch and sits under the first,
with the batch's size and how long its oldest call queued. Metrics too are
recorded per batch, so that their cost does not grow with the rows.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import grpc
from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation

from .engine.types import BatchRun

if TYPE_CHECKING:
    import numpy as np

    from .engine.engine import DraftEngine

_BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
_MS_BUCKETS = [0.1, 0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, 250, 1000, 5000]


def _exporter_choice(variable: str) -> str:
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return "none"
    return os.environ.get(variable, "none").strip().lower() or "none"


def providers_from_env() -> tuple[object | None, object | None]:
    """(TracerProvider, MeterProvider) as the OTEL_* variables ask, None where off."""
    traces, metric = (
        _exporter_choice("OTEL_TRACES_EXPORTER"),
        _exporter_choice("OTEL_METRICS_EXPORTER"),
    )
    if traces == "none" and metric == "none":
        return None, None
    from opentelemetry.sdk.resources import Resource

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "mtpdraft")})
    tracer_provider = meter_provider = None
    if traces != "none":
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

        if traces == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            span_exporter = OTLPSpanExporter()
        elif traces == "console":
            span_exporter = ConsoleSpanExporter()
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER={traces!r}: use otlp, console or none")
        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    if metric != "none":
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import (
            ConsoleMetricExporter,
            PeriodicExportingMetricReader,
        )

        if metric == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            metric_exporter = OTLPMetricExporter()
        elif metric == "console":
            metric_exporter = ConsoleMetricExporter()
        else:
            raise ValueError(f"OTEL_METRICS_EXPORTER={metric!r}: use otlp, console or none")
        reader = PeriodicExportingMetricReader(metric_exporter)
        meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
    return tracer_provider, meter_provider


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
        links = [trace.Link(context) for context in run.tags if context is not None]
        parent = None
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
        for provider in (self.tracer_provider, self.meter_provider):
            if provider is not None:
                provider.shutdown()
