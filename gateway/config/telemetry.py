"""`[telemetry]`: traces over OTLP."""

from __future__ import annotations

from pydantic import Field

from gateway.config.section import Section


class TelemetrySettings(Section):
    otlp_endpoint: str | None = Field(
        None,
        description="Where traces go over OTLP/HTTP (protobuf), e.g. http://127.0.0.1:4318 "
        "(/v1/traces is added) or a full .../v1/traces URL. Unset: the standard "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, else no "
        "tracing (and no cost). Needs the telemetry extra.",
        examples=["http://127.0.0.1:4318"],
    )
    service_name: str = Field(
        "chat-gateway", description="The service.name traces carry (OTEL_SERVICE_NAME wins)."
    )
    capture_content: bool = Field(
        False,
        description="Put message and reply text into spans. Off: spans hold sizes, ids "
        "and timings only, never what people wrote.",
    )
