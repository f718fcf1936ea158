"""Wrong tokens per client address (`AuthThrottle`) and where the address comes from
(`client_address`), as pure functions and one small class with a fake clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, load_settings
from gateway.http.throttle import AuthThrottle, client_address, client_key, parse_networks

PROXIES = parse_networks(["127.0.0.1", "10.0.0.0/8", "fd00::/8"])


@pytest.mark.parametrize(
    ("peer", "forwarded_for", "trusted", "client"),
    [
        # No trusted proxy: the header is never read, whatever it says.
        ("192.0.2.9", ["203.0.113.1"], (), "192.0.2.9"),
        # An untrusted peer's header is not read either.
        ("192.0.2.9", ["203.0.113.1"], PROXIES, "192.0.2.9"),
        # nginx appends the address it saw; a client's own entries come before it.
        ("127.0.0.1", ["6.6.6.6, 203.0.113.1"], PROXIES, "203.0.113.1"),
        # Two proxies of ours in a row: the first address neither of them is.
        ("127.0.0.1", ["6.6.6.6, 203.0.113.1, 10.1.2.3"], PROXIES, "203.0.113.1"),
        # Several headers are one list, in order.
        ("127.0.0.1", ["6.6.6.6", "203.0.113.1"], PROXIES, "203.0.113.1"),
        # A trusted proxy with no header: the proxy is the client.
        ("127.0.0.1", [], PROXIES, "127.0.0.1"),
        # Garbage where an address should be: the hop that passed it on is the client.
        ("127.0.0.1", ["203.0.113.1, not-an-address"], PROXIES, "127.0.0.1"),
        ("127.0.0.1", ["junk, 10.1.2.3"], PROXIES, "10.1.2.3"),
        # Every hop trusted: the leftmost one.
        ("127.0.0.1", ["10.0.0.1, 10.0.0.2"], PROXIES, "10.0.0.1"),
        # IPv6, with brackets and a port, and IPv4 with a port.
        ("fd00::1", ["[2001:db8::7]:443"], PROXIES, "2001:db8::7"),
        ("127.0.0.1", ["203.0.113.1:5555"], PROXIES, "203.0.113.1"),
        # An IPv4-mapped IPv6 peer is its IPv4 address.
        ("::ffff:127.0.0.1", ["203.0.113.1"], PROXIES, "203.0.113.1"),
        (None, ["203.0.113.1"], PROXIES, None),
    ],
)
def test_client_address(
    peer: str | None, forwarded_for: list[str], trusted: tuple[object, ...], client: str | None
) -> None:
    assert client_address(peer, forwarded_for, trusted) == client  # type: ignore[arg-type]


def test_ipv6_clients_are_counted_by_their_64_bit_prefix() -> None:
    assert client_key("2001:db8:1:2::1") == client_key("2001:db8:1:2:ffff::9")
    assert client_key("2001:db8:1:2::1") != client_key("2001:db8:1:3::1")
    assert client_key("::ffff:192.0.2.1") == client_key("192.0.2.1") == "192.0.2.1"
    assert client_key("192.0.2.1") != client_key("192.0.2.2")


def test_a_client_is_locked_out_until_its_oldest_failure_leaves_the_window() -> None:
    now = [100.0]
    throttle = AuthThrottle(3, 60.0, clock=lambda: now[0])
    for _ in range(3):
        assert throttle.retry_after("192.0.2.1") is None
        throttle.failed("192.0.2.1")
        now[0] += 10  # failures at 100, 110, 120
    assert throttle.retry_after("192.0.2.1") == 30  # at 130: the one of 100 leaves at 160
    assert throttle.retry_after("192.0.2.2") is None  # another client
    now[0] = 159.5
    assert throttle.retry_after("192.0.2.1") == 1  # never 0: a Retry-After of 0 means now
    now[0] = 160.0
    assert throttle.retry_after("192.0.2.1") is None  # one more try
    throttle.failed("192.0.2.1")
    assert throttle.retry_after("192.0.2.1") == 10  # until the one of 110 leaves at 170


def test_memory_stays_bounded_whatever_the_number_of_addresses() -> None:
    now = [0.0]
    throttle = AuthThrottle(5, 60.0, max_clients=1000, clock=lambda: now[0])
    for n in range(50_000):
        throttle.failed(f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}")
    assert len(throttle) == 1000
    for _ in range(5):
        throttle.failed("192.0.2.1")
    assert throttle.retry_after("192.0.2.1") == 60  # the newest clients are the ones kept
    now[0] += 61
    throttle.failed("192.0.2.2")  # anything expired is forgotten as new failures come in
    assert len(throttle) == 1


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (
            '[http]\ntrusted_proxies = ["10.0.0.0/33"]\n',
            r"'10\.0\.0\.0/33' is not an address",
        ),
        ("[http]\nauth_max_failures = 0\n", "auth_max_failures"),
        ("[http]\nauth_failure_window_seconds = 0\n", "auth_failure_window_seconds"),
    ],
)
def test_bad_throttle_settings_stop_start_up_with_the_key_named(
    tmp_path: Path, toml: str, message: str
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(toml)
    with pytest.raises(ConfigError, match=message):
        load_settings(config, environ={})


def test_trusted_proxies_from_the_environment() -> None:
    settings = load_settings(None, environ={"GATEWAY_HTTP__TRUSTED_PROXIES": '["10.0.0.0/8"]'})
    assert settings.http.trusted_proxies == ["10.0.0.0/8"]
