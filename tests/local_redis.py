"""The Redis the shared-backend tests use (GATEWAY_TEST_REDIS_URL, default the local
one): skip a test when none answers, except under CI=true, where that fails: CI must not
go green by silently testing only half the backends."""

from __future__ import annotations

import os

import pytest
import redis

REDIS_URL = os.environ.get("GATEWAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _redis_unreachable_reason() -> str | None:
    try:
        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            client.ping()
        finally:
            client.close()
    except redis.RedisError as exc:
        return f"Redis not reachable at {REDIS_URL} ({type(exc).__name__}: {exc})"
    return None


def require_redis() -> None:
    reason = _redis_unreachable_reason()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI=true requires Redis (start redis-server)")
    pytest.skip(reason)


def drop_namespace(namespace: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=namespace + "*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()
