"""The daemon's HTTP server: health and readiness probes, Prometheus metrics, the JSON
chat API, and mount points for channel adapters (see `server` for the routes)."""

from gateway.http.auth import HttpConfigError, check_bind_policy, is_loopback
from gateway.http.chat_api import API_CHANNEL, ApiError, ChatRequest, api_session_key
from gateway.http.health import ComponentHealth, HealthState, Phase, Readiness
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
    "ChatHandler",
    "ChatRequest",
    "ComponentHealth",
    "HealthState",
    "HttpBindError",
    "HttpConfigError",
    "HttpServer",
    "Phase",
    "Readiness",
    "api_session_key",
    "check_bind_policy",
    "check_listen",
    "is_loopback",
    "json_error",
]
