"""Wrong tokens counted per client address, and where that address comes from: the
peer, or the `X-Forwarded-For` a trusted proxy wrote.

Promises (tested in tests/test_http_throttle.py and, over HTTP, tests/test_http_limits.py):
- At most `max_failures` wrong tokens from one client in any `window` seconds are
  checked; later tries get 429 with `Retry-After` (the seconds until the oldest failure
  leaves the window) without their token being looked at, the right one included.
- A client is an IPv4 address or an IPv6 /64 (one host's usual share); one client's
  failures never refuse another's.
- `X-Forwarded-For` is read only when the peer is a trusted proxy, and then only the
  addresses the trusted proxies appended: whatever a client wrote to the header itself
  is never the address counted.
- Memory is bounded: at most `max_clients` clients are remembered (the one whose last
  failure is oldest is forgotten first), and a client is forgotten once its failures
  have left the window.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Clients remembered at most (about 0.4 KB each at 10 failures).
MAX_CLIENTS = 10_000


def parse_networks(items: Iterable[str]) -> tuple[IPNetwork, ...]:
    """Addresses or CIDR networks (`10.0.0.0/8`, `::1`) as networks; ValueError names a
    bad one."""
    networks: list[IPNetwork] = []
    for item in items:
        try:
            networks.append(ipaddress.ip_network(item.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{item!r} is not an address or a CIDR network") from None
    return tuple(networks)


def _address(text: str) -> IPAddress | None:
    text = text.strip()
    if text.startswith("[") and "]" in text:  # "[2001:db8::1]:443"
        text = text[1 : text.index("]")]
    elif text.count(":") == 1:  # "192.0.2.1:443"
        text = text.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _trusted(address: IPAddress, trusted: Sequence[IPNetwork]) -> bool:
    return any(address in network for network in trusted)


def client_address(
    peer: str | None, forwarded_for: Sequence[str], trusted: Sequence[IPNetwork]
) -> str | None:
    """The client's address: the peer's, unless the peer is a trusted proxy; then the
    rightmost `X-Forwarded-For` address that is not a trusted proxy (each proxy appends
    the address it received the request from). An address that does not parse ends the
    walk at the proxy that passed it on. `forwarded_for` is every X-Forwarded-For header
    in order."""
    if peer is None or not trusted:
        return peer
    address = _address(peer)
    if address is None or not _trusted(address, trusted):
        return peer
    hops = [hop for header in forwarded_for for hop in header.split(",")]
    client = address
    for hop in reversed(hops):
        parsed = _address(hop)
        if parsed is None:
            break  # not an address: what the last trusted hop told us ends here
        client = parsed
        if not _trusted(parsed, trusted):
            break
    return str(client)


def client_key(address: str | None) -> str:
    """What failures are counted under: the address, or the /64 of an IPv6 address."""
    if address is None:
        return "-"
    parsed = _address(address)
    if parsed is None:
        return address  # a Unix socket's peer, or similar: one client
    if isinstance(parsed, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((parsed, 64), strict=False))
    return str(parsed)


class AuthThrottle:
    """Failures of token checks per client (see the module doc)."""

    def __init__(
        self,
        max_failures: int = 10,
        window: float = 60.0,
        *,
        max_clients: int = MAX_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_failures < 1 or window <= 0 or max_clients < 1:
            raise ValueError("max_failures, window and max_clients must be positive")
        self.max_failures = max_failures
        self.window = window
        self.max_clients = max_clients
        self._clock = clock
        # client -> times of its failures in the window, oldest first; the client whose
        # last failure is oldest first.
        self._failures: OrderedDict[str, list[float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._failures)

    def retry_after(self, address: str | None) -> int | None:
        """Whole seconds this client must wait before its token is checked again, or
        None when it may try now."""
        key = client_key(address)
        times = self._failures.get(key)
        if times is None:
            return None
        now = self._clock()
        self._expire(key, times, now)
        if len(times) < self.max_failures:
            return None
        return max(1, math.ceil(times[0] + self.window - now))

    def failed(self, address: str | None) -> None:
        """Count one wrong token from this client."""
        key = client_key(address)
        now = self._clock()
        times = self._failures.get(key)
        if times is None:
            times = self._failures[key] = []
        else:
            self._failures.move_to_end(key)
        times.append(now)
        del times[: -self.max_failures]  # older ones no longer decide anything
        self._forget_old(now)

    def _expire(self, key: str, times: list[float], now: float) -> None:
        while times and now - times[0] >= self.window:
            del times[0]
        if not times:
            del self._failures[key]

    def _forget_old(self, now: float) -> None:
        while len(self._failures) > self.max_clients:
            self._failures.popitem(last=False)
        # The first client is the one whose last failure is oldest: when even that one is
        # out of the window, so are all its failures.
        while self._failures:
            key, times = next(iter(self._failures.items()))
            if now - times[-1] < self.window:
                break
            del self._failures[key]
