"""Client spans joined to the server's, set up from the standard OTEL_* variables.

`DrafterClient(..., tracing=True)` (and `AsyncDrafterClient`) wraps its channel with
opentelemetry-instrumentation-grpc's client interceptor: every call gets a client span
whose context travels with it (W3C `traceparent`), so the server's span is its child.
The spans go to the global tracer provider. Where the application has set none,
`tracer_provider()` sets one, once per process, from the standard variables:
OTEL_TRACES_EXPORTER (`otlp`, `console`, a comma-separated list of them, or `none`),
the OTLP exporter's own OTEL_EXPORTER_OTLP_*, OTEL_SERVICE_NAME and
OTEL_RESOURCE_ATTRIBUTES; OTEL_SDK_DISABLED=true exports nothing. With no exporter
the context still travels, so the server's spans still join the caller's trace.

`exporting_provider()` makes a provider of its own (not set globally) from the same
variables, for a program that traces on its own behalf (the load test).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from opentelemetry import trace

EXPORTERS = ("otlp", "console")
# At shutdown, the most the last export may take (exporting_provider's): an unreachable
# collector's retries would hold a program's exit 10 s.
SHUTDOWN_S = 0.5
# An unreachable collector: one line of the OTLP exporter's errors this often, at most.
OTLP_LOG_PERIOD_S = 60.0
_lock = threading.Lock()


def exporters_from_env() -> list[str]:
    """The exporters OTEL_TRACES_EXPORTER names, in order; ValueError naming a bad one."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",")]
    names = [n for n in dict.fromkeys(names) if n and n != "none"]
    for name in names:
        if name not in EXPORTERS:
            raise ValueError(
                f"OTEL_TRACES_EXPORTER: {name!r} is not an exporter here (use otlp, console "
                "or none, or a comma-separated list of them)"
            )
    return names


def _exporter(name: str) -> Any:
    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    return ConsoleSpanExporter()


def tracer_provider() -> trace.TracerProvider:
    """The global tracer provider; where none was set, one made from the OTEL_* variables
    and set globally."""
    with _lock:
        current = trace.get_tracer_provider()
        if not isinstance(current, trace.ProxyTracerProvider):
            return current  # the application's own
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        names = exporters_from_env()  # before anything is set: a bad value changes nothing
        provider = TracerProvider(resource=Resource.create())
        for name in names:
            provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
        trace.set_tracer_provider(provider)
        return provider


def traced_channel(channel: Any) -> Any:
    """A blocking channel whose calls are traced (see the module docstring)."""
    from opentelemetry.instrumentation.grpc import client_interceptor, intercept_channel

    return intercept_channel(channel, client_interceptor(tracer_provider=tracer_provider()))


def aio_interceptors() -> list:
    """The interceptors an asyncio channel takes at its creation to trace its calls."""
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return aio_client_interceptors(tracer_provider=tracer_provider())


def exporting_provider(service_name: str) -> Any:
    """A new TracerProvider (not set globally) with the exporters OTEL_TRACES_EXPORTER
    names, or None where it names none; its resource is named by OTEL_SERVICE_NAME, else
    `service_name`. Its shutdown gives the last export SHUTDOWN_S at most, and the OTLP
    exporter's errors are logged once per OTLP_LOG_PERIOD_S at most."""
    names = exporters_from_env()
    if not names:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    class BoundedBatchSpanProcessor(BatchSpanProcessor):
        """Past SHUTDOWN_S its shutdown shuts the exporter down, which ends its retries."""

        def shutdown(self) -> None:
            flushing = threading.Thread(target=super().shutdown, daemon=True)
            flushing.start()
            flushing.join(SHUTDOWN_S)
            if flushing.is_alive():
                self.span_exporter.shutdown()
                flushing.join()

    if "otlp" in names:
        _log_once_per(OTLP_LOG_PERIOD_S, "opentelemetry.exporter.otlp.proto.grpc.exporter")
    name = os.environ.get("OTEL_SERVICE_NAME", service_name)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    for exporter in names:
        provider.add_span_processor(BoundedBatchSpanProcessor(_exporter(exporter)))
    return provider


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


def _log_once_per(period: float, logger_name: str) -> None:
    """Without a collector the OTLP exporter logs every attempt of every export: one line
    a period says as much."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, _OncePer) for f in logger.filters):
        logger.addFilter(_OncePer(period))
