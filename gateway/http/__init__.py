"""The daemon's HTTP server: health and readiness probes, Prometheus metrics, the JSON
chat API, and mount points for channel adapters (see `server` for the routes)."""

from gateway.http.auth import HttpConfigError, check_bind_policy, is_loopback
from gateway.http.chat_api import ApiError, ChatRequest
from gateway.http.health import ComponentHealth, HealthState, Phase, Readiness
from gateway.http.namespace import API_CHANNEL, Caller, SessionRefused, resolve_session
from gateway.http.server import (
    DEFAULT_MAX_BODY_BYTES,
    ChatHandler,
    HttpBindError,
    HttpServer,
    check_listen,
    json_error,
)

__all__ = [
    "API_CHANNEL",
    "DEFAULT_MAX_BODY_BYTES",
    "ApiError",
    "Caller",
    "ChatHandler",
    "ChatRequest",
    "ComponentHealth",
    "HealthState",
    "HttpBindError",
    "HttpConfigError",
    "HttpServer",
    "Phase",
    "Readiness",
    "SessionRefused",
    "check_bind_policy",
    "check_listen",
    "is_loopback",
    "json_error",
    "resolve_session",
]
