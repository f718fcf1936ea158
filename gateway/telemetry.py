"""Traces of a message's path (intake, journal, queue, cache, context, model, tools,
delivery), exported over OTLP/HTTP through the OpenTelemetry SDK.

Promises (tested in tests/test_telemetry.py):
- Off by default, and then free: nothing of the SDK is imported, and `span()` hands back
  one shared object that does nothing (bench/tracing.py measures what is left).
- One trace per message: its intake span is the root, and its W3C `traceparent` rides in
  the message's metadata, which the journal stores with the message. A turn replayed
  after a crash, or run by another replica, continues that trace.
- No message text and no secret in a span attribute unless `capture_content = true`:
  spans carry ids, sizes, model names, token counts and timings. Every text a span
  carries (its attributes, the error it ends with, captured texts) goes through the
  settings' redactor (`gateway.redaction`) first: a model server's answer or error may
  quote a secret.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from gateway.redaction import Redactor

if TYPE_CHECKING:
    from gateway.config import TelemetrySettings

#: Metadata key of a message's trace context (W3C traceparent), journaled with it.
META_TRACEPARENT = "traceparent"

AttributeValue = str | bool | int | float


class SpanLike(Protocol):
    def set_attribute(self, key: str, value: AttributeValue) -> None: ...


class _NoopSpan:
    __slots__ = ()

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        return None


class _NoopSpanContext:
    """The one context manager every span is while tracing is off."""

    __slots__ = ()

    def __enter__(self) -> _NoopSpan:
        return _NOOP_SPAN

    def __exit__(self, *exc: object) -> None:
        return None


_NOOP_SPAN = _NoopSpan()
_NOOP = _NoopSpanContext()


class _RedactingSpan:
    """An SDK span whose text attributes go through the redactor (a model name is what
    the model server answered)."""

    __slots__ = ("_redact", "_span")

    def __init__(self, span: Any, redactor: Redactor) -> None:
        self._span = span
        self._redact = redactor.redact

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        self._span.set_attribute(key, self._redact(value) if isinstance(value, str) else value)


class Telemetry:
    """The gateway's tracer. Without a `provider` (the default) it is off: every
    method returns at once and nothing of OpenTelemetry is imported."""

    def __init__(
        self,
        provider: Any = None,
        *,
        capture_content: bool = False,
        redactor: Redactor | None = None,
    ) -> None:
        """`redactor` is the settings' (None: token shapes only)."""
        self.enabled = provider is not None
        self.capture_content = capture_content
        self.redactor = redactor or Redactor()
        self._provider = provider
        self._tracer: Any = None
        self._propagator: Any = None
        if provider is not None:
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            self._tracer = provider.get_tracer("chat-gateway")
            self._propagator = TraceContextTextMapPropagator()

    def span(
        self,
        name: str,
        attributes: Mapping[str, AttributeValue] | None = None,
        *,
        parent: str | None = None,
        start_ns: int | None = None,
    ) -> AbstractContextManager[SpanLike]:
        """A span around a `with` block, a child of the current span, or of `parent` (a
        traceparent) when given."""
        if not self.enabled:
            return _NOOP
        return self._span(name, attributes, parent, start_ns)

    @contextmanager
    def _span(
        self,
        name: str,
        attributes: Mapping[str, AttributeValue] | None,
        parent: str | None,
        start_ns: int | None,
    ) -> Iterator[SpanLike]:
        context = self._propagator.extract({"traceparent": parent}) if parent else None
        redact = self.redactor.redact
        with self._tracer.start_as_current_span(
            name,
            context=context,
            attributes={
                key: redact(value) if isinstance(value, str) else value
                for key, value in (attributes or {}).items()
            },
            start_time=start_ns,
            # The SDK would record the exception's text as it is: done below, redacted.
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                yield _RedactingSpan(span, self.redactor)
            except Exception as exc:
                self._failed(span, exc)
                raise

    def _failed(self, span: Any, exc: Exception) -> None:
        """The exception event and error status the SDK would give, redacted."""
        from opentelemetry.trace import Status, StatusCode

        redact = self.redactor.redact
        message = redact(str(exc))
        stack = redact("".join(traceback.format_exception(exc)))
        span.record_exception(
            exc, attributes={"exception.message": message, "exception.stacktrace": stack}
        )
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {message}"))

    def traceparent(self) -> str | None:
        """The current span's traceparent (None when off or outside a span)."""
        if not self.enabled:
            return None
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier)
        return carrier.get("traceparent")

    def content(self, span: SpanLike, key: str, text: str | None) -> None:
        """Put `text` on `span` only when content capture is on; its size always."""
        if not self.enabled or text is None:
            return
        span.set_attribute(f"{key}.length", len(text))
        if self.capture_content:
            span.set_attribute(key, text)  # redacted by the span (`_RedactingSpan`)

    def shutdown(self) -> None:
        """Send what is buffered, then stop (at the end of `gateway run`)."""
        if self._provider is not None:
            self._provider.shutdown()


OFF = Telemetry()
_active = OFF


def telemetry() -> Telemetry:
    """The process's tracer (OFF until `install`)."""
    return _active


def install(instance: Telemetry) -> Telemetry:
    """Make `instance` the process's tracer; returns the one it replaced."""
    global _active
    previous, _active = _active, instance
    return previous


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id a traceparent carries (for log lines)."""
    if not traceparent:
        return None
    parts = traceparent.split("-")
    return parts[1] if len(parts) == 4 else None


def endpoint_from(
    settings: TelemetrySettings, environ: Mapping[str, str] = os.environ
) -> str | None:
    """The OTLP/HTTP traces URL: `otlp_endpoint`, else the standard variables."""
    direct = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    base = settings.otlp_endpoint or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if settings.otlp_endpoint is None and direct:
        return direct
    if not base:
        return None
    base = base.rstrip("/")
    return base if base.endswith("/v1/traces") else f"{base}/v1/traces"


def from_settings(
    settings: TelemetrySettings,
    environ: Mapping[str, str] = os.environ,
    *,
    redactor: Redactor | None = None,
) -> Telemetry:
    """OFF without an endpoint; else the SDK exporting to it in batches, its errors and
    captured texts through `redactor` (the settings')."""
    endpoint = endpoint_from(settings, environ)
    if endpoint is None:
        return OFF
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        from gateway.config import ConfigError

        raise ConfigError(
            "telemetry: an OTLP endpoint is set but the OpenTelemetry SDK is not installed; "
            "pip install 'chat-gateway[telemetry]', or unset telemetry.otlp_endpoint"
        ) from None
    provider = tracer_provider(environ.get("OTEL_SERVICE_NAME") or settings.service_name)
    # Headers, timeout, compression: the exporter reads OTEL_EXPORTER_OTLP_* itself.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return Telemetry(provider, capture_content=settings.capture_content, redactor=redactor)


def tracer_provider(service_name: str) -> Any:
    """An SDK TracerProvider of this service (not the global one: tests make several)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    return TracerProvider(resource=Resource.create({"service.name": service_name}))
