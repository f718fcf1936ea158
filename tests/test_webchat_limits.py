"""The web chat's rate limits (channels/webchat/limits.py): a visitor, an address, new
visitors, wrong passwords; 0 is no limit."""

from __future__ import annotations

from channels.webchat.limits import LOGIN_FAILURES, RateLimits
from channels.webchat.settings import WebChatSettings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_visitor_and_an_address_each_have_their_bound() -> None:
    clock = Clock()
    limits = RateLimits(
        WebChatSettings(visitor_messages_per_minute=2, address_messages_per_minute=3), clock=clock
    )
    assert limits.message("ann", "192.0.2.1") is None
    assert limits.message("ann", "192.0.2.1") is None
    wait = limits.message("ann", "192.0.2.1")
    assert wait is not None and 1 <= wait <= 60  # Ann's third within the minute
    assert limits.message("bob", "192.0.2.1") is None  # the address's third
    assert limits.message("cid", "192.0.2.1") is not None  # the address's fourth
    assert limits.message("cid", "2001:db8::1") is None  # another address
    assert limits.refused == 2
    clock.now += 61
    assert limits.message("ann", "192.0.2.1") is None


def test_a_bound_of_zero_is_none() -> None:
    limits = RateLimits(
        WebChatSettings(
            visitor_messages_per_minute=0,
            address_messages_per_minute=0,
            address_new_visitors_per_hour=0,
        )
    )
    for _ in range(500):
        assert limits.message("ann", "192.0.2.1") is None
        assert limits.new_visitor("192.0.2.1") is None


def test_new_visitors_per_address_and_wrong_passwords() -> None:
    clock = Clock()
    limits = RateLimits(WebChatSettings(address_new_visitors_per_hour=2), clock=clock)
    assert limits.new_visitor("192.0.2.1") is None
    assert limits.new_visitor("192.0.2.1") is None
    assert limits.new_visitor("192.0.2.1") is not None
    assert limits.new_visitor("2001:db8:0:0:1::1") is None
    assert limits.new_visitor("2001:db8::2") is None  # the same /64: one address
    assert limits.new_visitor("2001:db8::3") is not None
    for _ in range(LOGIN_FAILURES):
        assert limits.login_wait("192.0.2.9") is None
        limits.login_failed("192.0.2.9")
    assert limits.login_wait("192.0.2.9") is not None
