"""The `web_fetch` tool: a URL's readable text, without letting the model reach inside.

Promise: no request leaves for an address that is not public (loopback, private,
link-local, carrier-grade NAT, multicast, reserved, unspecified) unless the operator
allowed its network. The check is made on the addresses a name resolves to, inside the
resolver the connection itself uses, so what is checked is what is connected to: a
name that resolves to a public address when checked and to 127.0.0.1 when connecting
(DNS rebinding) cannot slip through. Literal addresses, in whatever spelling the
resolver accepts (decimal `2130706433`, octal `0177.0.0.1`, `[::ffff:127.0.0.1]`), are
checked the same way, and so is every redirect before it is followed.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin

import aiohttp
import anyio
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver
from loguru import logger
from yarl import URL

from gateway.agent.tools import Tool, ToolContext
from gateway.llm.types import ToolSpec

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Content types read as text as they are; HTML is made readable first.
_HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})
_TEXT_TYPES = frozenset(
    {"application/json", "application/xml", "application/rss+xml", "application/atom+xml"}
)
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
USER_AGENT = "chat-gateway-web-fetch/1"


class FetchRefused(Exception):
    """A fetch the policy refuses or that cannot give text; the message says why."""


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    """What `web_fetch` may reach and how much it reads."""

    timeout: float = 15.0
    max_bytes: int = 2_000_000
    max_chars: int = 200_000
    max_redirects: int = 5
    allow_networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def build(
        cls,
        *,
        timeout: float = 15.0,
        max_bytes: int = 2_000_000,
        max_chars: int = 200_000,
        max_redirects: int = 5,
        allow_networks: Sequence[str] = (),
    ) -> FetchPolicy:
        networks = tuple(ipaddress.ip_network(n, strict=False) for n in allow_networks)
        return cls(timeout, max_bytes, max_chars, max_redirects, networks)


def address_refusal(address: IPAddress, allowed: Sequence[IPNetwork] = ()) -> str | None:
    """What kind of address `address` is when it may not be fetched from (`a loopback
    address`), or None when it may. Pure policy.

    Only globally reachable unicast addresses pass, unless one of `allowed` holds it.
    An IPv4 address mapped into IPv6 (::ffff:127.0.0.1) is judged as the IPv4 one.
    """
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if any(address.version == net.version and address in net for net in allowed):
        return None
    for kind, flag in (
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("private", address.is_private),
        ("multicast", address.is_multicast),
        ("unspecified", address.is_unspecified),
        ("reserved", address.is_reserved),
    ):
        if flag:
            return f"a {kind} address"
    if not address.is_global:
        return "not a public address"
    return None


class CheckedResolver(AbstractResolver):
    """A resolver that gives aiohttp only addresses the policy allows: a name with any
    refused address is refused whole (one bad answer means the name is not to be
    trusted), so the connection can only go where the check looked."""

    def __init__(self, allowed: Sequence[IPNetwork], inner: AbstractResolver | None = None) -> None:
        self._allowed = tuple(allowed)
        self._inner = inner or ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        try:
            results = await self._inner.resolve(host, port, family)
        except OSError as exc:
            raise FetchRefused(f"cannot resolve {host} ({exc.strerror or exc})") from None
        for result in results:
            refusal = address_refusal(ipaddress.ip_address(result["host"]), self._allowed)
            if refusal is not None:
                raise FetchRefused(f"{host} resolves to {result['host']}, {refusal}; not fetched")
        return results

    async def close(self) -> None:
        await self._inner.close()


def _check_url(url: str, allowed: Sequence[IPNetwork]) -> URL:
    """The URL parsed, if its scheme is http(s) and a literal address in it is allowed
    (names are checked when resolved)."""
    try:
        parsed = URL(url)
    except (ValueError, TypeError):
        raise FetchRefused(f"{url!r} is not a URL") from None
    if parsed.scheme not in ("http", "https"):
        raise FetchRefused(f"only http and https URLs are fetched, not {parsed.scheme or url!r}")
    host = parsed.raw_host
    if not host:
        raise FetchRefused(f"{url!r} has no host")
    try:
        literal = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return parsed
    refusal = address_refusal(literal, allowed)
    if refusal is not None:
        raise FetchRefused(f"{literal} is {refusal}; not fetched")
    return parsed


@dataclass(frozen=True, slots=True)
class Page:
    url: str
    content_type: str
    charset: str | None
    body: bytes
    cut: bool


async def fetch_page(
    url: str, policy: FetchPolicy, *, resolver: AbstractResolver | None = None
) -> Page:
    """GET `url` under `policy`: every hop checked, at most `max_bytes` read, the whole
    of it (redirects included) within `timeout`. Raises FetchRefused saying why not."""
    connector = aiohttp.TCPConnector(
        resolver=CheckedResolver(policy.allow_networks, resolver),
        use_dns_cache=False,
        force_close=True,
    )
    # trust_env stays off: a proxy from the environment would connect where we did not check.
    async with aiohttp.ClientSession(
        connector=connector,
        headers={"User-Agent": USER_AGENT, "Accept": "text/html,text/plain;q=0.9,*/*;q=0.5"},
        auto_decompress=True,
    ) as session:
        try:
            with anyio.fail_after(policy.timeout):
                return await _follow(session, url, policy)
        except TimeoutError:
            raise FetchRefused(f"no complete answer within {policy.timeout:g}s") from None
        except aiohttp.InvalidURL as exc:
            # yarl refuses odd spellings of addresses (2130706433, 0177.0.0.1, 127.1).
            raise FetchRefused(f"{exc.url} is not a URL this tool fetches") from None
        except aiohttp.ClientError as exc:
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, FetchRefused):
                raise cause from None
            raise FetchRefused(f"request failed ({type(exc).__name__}: {exc})") from None


async def _follow(session: aiohttp.ClientSession, url: str, policy: FetchPolicy) -> Page:
    current = url
    for _hop in range(policy.max_redirects + 1):
        target = _check_url(current, policy.allow_networks)
        async with session.get(target, allow_redirects=False) as response:
            if response.status in _REDIRECTS:
                location = response.headers.get("Location")
                if not location:
                    raise FetchRefused(f"HTTP {response.status} without a Location")
                current = urljoin(str(response.url), location)
                logger.debug("web_fetch: redirect to {}", URL(current).with_query(None))
                continue
            if response.status >= 400:
                raise FetchRefused(f"HTTP {response.status} {response.reason or ''}".strip())
            content_type = response.content_type or "application/octet-stream"
            if not (
                content_type.startswith("text/")
                or content_type in _HTML_TYPES
                or content_type in _TEXT_TYPES
                or content_type.endswith(("+json", "+xml"))
            ):
                raise FetchRefused(f"the page is {content_type}, not text; only text is read")
            body = bytearray()
            cut = False
            async for chunk in response.content.iter_chunked(65_536):
                room = policy.max_bytes - len(body)
                if len(chunk) >= room:
                    body += chunk[:room]
                    cut = True
                    break
                body += chunk
            return Page(str(response.url), content_type, response.charset, bytes(body), cut)
    raise FetchRefused(f"more than {policy.max_redirects} redirects")


def readable_text(page: Page) -> str:
    """The page as text a model can read: the main content of HTML (trafilatura, which
    drops navigation and boilerplate), other text as it is. Blocking (parsing)."""
    if page.content_type in _HTML_TYPES:
        import trafilatura

        text = trafilatura.extract(
            page.body, output_format="markdown", include_links=False, favor_recall=True
        )
        if text:
            return str(text)
        # A page without a main text block (a short notice, a listing): its plain text.
        from lxml import html as lxml_html

        try:
            return str(lxml_html.fromstring(page.body).text_content()).strip()
        except Exception:  # lxml raises several kinds on hopeless input
            return ""
    return page.body.decode(page.charset or "utf-8", errors="replace")


async def web_fetch_text(
    url: str, policy: FetchPolicy, *, resolver: AbstractResolver | None = None
) -> str:
    """What the tool answers: the page's readable text, cut to `max_chars`, headed by
    the URL it came from (after redirects), or an `error:` line saying why not."""
    try:
        page = await fetch_page(url, policy, resolver=resolver)
    except FetchRefused as exc:
        logger.info("web_fetch refused: {}", exc)
        return f"error: {exc}"
    text = await anyio.to_thread.run_sync(readable_text, page)
    text = text.strip()
    notes = []
    if page.cut:
        notes.append(f"only the first {policy.max_bytes:,} bytes were read")
    if len(text) > policy.max_chars:
        notes.append(f"cut at {policy.max_chars:,} of {len(text):,} characters")
        text = text[: policy.max_chars]
    head = f"URL: {page.url}\n" + (f"({'; '.join(notes)})\n" if notes else "")
    return head + "\n" + (text or "(the page has no readable text)")


def web_fetch_tool(policy: FetchPolicy) -> Tool:
    """`web_fetch` bound to `policy` (the registry's timeout covers a little more than
    the fetch's own, which includes the text extraction's start)."""

    async def web_fetch(args: dict[str, Any], context: ToolContext) -> str:
        url = args.get("url")
        if not isinstance(url, str) or not url.strip():
            return "error: give the url to fetch"
        return await web_fetch_text(url.strip(), policy)

    return Tool(
        ToolSpec(
            name="web_fetch",
            description="Fetch a public web page (http or https) and read its main text. "
            "Private and local addresses are refused.",
            parameters={
                "type": "object",
                "properties": {"url": {"type": "string", "description": "The page's URL."}},
                "required": ["url"],
                "additionalProperties": False,
            },
        ),
        web_fetch,
        timeout=policy.timeout + 15.0,
    )
