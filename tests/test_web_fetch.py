"""`web_fetch` against a local web site: readable text, and refusal of hostile URLs.

Hostile fetches must be refused before any request leaves: the fake site logs every
request, and a refused fetch leaves its log empty (beyond the hops that were allowed).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp.abc import AbstractResolver, ResolveResult

from gateway.agent.tools import ToolContext, ToolRegistry
from gateway.agent.web_fetch import FetchPolicy, address_refusal, web_fetch_text, web_fetch_tool
from gateway.llm import ToolCall
from tests.fakes.web_server import ARTICLE_SENTENCE, ARTICLE_TITLE, FakeWeb

pytestmark = pytest.mark.anyio

LOCAL = ["127.0.0.1/32"]


@pytest.fixture
async def site() -> AsyncIterator[FakeWeb]:
    async with FakeWeb() as fake:
        yield fake


class MapResolver(AbstractResolver):
    """Names to addresses, as a DNS server that lies (or rebinds) would answer."""

    def __init__(self, names: dict[str, list[str]]) -> None:
        self.names = names

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        return [
            ResolveResult(
                hostname=host,
                host=address,
                port=port,
                family=socket.AF_INET6 if ":" in address else socket.AF_INET,
                proto=0,
                flags=socket.AI_NUMERICHOST,
            )
            for address in self.names[host]
        ]

    async def close(self) -> None:
        return None


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "a loopback address"),
        ("127.255.0.9", "a loopback address"),
        ("::1", "a loopback address"),
        ("10.1.2.3", "a private address"),
        ("172.16.0.1", "a private address"),
        ("192.168.1.1", "a private address"),
        ("fd00::1", "a private address"),
        ("169.254.169.254", "a link-local address"),
        ("fe80::1", "a link-local address"),
        ("0.0.0.0", "a private address"),
        ("::", "a private address"),
        ("224.0.0.1", "a multicast address"),
        ("100.64.0.1", "not a public address"),
        ("::ffff:127.0.0.1", "a loopback address"),
        ("::ffff:169.254.169.254", "a link-local address"),
        ("240.0.0.1", "a private address"),
        ("8.8.8.8", None),
        ("2606:4700:4700::1111", None),
    ],
)
def test_only_public_addresses_pass(address: str, kind: str | None) -> None:
    assert address_refusal(ipaddress.ip_address(address)) == kind


def test_the_operator_may_allow_networks() -> None:
    allowed = [ipaddress.ip_network("10.1.0.0/16")]
    assert address_refusal(ipaddress.ip_address("10.1.2.3"), allowed) is None
    assert address_refusal(ipaddress.ip_address("10.2.0.1"), allowed) == "a private address"


async def test_an_allowed_local_page_comes_back_as_readable_text(site: FakeWeb) -> None:
    text = await web_fetch_text(f"{site.url}/article", FetchPolicy.build(allow_networks=LOCAL))
    assert text.startswith(f"URL: {site.url}/article\n")
    assert ARTICLE_TITLE in text and ARTICLE_SENTENCE in text
    assert "SCRIPT_TEXT_MUST_NOT_APPEAR" not in text and "<p>" not in text
    plain = await web_fetch_text(f"{site.url}/plain", FetchPolicy.build(allow_networks=LOCAL))
    assert plain.endswith("just plain text\nline two")
    data = await web_fetch_text(f"{site.url}/data.json", FetchPolicy.build(allow_networks=LOCAL))
    assert data.endswith('{"otters": 3}')


async def test_loopback_is_refused_before_any_request(site: FakeWeb) -> None:
    text = await web_fetch_text(f"{site.url}/article", FetchPolicy.build())
    assert text == "error: 127.0.0.1 is a loopback address; not fetched"
    assert site.paths == []


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("[::1]", "::1 is a loopback address"),
        ("[::ffff:127.0.0.1]", "is a loopback address"),
        ("localhost", "localhost resolves to 127.0.0.1, a loopback address"),
        ("2130706433", "2130706433 is not a URL this tool fetches"),  # decimal 127.0.0.1
        ("0177.0.0.1", "0177.0.0.1 is not a URL this tool fetches"),  # octal
        ("0x7f000001", "resolves to 127.0.0.1, a loopback address"),  # hexadecimal
        ("127.1", "127.1 is not a URL this tool fetches"),  # short form
        ("0.0.0.0", "0.0.0.0 is a private address"),
        ("169.254.169.254", "169.254.169.254 is a link-local address"),
    ],
)
async def test_other_spellings_of_local_addresses_are_refused(
    site: FakeWeb, host: str, expected: str
) -> None:
    port = site.url.rsplit(":", 1)[1]
    text = await web_fetch_text(f"http://{host}:{port}/article", FetchPolicy.build())
    assert text.startswith("error: ") and expected in text
    assert site.paths == []


async def test_redirects_are_checked_hop_by_hop(site: FakeWeb) -> None:
    policy = FetchPolicy.build(allow_networks=LOCAL)
    port = site.url.rsplit(":", 1)[1]
    for target, expected in [
        (f"http://127.0.0.2:{port}/article", "127.0.0.2 is a loopback address"),
        ("http://169.254.169.254/latest/meta-data/", "169.254.169.254 is a link-local address"),
        (f"http://[::1]:{port}/article", "::1 is a loopback address"),
        ("file:///etc/passwd", "only http and https URLs are fetched"),
    ]:
        before = len(site.paths)
        text = await web_fetch_text(f"{site.url}/redirect?to={target}", policy)
        assert text.startswith("error: ") and expected in text
        assert len(site.paths) == before + 1  # the redirect itself, nothing after it
    # An allowed redirect is followed, and the text says where it ended.
    text = await web_fetch_text(f"{site.url}/redirect?to=/article", policy)
    assert f"URL: {site.url}/article" in text and ARTICLE_SENTENCE in text
    looping = await web_fetch_text(f"{site.url}/loop", FetchPolicy.build(allow_networks=LOCAL))
    assert looping == "error: more than 5 redirects"


async def test_names_are_checked_on_what_they_resolve_to(site: FakeWeb) -> None:
    """The check runs inside the resolver the connection uses: a name answered with a
    private address (as a rebinding DNS server would) is refused, and so is one whose
    answers mix an allowed address with a refused one."""
    port = site.url.rsplit(":", 1)[1]
    resolver = MapResolver(
        {"intranet.example": ["10.0.0.7"], "mixed.example": ["127.0.0.1", "192.168.0.3"]}
    )
    policy = FetchPolicy.build(allow_networks=LOCAL)
    text = await web_fetch_text(
        f"http://intranet.example:{port}/article", policy, resolver=resolver
    )
    assert text == "error: intranet.example resolves to 10.0.0.7, a private address; not fetched"
    text = await web_fetch_text(f"http://mixed.example:{port}/article", policy, resolver=resolver)
    assert "resolves to 192.168.0.3, a private address" in text
    assert site.paths == []
    # The same name, answered with an allowed address, is fetched from it.
    resolver.names["mixed.example"] = ["127.0.0.1"]
    text = await web_fetch_text(f"http://mixed.example:{port}/article", policy, resolver=resolver)
    assert ARTICLE_SENTENCE in text and site.paths == ["/article"]


async def test_a_huge_body_is_cut_at_the_byte_cap(site: FakeWeb) -> None:
    policy = FetchPolicy.build(allow_networks=LOCAL, max_bytes=1 << 20, max_chars=5000)
    text = await web_fetch_text(f"{site.url}/huge?mb=40", policy)
    head, _, body = text.partition("\n\n")
    assert "only the first 1,048,576 bytes were read" in head
    assert "cut at 5,000 of" in head
    assert len(body) == 5000 and body.startswith("otters otters")


async def test_a_slow_body_is_cut_off_by_the_timeout(site: FakeWeb) -> None:
    policy = FetchPolicy.build(allow_networks=LOCAL, timeout=1.5)
    text = await web_fetch_text(f"{site.url}/slow", policy)
    assert text == "error: no complete answer within 1.5s"


async def test_non_text_and_errors_are_refused_clearly(site: FakeWeb) -> None:
    policy = FetchPolicy.build(allow_networks=LOCAL)
    image = await web_fetch_text(f"{site.url}/image.png", policy)
    assert image == "error: the page is image/png, not text; only text is read"
    missing = await web_fetch_text(f"{site.url}/missing", policy)
    assert missing == "error: HTTP 404 Not Found"
    assert (await web_fetch_text("ftp://example.com/x", policy)).startswith(
        "error: only http and https URLs"
    )
    assert (await web_fetch_text("not a url", policy)).startswith("error: ")


async def test_the_tool_in_a_registry(site: FakeWeb) -> None:
    registry = ToolRegistry()
    registry.register(web_fetch_tool(FetchPolicy.build(allow_networks=LOCAL)))
    context = ToolContext(session_key="cli:direct")
    call = ToolCall(id="c1", function_name="web_fetch", arguments={"url": f"{site.url}/article"})
    assert ARTICLE_SENTENCE in await registry.execute(call, context)
    empty = ToolCall(id="c2", function_name="web_fetch", arguments={})
    assert await registry.execute(empty, context) == "error: give the url to fetch"
