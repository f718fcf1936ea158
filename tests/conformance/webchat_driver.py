"""The conformance kit's driver for the web chat: an HTTP client playing each person's
browser (tests/webchat_client.py), with its own cookie jar, as the page behaves.

Here the platform is the browser: a person's message is handed to the gateway when its
POST is answered 200 (after the journal); until then the browser keeps it and posts it
again with the same id. A reply is handed back when it is in the visitor's log; the
browser reads the log from the last event it saw. The browsers reach the gateway through
a TCP proxy, which `platform_down` cuts (open streams drop, posts fail).

What the web chat can do, as the kit meets it (`requirements`):
- groups, mentions, threads: no (a visitor talks to the bot alone; a visitor's several
  conversations are /new, one session key);
- edits: no (the page sends no edits);
- duplicate delivery: yes: the page posts a message again until it gets a 200, and two
  tabs of a visitor post the messages they both hold; `redeliver` posts it again;
- catch-up: yes: a message the gateway did not take (down, killed before its 200) stays
  in the browser and is posted again when the gateway is back;
- strangers: yes (a new visitor gets a pairing code with `dm_policy = "pairing"`);
- signed inbound: yes: the cookie is signed and a change needs its CSRF token; `forge`
  posts with an altered cookie and with a good cookie but no token, both must be refused;
- long replies: no limit, one post; mass pings: none; the network can be cut.

Loading the page needs the gateway (the visitor's cookie comes from it), so people have
the page open before they write: the first message of a scenario opens it for the first
`OPEN_AT_ONCE` people (the kit's outage has someone write for the first time while the
network is cut; a person who never loaded the page could not). Every kit person writes
from 127.0.0.1, faster than a person does: the rate limits are off here
(tests/test_webchat_http.py holds them).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp

from gateway.testing import ChannelDriver, MessageRef, Place, Post, Requirements
from tests.fakes._serving import free_port
from tests.fakes.tcp_proxy import TcpProxy
from tests.webchat_client import API, Browser, Browsers

PREFIX = "GATEWAY_CHANNELS__WEB__"
#: People whose page is open from the first message of a scenario.
OPEN_AT_ONCE = 8


class WebChatDriver(ChannelDriver):
    """The web chat: one visitor (a browser) per person."""

    name = "web"
    requirements = Requirements(
        groups=False,
        mentions=False,
        threads=False,
        edits=False,
        duplicate_delivery=True,
        catch_up=True,
        strangers=True,
        signed_inbound=True,
        split_long_replies=False,
        mass_pings=False,
        platform_outage=True,
    )

    def __init__(self) -> None:
        self._browsers: Browsers | None = None
        self._proxy: TcpProxy | None = None
        self._port = 0
        self._people: dict[int, Browser] = {}
        self._texts: dict[str, tuple[int, str]] = {}
        self.forged: list[str] = []

    @property
    def browsers(self) -> Browsers:
        if self._browsers is None:
            raise RuntimeError("the platform is not running")
        return self._browsers

    @contextmanager
    def running(self) -> Iterator[None]:
        self._port = free_port()  # fixed: the browsers come back to the same address
        proxy = TcpProxy("127.0.0.1", self._port)
        proxy.restore()
        self._proxy, self._browsers = proxy, Browsers()
        self._people, self._texts, self.forged = {}, {}, []
        try:
            yield
        finally:
            self.browsers.close()
            proxy.close()
            self._proxy = self._browsers = None

    @property
    def url(self) -> str:
        assert self._proxy is not None
        return f"http://127.0.0.1:{self._proxy.port}"

    def gateway_env(self) -> dict[str, str]:
        return {
            "GATEWAY_HTTP__PORT": str(self._port),
            f"{PREFIX}ENABLED": "true",
            f"{PREFIX}DM_POLICY": "open",
            f"{PREFIX}VISITOR_MESSAGES_PER_MINUTE": "0",
            f"{PREFIX}ADDRESS_MESSAGES_PER_MINUTE": "0",
            f"{PREFIX}ADDRESS_NEW_VISITORS_PER_HOUR": "0",
        }

    def platform_down(self) -> None:
        assert self._proxy is not None
        self._proxy.cut()

    def platform_up(self) -> None:
        assert self._proxy is not None
        self._proxy.restore()

    # -- people -------------------------------------------------------------------------

    def _browser(self, person: int) -> Browser:
        """Person n's browser: a visitor of its own (it asks the gateway for its cookie on
        first use, waiting while the gateway is away)."""
        if not self._people:
            for other in range(OPEN_AT_ONCE):
                self._open(other)
        return self._people.get(person) or self._open(person)

    def _open(self, person: int) -> Browser:
        browser = self.browsers.open(self.url, name=f"person{person}", retry_pause=0.2)
        self._people[person] = browser
        return browser

    def dm(self, person: int, text: str) -> MessageRef:
        browser = self._browser(person)
        message_id = uuid.uuid4().hex
        self._texts[message_id] = (person, text)
        self.browsers.soon(lambda: browser.queue(text, message_id=message_id))
        return MessageRef(
            id=message_id, place=Place(browser.visitor), sender=browser.visitor, event=message_id
        )

    def redeliver(self, ref: MessageRef) -> None:
        # The page posts a message it holds again (another tab holds it too, or the 200
        # was lost): the same id, behind what the browser still has to send.
        person, text = self._texts[ref.event]
        browser = self._people[person]
        self.browsers.soon(lambda: browser.queue(text, message_id=ref.id))

    def forge(self, text: str) -> bool:
        victim = self._browser(0)

        async def attempts() -> list[int]:
            statuses = []
            cookie = f"v1.{victim.visitor}.9999999999.{'A' * 43}"  # a MAC nobody made
            body = {"id": uuid.uuid4().hex, "text": text, "files": []}
            async with (
                aiohttp.ClientSession() as forger,
                forger.post(
                    f"{self.url}{API}/messages",
                    json=body,
                    headers={"Cookie": f"gateway_webchat={cookie}", "X-CSRF-Token": victim.csrf},
                ) as answer,
            ):
                statuses.append(answer.status)
            # The victim's own cookie without its token: what a page of another site can
            # make the victim's browser send.
            status, _, _ = await victim.request(
                "POST", f"{API}/messages", json=body, headers={"X-CSRF-Token": "forged"}
            )
            statuses.append(status)
            return statuses

        statuses = self.browsers.call(attempts)
        self.forged.append(f"forged posts answered {statuses}")
        return all(status in (401, 403) for status in statuses)

    # -- what the bot posted ------------------------------------------------------------

    def bot_posts(self) -> list[Post]:
        async def snapshot() -> list[tuple[str, list[dict[str, Any]]]]:
            return [(b.visitor, list(b.replies())) for b in self._people.values()]

        posts = []
        for visitor, replies in self.browsers.call(snapshot):
            for reply in replies:
                posts.append(
                    Post(
                        place=Place(visitor),
                        text=str(reply["text"]),
                        reply_to=str(reply["message_id"]) or None,
                    )
                )
        return posts

    def platform_log(self) -> Iterator[str]:
        async def lines() -> list[str]:
            found = list(self.forged)
            for person, browser in sorted(self._people.items()):
                twice = sorted(n for n, count in browser.deliveries.items() if count > 1)
                found.append(
                    f"person{person} = web:{browser.visitor}: {len(browser.events)} events, "
                    f"last {browser.last}, delivered twice: {twice}, outbox {len(browser.outbox)}"
                )
                for item in browser.sent.values():
                    found.append(
                        f"  {item.id} {item.text[:40]!r} attempts={item.attempts} "
                        f"statuses={item.statuses[-6:]}"
                    )
                found.extend(f"  {line}" for line in browser.journal[-200:])
            return found

        yield from self.browsers.call(lines, timeout=30)
